"""TRL's own GRPOTrainer on the envs through the adapter (stppo_agent/integrations/trl): one real training step,
single-environment and multi-environment, with a tiny Llama taught to call the ``search`` then the ``answer`` tool
(built from a config, no hub; tests/support/trl_models.py). What must hold: TRL parses the model's tool calls
against the adapter's tools, the env's retriever answers them, TRL's reward is the env's score of each rollout, and
the update moves the policy toward the rewarded answer.

TRL is not a dependency of the project: without it this module is skipped; ``make test`` runs it in the TRL venv
(.venv-trl) with ``STPPO_REQUIRE_TRL=1``, which turns the skip into a failure.
"""

from __future__ import annotations

import os

import gymnasium as gym
import pytest

from tests.support.requires import require_trl

require_trl()

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from stppo_agent.integrations.trl import search_environment, training_dataset  # noqa: E402
from stppo_envs import env_id  # noqa: E402
from tests.support.trl_models import environment_tools, message_logprob, teach, tiny_tool_model, tool_chat_tokenizer  # noqa: E402

QUERY, RIGHT, WRONG = "Zaeththeiv Penda", "linguist", "chemist"  # demo NQ question 0 and its gold answer
SHORT = {"template": "{question}", "limit": 1}  # the bare question: short contexts keep the tiny model fast


def conversation(question: str, information: str, answer: str) -> list[dict]:
    def call(name, **arguments):
        return {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}

    return [{"role": "user", "content": question}, call("search", query=QUERY),
            {"role": "tool", "name": "search", "content": information}, call("answer", answer=answer),
            {"role": "tool", "name": "answer", "content": "Your answer was recorded; the episode is over."},
            {"role": "assistant", "content": "Done."}]


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    """(model folder, the NQ factory, its two conversations): a tiny Llama that searches for the question's name,
    then answers linguist (right) or chemist (wrong) about equally often."""
    torch.set_num_threads(1)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    factory = search_environment("stppo/NQ-v0", **SHORT)
    environment = factory()
    question = environment.reset(index=0)
    tools = environment_tools(environment)
    conversations = [conversation(question, environment.search(QUERY), answer) for answer in (RIGHT, WRONG)]
    corpus = [tool_chat_tokenizer().apply_chat_template(c, tools=tools, tokenize=False) for c in conversations]
    path = tiny_tool_model(tmp_path_factory.mktemp("trl") / "model", tool_chat_tokenizer(corpus))
    assert teach(path, conversations, tools, steps=200, lr=1e-2) < 0.05
    return path, factory, conversations, tools


def grpo_step(path, factory, dataset, generations: int, output_dir, lr: float = 0.0) -> GRPOTrainer:
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    args = GRPOConfig(output_dir=str(output_dir), max_steps=1, per_device_train_batch_size=len(dataset) * generations,
                      num_generations=generations, max_completion_length=256, learning_rate=lr,
                      lr_scheduler_type="constant", beta=0.0, seed=0, bf16=False, use_cpu=True, report_to="none",
                      logging_steps=1, save_strategy="no", gradient_checkpointing=False, shuffle_dataset=False,
                      max_tool_calling_iterations=max(f.max_turns for f in (
                          factory.values() if isinstance(factory, dict) else [factory])))
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, args=args, train_dataset=dataset,
                          environment_factory=factory)
    trainer.train()
    return trainer


def replayed_reward(environment, env_id: str, **kwargs) -> float:
    """The reward of the env's own recorded turns played again in a fresh Gymnasium env."""
    env = gym.make(env_id, disable_env_checker=True, **kwargs)
    env.reset(options={"index": 0})
    reward = 0.0
    for segment in environment.env.transcript:
        if segment.role == "assistant":
            _, reward, terminated, truncated, _ = env.step(segment.text)
            if terminated or truncated:
                break
    return float(reward)


def test_one_grpo_step_rewards_the_envs_score_and_moves_toward_the_right_answer(taught, tmp_path):
    path, factory, conversations, tools = taught
    before = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)

    def log_odds(model) -> float:  # of answering right rather than wrong, after the same search
        return (message_logprob(model, tokenizer, conversations[0], tools, 1)
                - message_logprob(model, tokenizer, conversations[1], tools, 1))

    trainer = grpo_step(path, factory, training_dataset(factory, repeats=1), 8, tmp_path, lr=1e-3)
    rewards = [environment.get_reward() for environment in trainer.environments]
    logged = trainer.state.log_history[0]
    assert sorted(set(rewards)) == [0.0, 1.0], "the taught model should answer right and wrong within 8 rollouts"
    assert logged["rewards/SearchEnvironment/mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert logged["tools/call_frequency"] >= 1.5 and logged["tools/failure_frequency"] == 0
    searched = [e for e in trainer.environments if f"<search> {QUERY} </search>" in e.transcript]
    assert len(searched) >= 6 and all("is a linguist" in e.transcript for e in searched)  # the index answered
    for environment in trainer.environments:
        assert environment.get_reward() == replayed_reward(environment, "stppo/NQ-v0", **SHORT)
    assert log_odds(trainer.model) > log_odds(before)


def test_a_dict_of_environments_routes_each_row_to_its_benchmark(taught, tmp_path):
    path, nq, _, _ = taught
    factories = {"general": nq, "multihop": search_environment("stppo/HotpotQA-v0", **SHORT),
                 "medical": search_environment("stppo/MedQA-v0", **SHORT)}
    benchmarks = {"general": "nq", "multihop": "hotpotqa", "medical": "medqa"}
    trainer = grpo_step(path, factories, training_dataset(factories), 2, tmp_path)
    seen = sorted(environment.env.benchmark for environment in trainer.environments)
    assert seen == sorted(list(benchmarks.values()) * 2)
    for environment in trainer.environments:
        assert environment.env.example is environment.env.examples[0]  # the row's question, in its own env
        assert environment.get_reward() == replayed_reward(environment, env_id(environment.env.benchmark), **SHORT)
    rewards = [environment.get_reward() for environment in trainer.environments]
    assert trainer.state.log_history[0]["rewards/SearchEnvironment/mean"] == pytest.approx(sum(rewards) / 6)
