"""A real dataset with no retriever named would be searched in the demo corpus (a fictional encyclopedia that cannot
answer it): `stppo train`, `stppo sft` and `stppo eval` refuse it alike, before any model loads, and take an explicit
`demo` retriever as meaning it."""

from __future__ import annotations

import json

import pytest

from tests.support.cli_in_process import stppo

QUESTIONS = [{"id": f"q{i}", "question": f"who wrote book number {i}", "golden_answers": [f"author {i}"]}
             for i in range(3)]
DEMO_CORPUS = "the default demo corpus (a fictional encyclopedia) cannot answer it"


@pytest.fixture
def real_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nq.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return "nq.jsonl"


TRAIN = ["train", "--algo", "grpo", "--model", "tiny", "--output-dir", "run", "--iterations", "1",
         "--set", "rollout.samples_per_prompt=2", "--set", "rollout.prompts_per_iteration=2", "--set",
         "rollout.max_turns=2",
         "--set", "rollout.max_new_tokens_per_turn=2", "--set", "logging.tensorboard=false", "--set",
         "logging.progress=false"]


@pytest.mark.parametrize("env", ["stppo/NQ-v0", "stppo/NQ-v0,stppo/HotpotQA-v0"])
def test_train_refuses_a_real_dataset_without_a_retriever(real_data, tmp_path, capsys, env):
    done = stppo(*TRAIN, "--env", env, "--set", f"env_kwargs.dataset={real_data}", capsys=capsys)
    assert done.returncode == 1
    assert done.stderr == (
        f"stppo train: error: env_kwargs.dataset={real_data} is real data, but no env_kwargs.retriever was given: "
        f"{DEMO_CORPUS}. Pass --set env_kwargs.retriever=bm25:DIR, dense:DIR or http://HOST:PORT (stppo index bm25 "
        "--corpus ... builds one), or --set env_kwargs.retriever=demo to search the demo corpus anyway\n")
    assert not (tmp_path / "run").exists()  # refused before the run folder or a model


def test_sft_refuses_a_real_dataset_without_a_retriever_and_takes_an_explicit_demo(real_data, tmp_path, capsys):
    sft = ["sft", "--model", "tiny", "--benchmarks", "nq", "--dataset", f"nq={real_data}", "--steps", "1",
           "--batch-size", "1"]
    refused = stppo(*sft, "--output-dir", "warm", capsys=capsys)
    assert refused.returncode == 1
    assert refused.stderr == (
        f"stppo sft: error: --dataset nq=... is real data, but no --retriever was given: {DEMO_CORPUS}. Pass "
        "--retriever bm25:DIR, dense:DIR or http://HOST:PORT (stppo index bm25 --corpus ... builds one), or "
        "--retriever demo to search the demo corpus anyway\n")
    assert not (tmp_path / "warm").exists()
    done = stppo(*sft, "--output-dir", "warm", "--retriever", "demo", capsys=capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    recorded = json.loads((tmp_path / "warm" / "sft.json").read_text())
    assert recorded["config"]["retriever"] == "demo" and recorded["demonstrations"] == len(QUESTIONS)


def test_eval_refuses_it_in_the_same_words(real_data, capsys):
    refused = stppo("eval", "--agent", "oracle", "--benchmarks", "nq", "--dataset", f"nq={real_data}",
                    "--output-dir", "out", capsys=capsys)
    assert refused.returncode == 1 and f"--dataset nq=... is real data, but no --retriever was given: {DEMO_CORPUS}" \
        in refused.stderr
