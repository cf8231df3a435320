"""``stppo_agent.rollouts.turn_loop``: every limit at its boundary, the token budget
a trajectory never exceeds, what reaches the backend and the env each turn, and how each trajectory ends. A
character tokenizer, scripted envs and a scripted backend keep every count exact."""

from __future__ import annotations

import collections

import pytest

from stppo_agent.rollouts.batch import Trajectory
from stppo_agent.rollouts.generation import Generation
from stppo_agent.rollouts.turn_loop import (
    RolloutLimitError,
    RolloutLimits,
    _run_turn,
    collect_rollouts,
    cut_observation,
    encode_observation,
    encode_prompt,
)

PAD, BOS, EOS = 0, 1, 2


class CharTokenizer:
    """One id per character (its code point); BOS first when special tokens are asked for; ids below 3 special."""

    pad_token_id = PAD
    chat_template = None

    def __init__(self):
        self.calls = []

    def __call__(self, text, **kwargs):
        self.calls.append((text, kwargs))
        special = kwargs.get("add_special_tokens", True)  # the Hugging Face default
        return {"input_ids": ([BOS] if special else []) + [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if (i < 3 and skip_special_tokens) else (chr(i) if i >= 3 else f"<{i}>") for i in ids)


def ids(text):
    return [ord(c) for c in text]


class ScriptEnv:
    """Not a SearchQAEnv, so step_envs steps it plainly: returns its script's steps in order, records actions."""

    def __init__(self, prompt="P" * 5, steps=(), info=None):
        self.prompt, self.steps, self.actions, self.resets = prompt, list(steps), [], []
        self.info = info if info is not None else {"example_id": "e", "benchmark": "b", "question": "q"}

    def reset(self, seed=None, options=None):
        self.resets.append((seed, options))
        return self.prompt, dict(self.info)

    def step(self, action):
        self.actions.append(action)
        return self.steps[len(self.actions) - 1]


def going(obs, **info):
    return obs, 0.0, False, False, info


class ScriptBackend:
    """Each call returns, per context, the next of ``turns`` (the same for every trajectory), with logprobs -0.1*k."""

    def __init__(self, turns):
        self.turns, self.calls = list(turns), []

    def generate(self, contexts, max_new_tokens, keys=None):
        self.calls.append({"contexts": [list(c) for c in contexts], "max_new_tokens": max_new_tokens,
                           "keys": None if keys is None else list(keys)})
        out = self.turns[len(self.calls) - 1]
        return [Generation(list(out), [-0.1 * (k + 1) for k in range(len(out))]) for _ in contexts]


def limits(**kw):
    base = dict(max_turns=3, max_new_tokens_per_turn=10, max_observation_tokens=50, max_prompt_tokens=20,
                max_total_tokens=200)
    base.update(kw)
    return RolloutLimits(**base)


# ---------------------------------------------------------------- limits


def test_default_limits():
    assert RolloutLimits() == RolloutLimits(max_turns=4, max_new_tokens_per_turn=256, max_observation_tokens=512,
                                            max_prompt_tokens=1024, max_total_tokens=4096)


@pytest.mark.parametrize("name", ["max_turns", "max_new_tokens_per_turn", "max_observation_tokens",
                                  "max_prompt_tokens", "max_total_tokens"])
def test_each_limit_must_be_at_least_one(name):
    ok = dict(max_turns=1, max_new_tokens_per_turn=1, max_observation_tokens=1, max_prompt_tokens=1,
              max_total_tokens=2)
    RolloutLimits(**ok).validate()  # every limit at 1: valid
    with pytest.raises(RolloutLimitError) as error:
        RolloutLimits(**{**ok, name: 0}).validate()
    assert str(error.value) == f"rollout limit {name} must be >= 1, got 0"


def test_total_must_fit_prompt_plus_one_turn_exactly_at_the_boundary():
    RolloutLimits(max_prompt_tokens=90, max_new_tokens_per_turn=10, max_total_tokens=100).validate()
    with pytest.raises(RolloutLimitError) as error:
        RolloutLimits(max_prompt_tokens=90, max_new_tokens_per_turn=11, max_total_tokens=100).validate()
    assert str(error.value) == "max_total_tokens (100) must fit max_prompt_tokens (90) + max_new_tokens_per_turn (11)"


def test_collect_rollouts_validates_its_limits_before_anything():
    env = ScriptEnv()
    with pytest.raises(RolloutLimitError, match="max_turns"):
        collect_rollouts(ScriptBackend([]), CharTokenizer(), [env], [{}], [0], limits(max_turns=0))
    assert env.resets == []


# ---------------------------------------------------------------- encoding


def test_encode_prompt_without_a_chat_template_adds_special_tokens():
    tok = CharTokenizer()
    assert encode_prompt(tok, "ab") == [BOS, 97, 98]
    assert tok.calls == [("ab", {"add_special_tokens": True})]  # asked for, whatever the tokenizer's default
    tok.chat_template = ""  # an empty template is no template
    assert encode_prompt(tok, "ab") == [BOS, 97, 98]

    class Bare:  # a tokenizer without a chat_template attribute at all
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [BOS] * add_special_tokens + [ord(c) for c in text]}

    assert encode_prompt(Bare(), "ab") == [BOS, 97, 98]


class ChatTokenizer(CharTokenizer):
    chat_template = "{{ messages }}"

    def __init__(self, returns):
        super().__init__()
        self.returns, self.chat_calls = returns, []

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        self.chat_calls.append((messages, add_generation_prompt, tokenize))
        return self.returns


class Encoding(collections.UserDict):
    """Like transformers' BatchEncoding: a mapping with keys() that is not a dict."""


@pytest.mark.parametrize("returns", [(7, 8, 9), {"input_ids": [7, 8, 9]}, Encoding(input_ids=[7, 8, 9])])
def test_encode_prompt_with_a_chat_template_is_one_user_turn_plus_generation_prompt(returns):
    tok = ChatTokenizer(returns)
    assert encode_prompt(tok, "question") == [7, 8, 9]
    assert tok.chat_calls == [([{"role": "user", "content": "question"}], True, True)]
    assert tok.calls == []


def test_encode_observation_has_no_special_tokens_and_is_cut_at_the_limit():
    tok = CharTokenizer()
    assert encode_observation(tok, "abcdef", 4) == ids("abcd")
    assert encode_observation(tok, "abc", 3) == ids("abc")
    assert tok.calls == [("abcdef", {"add_special_tokens": False}), ("abc", {"add_special_tokens": False})]


# ---------------------------------------------------------------- prompts and resets


def test_prompt_at_the_limit_is_accepted_and_one_over_is_refused():
    tok = CharTokenizer()
    ok = ScriptEnv(prompt="x" * 4, steps=[("", 1.0, True, False, {"prediction": "a"})])  # 5 ids with BOS
    collect_rollouts(ScriptBackend([ids("a")]), tok, [ok], [{}], [0], limits(max_prompt_tokens=5))
    over = ScriptEnv(prompt="x" * 5)
    with pytest.raises(RolloutLimitError) as error:
        collect_rollouts(ScriptBackend([]), tok, [over], [{}], [0], limits(max_prompt_tokens=5))
    assert str(error.value) == ("a prompt has 6 tokens, over max_prompt_tokens=5 (raise it or shorten the "
                                "template)")


def test_resets_get_their_own_seed_and_options_and_the_batch_keeps_group_ids_and_episode_info():
    end = ("", 0.5, True, False, {"prediction": "p"})
    envs = [ScriptEnv(steps=[end], info={"example_id": f"e{i}", "benchmark": "nq", "question": f"q{i}",
                                         "golden": "secret"}) for i in range(2)]
    envs[1].info.pop("question")
    batch = collect_rollouts(ScriptBackend([ids("a")]), CharTokenizer(), envs, [{"index": 4}, {"index": 7}],
                             ["3", 5], limits(), seeds=[11, None])
    assert envs[0].resets == [(11, {"index": 4})] and envs[1].resets == [(None, {"index": 7})]
    assert batch.group_ids.tolist() == [3, 5]
    assert batch.episode_info == [{"example_id": "e0", "benchmark": "nq", "question": "q0", "finish_reason": "answer"},
                                  {"example_id": "e1", "benchmark": "nq", "finish_reason": "answer"}]
    no_seeds = ScriptEnv(steps=[end])
    collect_rollouts(ScriptBackend([ids("a")]), CharTokenizer(), [no_seeds], [{"index": 1}], [0], limits())
    assert no_seeds.resets == [(None, {"index": 1})]


# ---------------------------------------------------------------- turns


def test_each_turn_generates_from_the_exact_ids_so_far_and_masks_observations():
    envs = [ScriptEnv(steps=[going("OBS"), ("", 1.0, True, False, {"prediction": "x"})])]
    backend = ScriptBackend([ids("ab") + [EOS], ids("cd")])
    batch = collect_rollouts(backend, CharTokenizer(), envs, [{}], [0], limits())
    prompt = [BOS] + ids("PPPPP")
    assert backend.calls[0]["contexts"] == [prompt]
    assert backend.calls[1]["contexts"] == [prompt + ids("ab") + [EOS] + ids("OBS")]
    response = ids("ab") + [EOS] + ids("OBS") + ids("cd")
    assert batch.response_ids[0].tolist() == response
    assert batch.loss_mask[0].tolist() == [True] * 3 + [False] * 3 + [True] * 2
    assert batch.turn_ids[0].tolist() == [0, 0, 0, -1, -1, -1, 1, 1]
    assert batch.sample_logprobs[0].tolist() == pytest.approx([-0.1, -0.2, -0.3, 0, 0, 0, -0.1, -0.2])
    assert envs[0].actions == ["ab", "cd"]  # decoded without special tokens
    assert batch.rewards.tolist() == [1.0] and batch.terminated.tolist() == [True]
    assert batch.truncated.tolist() == [False]


def test_observations_are_cut_to_max_observation_tokens():
    env = ScriptEnv(steps=[going("0123456789"), ("", 0.0, True, False, {})])
    batch = collect_rollouts(ScriptBackend([ids("a"), ids("b")]), CharTokenizer(), [env], [{}], [0],
                             limits(max_observation_tokens=4))
    assert batch.response_ids[0].tolist() == ids("a") + ids("0123") + ids("b")


def test_backends_get_trajectory_keys_and_older_backends_without_keys_still_work():
    steps = [going("o"), going("o"), ("", 0.0, True, False, {})]
    envs = [ScriptEnv(steps=steps), ScriptEnv(steps=steps[1:])]
    backend = ScriptBackend([ids("a")] * 3)
    collect_rollouts(backend, CharTokenizer(), envs, [{}, {}], [0, 1], limits())
    keys = [call["keys"] for call in backend.calls]
    assert len(set(keys[0])) == 2 and keys[1] == keys[0] and keys[2] == keys[0][:1]

    class Legacy:
        def __init__(self):
            self.calls = []

        def generate(self, contexts, max_new_tokens):
            self.calls.append((len(contexts), max_new_tokens))
            return [Generation(ids("a"), [-1.0]) for _ in contexts]

    legacy = Legacy()
    batch = collect_rollouts(legacy, CharTokenizer(), [ScriptEnv(steps=[("", 2.0, True, False, {})])], [{}], [0],
                             limits(max_new_tokens_per_turn=7))
    assert legacy.calls == [(1, 7)] and batch.rewards.tolist() == [2.0]


def test_counters_and_endings_per_trajectory():
    answer = ("", 1.0, True, False, {"prediction": "x", "search_calls": 1, "invalid_actions": 2, "search_errors": 3})
    cut = ("", -0.5, False, True, {"search_calls": 4})
    unanswered = ("", 0.0, True, False, {"prediction": None})
    envs = [ScriptEnv(steps=[going("o"), answer]), ScriptEnv(steps=[cut]), ScriptEnv(steps=[unanswered])]
    on_turn = []
    batch = collect_rollouts(ScriptBackend([ids("a")] * 3), CharTokenizer(), envs, [{}] * 3, [0, 0, 1], limits(),
                             on_turn=lambda turn, n: on_turn.append((turn, n)))
    assert on_turn == [(0, 3), (1, 1)]  # no third turn: nothing was active any more
    assert batch.rewards.tolist() == [1.0, -0.5, 0.0]
    assert batch.terminated.tolist() == [True, False, True] and batch.truncated.tolist() == [False, True, False]
    assert [e["finish_reason"] for e in batch.episode_info] == ["answer", "max_turns", "answer"]
    assert batch.stats["turns"] == pytest.approx(4 / 3)
    assert batch.stats["search_calls"] == pytest.approx(5 / 3)
    assert batch.stats["search_errors"] == pytest.approx(1.0)
    assert batch.stats["answer_rate"] == pytest.approx(1 / 3)  # a None prediction is no answer
    assert batch.stats["invalid_action_rate"] == pytest.approx(2 / 4)


def test_counters_missing_from_info_are_zero():
    env = ScriptEnv(steps=[going("o", search_calls=5, invalid_actions=5, search_errors=5), ("", 0.0, True, False, {})])
    batch = collect_rollouts(ScriptBackend([ids("a")] * 2), CharTokenizer(), [env], [{}], [0], limits())
    assert batch.stats["search_calls"] == 0 and batch.stats["search_errors"] == 0
    assert batch.stats["invalid_action_rate"] == 0 and batch.stats["answer_rate"] == 0


def test_an_env_allowing_more_turns_is_truncated_at_max_turns():
    env = ScriptEnv(steps=[going("o")] * 5)
    ends = []

    class Ending(ScriptBackend):
        def end_rollout(self):
            ends.append(len(self.calls))

    ending = Ending([ids("a")] * 5)
    batch = collect_rollouts(ending, CharTokenizer(), [env], [{}], [0], limits(max_turns=2))
    assert len(ending.calls) == 2 and env.actions == ["a", "a"] and ends == [2]
    assert batch.truncated.tolist() == [True] and batch.terminated.tolist() == [False]
    assert batch.episode_info[0]["finish_reason"] == "max_turns" and batch.stats["turns"] == 2
    assert batch.stats["truncated_max_total_tokens"] == 0


def test_end_rollout_runs_even_when_a_turn_fails():
    ends = []

    class Failing:
        def generate(self, contexts, max_new_tokens, keys=None):
            raise RuntimeError("boom")

        def end_rollout(self):
            ends.append(True)

    with pytest.raises(RuntimeError, match="boom"):
        collect_rollouts(Failing(), CharTokenizer(), [ScriptEnv()], [{}], [0], limits())
    assert ends == [True]


# ---------------------------------------------------------------- the token budget


def test_generations_are_cut_to_each_trajectorys_own_budget():
    """Budget per turn = min(max_new_tokens_per_turn, what is left of max_total_tokens); the backend is asked for
    the largest of them, and each trajectory keeps only its own budget."""
    tok = CharTokenizer()
    short, long = ScriptEnv(prompt="p", steps=[going("o"), going("o")]), ScriptEnv(prompt="p" * 9,
                                                                                   steps=[going("o"), going("o")])
    backend = ScriptBackend([ids("abcdefghijkl")] * 2)
    # prompts of 2 and 10 ids; total 20: first turn budgets min(8, 18)=8 and min(8, 10)=8
    batch = collect_rollouts(backend, tok, [short, long], [{}, {}], [0, 1],
                             limits(max_turns=2, max_new_tokens_per_turn=8, max_prompt_tokens=10, max_total_tokens=20,
                                    max_observation_tokens=1))
    assert backend.calls[0]["max_new_tokens"] == 8
    # second turn: short has 2+8+1=11 used -> min(8, 9)=8; long has 10+8+1=19 -> 1
    assert backend.calls[1]["max_new_tokens"] == 8
    assert short.actions == ["abcdefgh", "abcdefgh"] and long.actions == ["abcdefgh", "a"]
    n = batch.attention_mask.sum(dim=1).tolist()
    assert n == [2 + 8 + 1 + 8 + 1, 20]


def test_an_observation_exactly_filling_the_budget_ends_the_trajectory():
    # prompt 6 ids + 4 generated = 10 of 14: room 4; an observation of 4 fills it -> ended, kept whole
    env = ScriptEnv(steps=[going("wxyz"), going("o")])
    batch = collect_rollouts(ScriptBackend([ids("abcd"), ids("e")]), CharTokenizer(), [env], [{}], [0],
                             limits(max_new_tokens_per_turn=4, max_prompt_tokens=10, max_total_tokens=14))
    assert env.actions == ["abcd"]
    assert batch.response_ids[0].tolist() == ids("abcd") + ids("wxyz")
    assert int(batch.attention_mask.sum()) == 14
    assert batch.truncated.tolist() == [True] and batch.terminated.tolist() == [False]
    assert batch.episode_info[0]["finish_reason"] == "max_total_tokens"
    assert batch.stats["truncated_max_total_tokens"] == 1.0 and batch.stats["turns"] == 1


def test_an_observation_one_short_of_the_budget_leaves_a_one_token_turn():
    env = ScriptEnv(steps=[going("xyz"), ("", 1.0, True, False, {"prediction": "e"})])
    backend = ScriptBackend([ids("abcd"), ids("efg")])
    batch = collect_rollouts(backend, CharTokenizer(), [env], [{}], [0],
                             limits(max_new_tokens_per_turn=4, max_prompt_tokens=10, max_total_tokens=14))
    assert backend.calls[1]["max_new_tokens"] == 1 and env.actions == ["abcd", "e"]
    assert batch.response_ids[0].tolist() == ids("abcd") + ids("xyz") + ids("e")
    assert int(batch.attention_mask.sum()) == 14 and batch.episode_info[0]["finish_reason"] == "answer"


def test_a_long_observation_is_cut_to_the_room_left():
    env = ScriptEnv(steps=[going("0123456789")])
    batch = collect_rollouts(ScriptBackend([ids("ab")]), CharTokenizer(), [env], [{}], [0],
                             limits(max_new_tokens_per_turn=4, max_prompt_tokens=10, max_total_tokens=14))
    assert batch.response_ids[0].tolist() == ids("ab") + ids("012345")
    assert batch.loss_mask[0].tolist() == [True] * 2 + [False] * 6
    assert int(batch.attention_mask.sum()) == 14 and batch.truncated.tolist() == [True]


@pytest.mark.parametrize("total", [12, 13, 17, 30])
def test_no_trajectory_is_ever_longer_than_max_total_tokens(total):
    """Backends that ignore max_new_tokens, long observations, many turns: the length never exceeds the budget,
    and a trajectory that ran out says so."""
    envs = [ScriptEnv(prompt="p" * k, steps=[going("o" * 7)] * 6) for k in (1, 3, 8)]
    batch = collect_rollouts(ScriptBackend([ids("g" * 9)] * 6), CharTokenizer(), envs, [{}] * 3, [0, 1, 2],
                             limits(max_turns=6, max_new_tokens_per_turn=3, max_prompt_tokens=9,
                                    max_total_tokens=total, max_observation_tokens=7))
    lengths = batch.attention_mask.sum(dim=1).tolist()
    assert all(n <= total for n in lengths), lengths
    for length, info in zip(lengths, batch.episode_info):
        assert (info["finish_reason"] == "max_total_tokens") == (length == total)


def test_a_trajectory_running_out_does_not_stop_the_others_turn():
    """The first trajectory fills its budget with an observation; the second, later in the same turn, still gets its
    observation, counters and next turn."""
    full = ScriptEnv(prompt="p" * 9, steps=[going("o" * 9, search_calls=1)])
    rest = ScriptEnv(prompt="p", steps=[going("OBS", search_calls=1),
                                                   ("", 1.0, True, False, {"prediction": "a", "search_calls": 1})])
    backend = ScriptBackend([ids("ab"), ids("c")])
    batch = collect_rollouts(backend, CharTokenizer(), [full, rest], [{}, {}], [0, 1],
                             limits(max_new_tokens_per_turn=4, max_prompt_tokens=10, max_total_tokens=14))
    assert batch.response_ids[1].tolist()[:6] == ids("ab") + ids("OBS") + ids("c")
    assert [e["finish_reason"] for e in batch.episode_info] == ["max_total_tokens", "answer"]
    assert batch.stats["turns"] == 1.5 and batch.stats["search_calls"] == 1.0
    assert len(backend.calls[1]["contexts"]) == 1


class DecodeRecordingTokenizer:
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
    tok = DecodeRecordingTokenizer()
    assert cut_observation(tok, "abcd", 4) == ([97, 98, 99, 100], False)
    assert cut_observation(tok, "abcde", 4) == ([97, 98, 99, 100], True)
    assert cut_observation(tok, "abc", 4) == ([97, 98, 99], False)


def test_budget_keys_decode_and_logprobs():
    tok, backend = DecodeRecordingTokenizer(), KeyBackend(n=5)
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
    _run_turn(backend, DecodeRecordingTokenizer(), [t], turn=0, limits=LIMITS)
    assert backend.calls == [3] and t.response_ids == [97, 97, 97, 111]


def test_observation_counters_and_cut():
    t = _traj(StepEnv(("abcdefg", 0.0, False, False, {"search_calls": 2, "invalid_actions": 3,
                                                      "search_errors": 4})))
    _run_turn(KeyBackend(n=3), DecodeRecordingTokenizer(), [t], turn=1, limits=LIMITS)
    assert (t.turns, t.search_calls, t.invalid_actions, t.search_errors) == (1, 2, 3, 4)
    assert (t.observations, t.observations_cut) == (1, 1)
    assert t.response_ids == [97, 98, 99, 97, 98, 99, 100]
    assert t.policy_mask == [True] * 3 + [False] * 4 and t.turn_ids == [1, 1, 1, -1, -1, -1, -1]
    assert not t.done and not t.truncated and t.finish_reason == "" and t.reward == 0.0
    u = _traj(StepEnv(("ab", 0.0, False, False, {})))
    _run_turn(KeyBackend(n=3), DecodeRecordingTokenizer(), [u], turn=0, limits=LIMITS)
    assert (u.search_calls, u.invalid_actions, u.search_errors) == (0, 0, 0)
    assert (u.observations, u.observations_cut, u.turns) == (1, 0, 1)


def test_terminated_and_truncated_episodes():
    ans = _traj(StepEnv(("x", 1, True, False, {"prediction": "p"})))
    cut = _traj(StepEnv(("x", 0.5, False, True, {"prediction": None})))
    _run_turn(KeyBackend(n=3), DecodeRecordingTokenizer(), [ans, cut], turn=0, limits=LIMITS)
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
    _run_turn(KeyBackend(n=3), DecodeRecordingTokenizer(), [full, fits], turn=0, limits=limits)  # the ended one first
    assert not fits.done and len(fits.response_ids) == 17
    assert full.done and full.truncated and full.finish_reason == "max_total_tokens"
    assert len(full.response_ids) == 18 and full.turn_ids[3:] == [-1] * 15 and full.policy_mask[3:] == [False] * 15
    over = _traj(StepEnv(("a" * 16, 0.0, False, False, {})))
    _run_turn(KeyBackend(n=3), DecodeRecordingTokenizer(), [over], turn=0, limits=limits)
    assert len(over.response_ids) == 18 and over.done


def test_counters_accumulate_over_turns():
    t = _traj(StepEnv(("abcdef", 0.0, False, False, {})), prompt_len=1)
    limits = RolloutLimits(max_turns=4, max_new_tokens_per_turn=2, max_observation_tokens=4, max_prompt_tokens=10,
                           max_total_tokens=40)
    _run_turn(KeyBackend(n=2), DecodeRecordingTokenizer(), [t], turn=0, limits=limits)
    _run_turn(KeyBackend(n=2), DecodeRecordingTokenizer(), [t], turn=1, limits=limits)
    assert (t.turns, t.observations, t.observations_cut) == (2, 2, 2)
    assert t.turn_ids == [0, 0, -1, -1, -1, -1, 1, 1, -1, -1, -1, -1]
    assert not t.done


def test_budget_counts_the_response_so_far():
    t = _traj(StepEnv(("o", 0.0, False, False, {})), prompt_len=2)
    t.append([9] * 16, policy=False, turn=0)  # 2 + 16 of 20: room for 2
    backend = KeyBackend(n=5)
    _run_turn(backend, DecodeRecordingTokenizer(), [t], turn=1, limits=LIMITS)
    assert backend.calls[0][0] == 2 and t.response_ids[16:18] == [97, 98]
    assert t.done and t.finish_reason == "max_total_tokens"


class PlainCharTokenizer:
    pad_token_id = PAD
    chat_template = None

    def __call__(self, text, **kwargs):
        return {"input_ids": ([BOS] if kwargs.get("add_special_tokens", True) else []) + [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if i >= 3)


class FixedObservationEnv:
    def __init__(self, prompt, observation="O" * 5):
        self.prompt, self.observation = prompt, observation

    def reset(self, seed=None, options=None):
        return self.prompt, {"example_id": self.prompt[:3], "benchmark": "b", "question": "q"}

    def step(self, action):
        return self.observation, 0.0, False, False, {}


class HonestBackend:
    """Generates exactly ``max_new_tokens`` tokens ("g") for every context; records what it is asked."""

    def __init__(self):
        self.asked = []

    def generate(self, contexts, max_new_tokens, keys=None):
        self.asked.append(max_new_tokens)
        return [Generation([ord("g")] * max_new_tokens, [-0.5] * max_new_tokens) for _ in contexts]


@pytest.mark.parametrize("long_first", [True, False])
def test_the_backend_is_asked_for_the_largest_budget_and_each_trajectory_keeps_its_own(long_first):
    limits = RolloutLimits(max_turns=2, max_new_tokens_per_turn=10, max_observation_tokens=50, max_prompt_tokens=20,
                           max_total_tokens=40)
    long_env, short_env = FixedObservationEnv("L" * 19), FixedObservationEnv("S")  # 20 and 2 prompt tokens with BOS
    envs = [long_env, short_env] if long_first else [short_env, long_env]
    backend = HonestBackend()
    batch = collect_rollouts(backend, PlainCharTokenizer(), envs, [{}, {}], [0, 1], limits)
    # turn 0: both have room for 10; turn 1: the long one has 40 - (20 + 10 + 5) = 5 left, the short one 10
    assert backend.asked == [10, 10]
    lengths = batch.lengths().tolist()
    long_row, short_row = (0, 1) if long_first else (1, 0)
    assert lengths[long_row] == 40  # 20 + 10 + 5 + 5 generated: exactly max_total_tokens, never more
    assert lengths[short_row] == 2 + 10 + 5 + 10 + 5
    policy = batch.loss_mask.sum(1).tolist()
    assert policy[long_row] == 15 and policy[short_row] == 20
    assert batch.episode_info[long_row]["finish_reason"] == "max_total_tokens"
    assert batch.episode_info[short_row]["finish_reason"] == "max_turns"
    assert max(lengths) <= limits.max_total_tokens
