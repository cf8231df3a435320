"""``stppo_agent.training.live_rollouts``: the seeded prompt sampler, one env per
slot, each rank's share, dynamic sampling's rounds, and synthetic envs posing many prompts."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import gymnasium as gym
import pytest
import torch

import stppo_envs  # noqa: F401  (registers the env ids)
from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
from stppo_agent.rollouts.envs import prompt_count
from stppo_agent.training.trainer import Trainer
from tests.support.runs import toy_config
from tests.support.training_parts import Said, config, dataclasses_replace, group_batch

# -- live_rollouts ----------------------------------------------------------------------------------------------

def test_the_prompt_sampler_walks_a_seeded_permutation_per_epoch():
    import numpy as np

    from stppo_agent.training.live_rollouts import PromptSampler

    sampler = PromptSampler([2, 3], seed=4)
    pairs = [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    assert sampler.pairs == pairs and sampler.state() == {"epoch": 0, "cursor": 0}
    first, second = (np.random.default_rng(4 + e).permutation(5).tolist() for e in (0, 1))
    assert sampler.take(3) == [pairs[i] for i in first[:3]] and sampler.state() == {"epoch": 0, "cursor": 3}
    assert sampler.take(2) == [pairs[i] for i in first[3:]] and sampler.state() == {"epoch": 1, "cursor": 0}
    assert sampler.take(0) == []
    assert sampler.take(7) == [pairs[i] for i in second] + [pairs[i] for i in
                                                            np.random.default_rng(6).permutation(5)[:2].tolist()]
    assert sampler.state() == {"epoch": 2, "cursor": 2}
    resumed = PromptSampler([2, 3], seed=4)
    resumed.load({"epoch": 1.0, "cursor": 3.0})
    assert resumed.state() == {"epoch": 1, "cursor": 3} and type(resumed.state()["epoch"]) is int
    assert type(resumed.state()["cursor"]) is int
    assert resumed.take(2) == [pairs[i] for i in second[3:]]


def live(env="stppo/Toy-v0", env_kwargs=None, backend=None, **values):
    """Live rollouts over a backend that holds its own weights (an engine's, which needs nothing gathered); their
    phases are a :class:`Said` list."""
    from pathlib import Path

    from stppo_agent.models.tiny import word_tokenizer
    from stppo_agent.rollouts.vllm_generation import VLLMGenerationBackend
    from stppo_agent.training.live_rollouts import LiveRollouts, RolloutContext

    cfg = config(env=env, env_kwargs=env_kwargs or {}, **values)
    backend = backend or VLLMGenerationBackend.__new__(VLLMGenerationBackend)
    return LiveRollouts(RolloutContext(cfg, cfg.algorithm_config(), Path("runs/live"), word_tokenizer(), backend,
                                       phase=Said()))


def test_live_rollouts_build_one_env_per_slot_sharing_the_search_envs_retriever():

    from tests.support.retrievers import KeywordRetriever

    retriever = KeywordRetriever()
    rollouts = live(" stppo/NQ-v0 , stppo/HotpotQA-v0,", {"retriever": retriever, "topk": 2}, rollout=dict(max_turns=3))
    assert rollouts.env_ids == ["stppo/NQ-v0", "stppo/HotpotQA-v0"]
    assert rollouts.env_kwargs == [{"retriever": retriever, "topk": 2, "max_turns": 3}] * 2
    sizes = [len(rollouts._env(0, i).examples) for i in (0, 1)]
    assert len(rollouts.sampler.pairs) == sum(sizes) and rollouts.sampler.seed == 0
    env = rollouts._env(3, 1)
    assert env is rollouts._env(3, 1) and env is not rollouts._env(2, 1) and env is not rollouts._env(3, 0)
    assert env.retriever is retriever and env.max_turns == 3 and env.topk == 2
    toy = live("stppo/Toy-v0", {"turns": 3}, seed=9)
    assert toy.env_kwargs == [{"turns": 3}] and toy.sampler.pairs == [(0, 0)] and toy.sampler.seed == 9
    assert toy._env(0, 0).turns == 3
    with pytest.raises(ValueError, match=r"^env is empty; pass one or more env ids, e\.g\. stppo/NQ-v0,"
                                         r"stppo/HotpotQA-v0$"):
        live(" , ")


def test_a_search_env_spec_becomes_one_shared_retriever(monkeypatch):
    import stppo_agent.training.live_rollouts as live_rollouts

    specs = []
    share = live_rollouts.shared_retriever_spec
    monkeypatch.setattr(live_rollouts, "shared_retriever_spec", lambda spec, run_dir: specs.append((spec, run_dir))
                        or share(spec, run_dir))
    rollouts = live("stppo/NQ-v0", {"topk": 1})
    assert specs == [("demo", rollouts.context.run_dir)]
    retriever = rollouts.env_kwargs[0]["retriever"]
    assert not isinstance(retriever, str) and rollouts._env(0, 0).retriever is retriever
    assert rollouts._env(1, 0).retriever is retriever  # one index in memory for every slot
    live("stppo/Toy-v0")
    live("stppo/NQ-v0", {"topk": 1}, distributed=dict(share_retriever=False))
    assert len(specs) == 1  # neither a toy env nor share_retriever=false asks for a shared spec


def recording_collect(calls, rewards=lambda round, groups: [1.0] * len(groups)):
    def collect(backend, tokenizer, envs, options, groups, limits, seeds, on_turn):
        calls.append(dict(envs=envs, options=options, groups=groups, limits=limits, seeds=seeds, backend=backend,
                          tokenizer=tokenizer))
        on_turn(1, 4)
        round = (groups[0] // 10**9) if groups else 0
        return group_batch([(g, [r]) for g, r in zip(groups, rewards(round, groups))])
    return collect


def test_a_round_assigns_slots_groups_and_seeds(monkeypatch):
    import stppo_agent.training.live_rollouts as live_rollouts

    calls = []
    monkeypatch.setattr(live_rollouts, "collect_rollouts", recording_collect(calls))
    rollouts = live(seed=5, rollout=dict(prompts_per_iteration=2, samples_per_prompt=3, max_turns=4))
    rollouts._play(2, 0)
    rollouts._play(2, 1)
    own, extra = calls
    assert own["groups"] == [4, 4, 4, 5, 5, 5] and extra["groups"] == [10**9 + 4] * 3 + [10**9 + 5] * 3
    assert own["seeds"] == [5 + 2_000_006 + slot for slot in range(6)]
    assert extra["seeds"] == [5 + 2_000_006 + slot + 7_919_993 for slot in range(6)]
    assert own["options"] == [{"index": 0}] * 6 and own["limits"] == rollouts.context.config.rollout_limits()
    assert len({id(env) for env in own["envs"]}) == 6
    assert [id(e) for e in own["envs"]] == [id(e) for e in extra["envs"]]  # the same slots, the same envs
    assert rollouts.context.phase == ["rollout turn 2/4 done (4 active)"] * 2
    assert rollouts.state() == {"epoch": 4, "cursor": 0}  # one example: each prompt is an epoch
    rollouts.load({"epoch": 1, "cursor": 0})
    assert rollouts.sampler.state() == {"epoch": 1, "cursor": 0}
    assert own["backend"] is rollouts.context.backend and own["tokenizer"] is rollouts.context.tokenizer


def test_hf_generation_holds_the_gathered_actor(monkeypatch):
    import contextlib

    import stppo_agent.rollouts.hf_generation as hf_generation
    import stppo_agent.training.live_rollouts as live_rollouts

    calls, held = [], []

    @contextlib.contextmanager
    def gathered(model):
        held.append(model)
        yield model

    monkeypatch.setattr(live_rollouts, "collect_rollouts", recording_collect(calls))
    monkeypatch.setattr(hf_generation.process_group, "gathered", gathered)
    live()._play(0, 0)
    assert held == [] and len(calls) == 1  # an engine with its own weights (vLLM) needs no gathered actor
    hf = hf_generation.HFGenerationBackend.__new__(hf_generation.HFGenerationBackend)
    hf.model = actor = torch.nn.Linear(1, 1)
    live(backend=hf)._play(0, 0)
    assert held == [actor] and calls[-1]["backend"] is hf


def test_each_rank_plays_its_share_of_the_prompts(monkeypatch):
    import stppo_agent.training.live_rollouts as live_rollouts

    calls = []
    monkeypatch.setattr(live_rollouts, "collect_rollouts", recording_collect(calls))
    rollouts = live(seed=0, rollout=dict(prompts_per_iteration=4, samples_per_prompt=2))
    rollouts.context = dataclasses_replace(rollouts.context, rank=1, world=2)
    rollouts._play(0, 0)
    assert calls[0]["groups"] == [1, 1, 3, 3] and calls[0]["seeds"] == [2, 3, 6, 7]


def test_dynamic_sampling_resamples_rounds_and_the_search_error_rate_stops_the_run(monkeypatch):
    import stppo_agent.training.live_rollouts as live_rollouts
    from stppo_envs.retrieval import RetrievalError

    calls = []
    informative_from = lambda round, groups: [float(round >= 2 and i % 2) for i in range(len(groups))]  # noqa: E731
    monkeypatch.setattr(live_rollouts, "collect_rollouts", recording_collect(calls, informative_from))
    rollouts = live(algo="dapo", rollout=dict(prompts_per_iteration=2, samples_per_prompt=2))
    batch = rollouts.next_batch(0)
    assert [c["groups"][0] // 10**9 for c in calls] == [0, 1, 2]
    assert batch.stats["dynamic_sampling/rounds"] == 2.0
    assert batch.group_ids.tolist() == [2 * 10**9, 2 * 10**9, 2 * 10**9 + 1, 2 * 10**9 + 1]
    capped = live(algo="dapo", algorithm={"max_resample_rounds": 1},
                  rollout=dict(prompts_per_iteration=2, samples_per_prompt=2))
    calls.clear()
    capped.next_batch(0)
    assert len(calls) == 2
    calls.clear()
    live(algo="grpo", rollout=dict(samples_per_prompt=2)).next_batch(0)
    assert len(calls) == 1  # no dynamic sampling
    rates = {}
    monkeypatch.setattr(live_rollouts, "rollout_statistics", lambda batch, algo: rates)
    rollouts = live(env_kwargs={"turns": 2}, monitor=dict(max_search_error_rate=0.25))
    rollouts.next_batch(0)  # no searches: no rate
    rates["search_error_rate"] = 0.25
    rollouts.next_batch(0)
    rates["search_error_rate"] = 0.26
    with pytest.raises(RetrievalError, match=r"^iteration 3: 26% of the searches failed "
                                             r"\(monitor.max_search_error_rate=0.25\); the policy would learn from "
                                             r"error messages. Check the retriever \(demo\), then --resume"):
        rollouts.next_batch(2)
    rollouts.context.config.env_kwargs = {"retriever": "http://retriever:8000"}
    with pytest.raises(RetrievalError, match=r"Check the retriever \(http://retriever:8000\), then --resume from the "
                                             r"last checkpoint$"):
        rollouts.next_batch(2)


# Synthetic envs (stppo/Toy-v0 with a drawn target, stppo/Copy-v0) pose many prompts to a trainer: its prompt sampler
# walks them, every sample of one prompt (a GRPO group) is posed the same question, and different prompts differ. With
# one prompt per env, every toy episode a trainer played had the target "red".


def test_prompt_count_of_each_kind_of_env():
    assert prompt_count(gym.make("stppo/Toy-v0", fixed_target=None)) == 4
    assert prompt_count(gym.make("stppo/Toy-v0")) == 1  # a fixed target is one prompt
    assert prompt_count(gym.make("stppo/Copy-v0", prompts=37)) == 37
    assert prompt_count(gym.make("stppo/NQ-v0")) == len(gym.make("stppo/NQ-v0").unwrapped.examples) > 1


def test_an_indexed_copy_episode_is_fixed_by_its_index_whatever_the_seed():
    env = gym.make("stppo/Copy-v0", prompts=10).unwrapped
    first, _ = env.reset(seed=1, options={"index": 3})
    again, _ = env.reset(seed=2, options={"index": 13})  # 13 modulo 10 prompts: the same question
    other, _ = env.reset(seed=1, options={"index": 4})
    unindexed_a, _ = env.reset(seed=1)
    unindexed_b, _ = env.reset(seed=2)
    assert first == again and first != other and unindexed_a != unindexed_b


def questions_by_group(batch) -> dict[int, set[str]]:
    groups = defaultdict(set)
    for group, info in zip(batch.group_ids.tolist(), batch.episode_info):
        groups[group].add(info["question"])
    return groups


@pytest.mark.parametrize("env, env_kwargs", [("stppo/Toy-v0", {"fixed_target": None}), ("stppo/Copy-v0", {})])
def test_a_trainer_poses_each_group_one_question_and_the_groups_different_ones(tmp_path: Path, env, env_kwargs):
    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    batches = []
    config = toy_config(model, tmp_path / "run", "grpo", iterations=1, env=env, env_kwargs=env_kwargs,
                        rollout=dict(prompts_per_iteration=4, samples_per_prompt=3, max_new_tokens_per_turn=2,
                                     max_prompt_tokens=64, max_total_tokens=128),
                        optimizer=dict(mini_batch_size=12, micro_batch_size=12), monitor=dict(on_collapse="none"))
    Trainer(config, report=lambda _: None, batch_hook=batches.append).train()
    groups = questions_by_group(batches[0])
    assert len(groups) == 4 and all(len(questions) == 1 for questions in groups.values())
    # the toy's 4 targets are one epoch of its prompts: each is posed once; copy sequences differ group to group
    assert len(set.union(*groups.values())) == 4
