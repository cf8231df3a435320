"""Pins of one turn of ``rollouts.turn_loop`` (``_run_turn``) and of ``cut_observation``: what each trajectory
records from the backend and the env (counters, reward, finish reason, the observation's room boundary, the
budget, keys and decode arguments), with a character tokenizer and scripted envs so every count is exact."""

from __future__ import annotations

from stppo_agent.rollouts.batch import Trajectory
from stppo_agent.rollouts.generation import Generation
from stppo_agent.rollouts.turn_loop import RolloutLimits, _run_turn, cut_observation


class CharTokenizer:
    pad_token_id = 0

    def __init__(self):
        self.decode_calls = []

    def __call__(self, text, **kwargs):
        return {"input_ids": ([1] if kwargs.get("add_special_tokens", True) else []) + [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        self.decode_calls.append(skip_special_tokens)
        return "".join(chr(i) for i in ids)


class StepEnv:
    def __init__(self, result):
        self.result, self.actions = result, []

    def step(self, action):
        self.actions.append(action)
        return self.result


class KeyBackend:
    def __init__(self, n=4):
        self.n, self.calls = n, []

    def generate(self, contexts, max_new_tokens, keys=None):
        self.calls.append((max_new_tokens, keys))
        return [Generation([ord("a") + i for i in range(self.n)], [-0.1 * (i + 1) for i in range(self.n)])
                for _ in contexts]


class OldBackend:
    def __init__(self):
        self.calls = []

    def generate(self, contexts, max_new_tokens):
        self.calls.append(max_new_tokens)
        return [Generation([ord("a")] * 3, [-1.0] * 3) for _ in contexts]


def _traj(env, prompt_len=2):
    return Trajectory(env=env, group_id=0, prompt_ids=[5] * prompt_len)


LIMITS = RolloutLimits(max_turns=4, max_new_tokens_per_turn=3, max_observation_tokens=4, max_prompt_tokens=10,
                       max_total_tokens=20)


def test_cut_observation_boundary():
    tok = CharTokenizer()
    assert cut_observation(tok, "abcd", 4) == ([97, 98, 99, 100], False)
    assert cut_observation(tok, "abcde", 4) == ([97, 98, 99, 100], True)
    assert cut_observation(tok, "abc", 4) == ([97, 98, 99], False)


def test_budget_keys_decode_and_logprobs():
    tok, backend = CharTokenizer(), KeyBackend(n=5)
    env_a, env_b = StepEnv(("obs", 0.0, False, False, {})), StepEnv(("obs", 0.0, False, False, {}))
    a, b = _traj(env_a, prompt_len=2), _traj(env_b, prompt_len=16)  # b has 20 - 16 = 4 > 3 room
    b2 = _traj(StepEnv(("o", 0.0, False, False, {})), prompt_len=18)  # 2 left: budget 2
    _run_turn(backend, tok, [a, b, b2], turn=2, limits=LIMITS)
    assert backend.calls == [(3, [id(a), id(b), id(b2)])]
    assert a.response_ids[:3] == [97, 98, 99] and a.sample_logprobs[:3] == [-0.1, -0.2, -0.30000000000000004]
    assert a.turn_ids[:3] == [2, 2, 2] and a.policy_mask[:3] == [True] * 3
    assert env_a.actions == ["abc"] and tok.decode_calls == [True, True, True]
    assert b2.response_ids == [97, 98] and b2.sample_logprobs == [-0.1, -0.2]
    assert b2.done and b2.truncated and b2.finish_reason == "max_total_tokens"  # no room left for the observation
    assert b2.observations == 1 and b2.response_ids == [97, 98]


def test_backend_without_keys_still_works():
    backend = OldBackend()
    t = _traj(StepEnv(("o", 0.0, False, False, {})))
    _run_turn(backend, CharTokenizer(), [t], turn=0, limits=LIMITS)
    assert backend.calls == [3] and t.response_ids == [97, 97, 97, 111]


def test_observation_counters_and_cut():
    t = _traj(StepEnv(("abcdefg", 0.0, False, False, {"search_calls": 2, "invalid_actions": 3,
                                                      "search_errors": 4})))
    _run_turn(KeyBackend(n=3), CharTokenizer(), [t], turn=1, limits=LIMITS)
    assert (t.turns, t.search_calls, t.invalid_actions, t.search_errors) == (1, 2, 3, 4)
    assert (t.observations, t.observations_cut) == (1, 1)
    assert t.response_ids == [97, 98, 99, 97, 98, 99, 100]
    assert t.policy_mask == [True] * 3 + [False] * 4 and t.turn_ids == [1, 1, 1, -1, -1, -1, -1]
    assert not t.done and not t.truncated and t.finish_reason == "" and t.reward == 0.0
    u = _traj(StepEnv(("ab", 0.0, False, False, {})))
    _run_turn(KeyBackend(n=3), CharTokenizer(), [u], turn=0, limits=LIMITS)
    assert (u.search_calls, u.invalid_actions, u.search_errors) == (0, 0, 0)
    assert (u.observations, u.observations_cut, u.turns) == (1, 0, 1)


def test_terminated_and_truncated_episodes():
    ans = _traj(StepEnv(("x", 1, True, False, {"prediction": "p"})))
    cut = _traj(StepEnv(("x", 0.5, False, True, {"prediction": None})))
    _run_turn(KeyBackend(n=3), CharTokenizer(), [ans, cut], turn=0, limits=LIMITS)
    assert (ans.done, ans.reward, ans.terminated, ans.truncated, ans.answered, ans.finish_reason) == \
        (True, 1.0, True, False, True, "answer")
    assert type(ans.reward) is float and type(ans.terminated) is bool
    assert (cut.done, cut.reward, cut.terminated, cut.truncated, cut.answered, cut.finish_reason) == \
        (True, 0.5, False, True, False, "max_turns")
    assert ans.observations == 0 and ans.response_ids == [97, 98, 99]


def test_observation_exactly_filling_the_room_ends_the_episode():
    # prompt 2 + 3 generated = 5; room = 20 - 5 = 15
    fits = _traj(StepEnv(("a" * 14, 0.0, False, False, {})))
    full = _traj(StepEnv(("a" * 15, 0.0, False, False, {})))
    limits = RolloutLimits(max_turns=4, max_new_tokens_per_turn=3, max_observation_tokens=16, max_prompt_tokens=10,
                           max_total_tokens=20)
    _run_turn(KeyBackend(n=3), CharTokenizer(), [full, fits], turn=0, limits=limits)  # the ended one first
    assert not fits.done and len(fits.response_ids) == 17
    assert full.done and full.truncated and full.finish_reason == "max_total_tokens"
    assert len(full.response_ids) == 18 and full.turn_ids[3:] == [-1] * 15 and full.policy_mask[3:] == [False] * 15
    over = _traj(StepEnv(("a" * 16, 0.0, False, False, {})))
    _run_turn(KeyBackend(n=3), CharTokenizer(), [over], turn=0, limits=limits)
    assert len(over.response_ids) == 18 and over.done


def test_counters_accumulate_over_turns():
    t = _traj(StepEnv(("abcdef", 0.0, False, False, {})), prompt_len=1)
    limits = RolloutLimits(max_turns=4, max_new_tokens_per_turn=2, max_observation_tokens=4, max_prompt_tokens=10,
                           max_total_tokens=40)
    _run_turn(KeyBackend(n=2), CharTokenizer(), [t], turn=0, limits=limits)
    _run_turn(KeyBackend(n=2), CharTokenizer(), [t], turn=1, limits=limits)
    assert (t.turns, t.observations, t.observations_cut) == (2, 2, 2)
    assert t.turn_ids == [0, 0, -1, -1, -1, -1, 1, 1, -1, -1, -1, -1]
    assert not t.done


def test_budget_counts_the_response_so_far():
    t = _traj(StepEnv(("o", 0.0, False, False, {})), prompt_len=2)
    t.append([9] * 16, policy=False, turn=0)  # 2 + 16 of 20: room for 2
    backend = KeyBackend(n=5)
    _run_turn(backend, CharTokenizer(), [t], turn=1, limits=LIMITS)
    assert backend.calls[0][0] == 2 and t.response_ids[16:18] == [97, 98]
    assert t.done and t.finish_reason == "max_total_tokens"
