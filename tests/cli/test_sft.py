"""``stppo sft`` (stppo_agent/cli/sft.py): its defaults and options reaching the config, the
refusals, ``--output-dir`` checked before the teacher plays, ``--teacher hf:RUN@latest`` and the datasets given
per benchmark."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from tests.support.cli_calls import Calls, run, usage_error
from tests.support.cli_in_process import stppo
from tests.support.recording_agent import recording_agent, was_built


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """The current folder, where the commands write; the teacher plugin lives beside it."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


@pytest.fixture
def teacher(tmp_path) -> Path:
    return recording_agent(tmp_path, "recording-teacher", "GoldSearchAgent")


def sft(capsys, out: str, *options: str):
    return stppo("sft", "--model", "tiny", "--benchmarks", "nq", "--limit", "2", "--steps", "1", "--batch-size", "1",
                 "--output-dir", out, *options, capsys=capsys)


def contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def make_run(folder: Path) -> None:
    (folder / "checkpoints" / "step-2" / "actor").mkdir(parents=True)
    (folder / "checkpoints" / "step-2" / "actor" / "config.json").write_text("{}")
    (folder / "config.yaml").write_text("algo: st_ppo\n")
    (folder / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')


def make_model(folder: Path) -> None:
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"weights")


def make_other(folder: Path) -> None:
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me\n")


@pytest.mark.parametrize("make, message", [
    (make_run, "--output-dir target holds a training run (checkpoints/, config.yaml, metrics.jsonl (2 records)); "
               "stppo sft writes a model folder: choose a new or empty one"),
    (make_model, "--output-dir target holds another model (config.json; no sft.json of stppo sft); choose a new or "
                 "empty folder"),
    (make_other, "--output-dir target is not empty (notes.txt) and holds no earlier stppo sft model; choose a new or "
                 "empty folder"),
    (lambda path: path.write_text("a file\n"), "--output-dir target is a file; choose a new or empty folder"),
])
def test_a_folder_holding_something_else_is_refused_before_the_teacher_plays(folder, teacher, capsys, make, message):
    make(folder / "target")
    before = contents(folder)
    done = sft(capsys, "target", "--teacher", "recording-teacher", "--import", str(teacher))
    assert (done.returncode, done.stderr) == (1, f"stppo sft: error: {message}\n")
    assert not was_built(teacher)
    assert contents(folder) == before  # nothing written into it, nothing beside it


def test_a_folder_that_cannot_be_written_is_refused_before_the_teacher_plays(folder, teacher, capsys):
    (folder / "notes.txt").write_text("a file\n")
    done = sft(capsys, "notes.txt/warm", "--teacher", "recording-teacher", "--import", str(teacher))
    assert (done.returncode, done.stderr) == (1, "stppo sft: error: --output-dir notes.txt/warm cannot be a folder: "
                                                 "notes.txt is a file; choose another --output-dir\n")
    assert not was_built(teacher)


def test_an_earlier_sft_model_is_replaced_whole_and_a_failed_save_leaves_it_whole(folder, capsys, monkeypatch):
    (folder / "warm").mkdir()  # an empty folder is taken
    assert sft(capsys, "warm").returncode == 0
    assert sft(capsys, "warm", "--seed", "3").returncode == 0  # an earlier sft output: replaced
    assert json.loads((folder / "warm" / "sft.json").read_text())["config"]["seed"] == 3
    first = contents(folder / "warm")

    from transformers import PreTrainedTokenizerBase

    def disk_full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", disk_full)  # after the weights were saved
    failed = sft(capsys, "warm", "--lr", "0.01")  # other weights, had they been saved
    assert failed.returncode == 1 and "No space left on device" in failed.stderr
    assert contents(folder / "warm") == first
    assert sorted(p.name for p in folder.iterdir()) == ["warm"]  # no partial folder left beside it


# ---------------------------------------------------------------- sft


def _sft(monkeypatch):
    from stppo_agent.models import default_model
    from stppo_agent.plugins import loader
    from stppo_agent.training import sft

    monkeypatch.setattr(sft, "train_sft", Calls({"first_loss": 2.34567, "last_loss": 0.5}))
    monkeypatch.setattr(default_model, "resolve_model", Calls(lambda name: f"resolved/{name}"))
    monkeypatch.setattr(loader, "load_plugins", Calls())
    return sft.train_sft, loader.load_plugins


def test_sft_defaults_are_sftconfigs(monkeypatch, capsys):
    from stppo_agent.training.sft import SFTConfig

    trained, loaded = _sft(monkeypatch)
    assert run(capsys, "sft", "--model", "smollm2", "--output-dir", "out") == \
        (0, "loss 2.346 -> 0.500; saved out\n", "")
    (config,), _ = trained.only
    assert config == SFTConfig(model="resolved/smollm2", output_dir="out", benchmarks=["nq", "hotpotqa"])
    assert (config.teacher, config.split, config.retriever, config.max_turns, config.steps, config.batch_size,
            config.lr, config.dtype, config.autocast_dtype, config.seed, config.limit, config.datasets) == \
        ("gold-search", "train", "demo", 3, 60, 4, 2e-5, "float32", None, 0, None, {})
    assert loaded.only == (([],), {})


def test_sft_every_option_reaches_the_config(monkeypatch, capsys):
    from stppo_agent.training.sft import SFTConfig

    trained, loaded = _sft(monkeypatch)
    code, _, _ = run(capsys, "sft", "--model", "tiny", "--output-dir", "o", "--teacher", "oracle", "--benchmarks",
                     " NQ, popqa,", "--dataset", "PopQA=data/p", "--split", "dev", "--limit", "6", "--retriever",
                     "bm25:idx", "--max-turns", "2", "--max-observation-tokens", "50", "--max-total-tokens", "900",
                     "--steps", "7", "--batch-size", "2", "--lr", "3e-6", "--dtype", "bfloat16",
                     "--autocast-dtype", "auto", "--seed", "5", "--import", "my_pkg.teachers")
    assert code == 0
    assert trained.only[0][0] == SFTConfig(
        model="resolved/tiny", output_dir="o", benchmarks=["NQ", "popqa"], datasets={"popqa": "data/p"},
        split="dev", limit=6, teacher="oracle", retriever="bm25:idx", max_turns=2, max_observation_tokens=50,
        max_total_tokens=900, steps=7, batch_size=2, lr=3e-6, dtype="bfloat16", autocast_dtype="auto", seed=5)
    assert loaded.only == ((["my_pkg.teachers"],), {})
    run(capsys, "sft", "--model", "tiny", "--output-dir", "o", "--autocast-dtype", "bfloat16")
    assert trained.calls[-1][0][0].autocast_dtype == "bfloat16"


def test_sft_refusals(monkeypatch, capsys):
    trained, _ = _sft(monkeypatch)
    code, _, err = run(capsys, "sft", "--model", "smolm2", "--output-dir", "o")
    assert code == 1 and "did you mean smollm2?" in err
    code, _, err = run(capsys, "sft", "--model", "tiny", "--output-dir", "o", "--retriever", "bm52:idx")
    assert code == 1 and "did you mean bm25?" in err
    code, _, err = run(capsys, "sft", "--model", "tiny", "--output-dir", "o", "--dataset", "nq")
    assert code == 1 and err == "stppo sft: error: expected BENCH=PATH, got 'nq'\n"
    assert trained.calls == []
    base = ["sft", "--model", "tiny", "--output-dir", "o"]
    for flag in ("--limit", "--max-turns", "--max-observation-tokens", "--max-total-tokens", "--steps",
                 "--batch-size"):
        assert "must be >= 1" in usage_error(capsys, *base, flag, "0"), flag
    assert "invalid choice" in usage_error(capsys, *base, "--autocast-dtype", "float16")
    assert "invalid float" in usage_error(capsys, *base, "--lr", "x")
    assert "invalid int" in usage_error(capsys, *base, "--seed", "x")
    assert "--model" in usage_error(capsys, "sft", "--output-dir", "o")
    assert "--output-dir" in usage_error(capsys, "sft", "--model", "tiny")


# `stppo sft --teacher hf:RUN@latest|@STEP` (as its help lists) plays the run's checkpoint, resolved as `stppo eval`
# resolves it, and says which; never a hub repo-id error.


@pytest.fixture
def trained_run(tmp_path, monkeypatch, capsys):
    """A training run with checkpoints at steps 1 and 2 (the built-in tiny model on the toy env)."""
    monkeypatch.chdir(tmp_path)
    trained = stppo("train", "--algo", "grpo", "--env", "stppo/Toy-v0", "--model", "tiny", "--output-dir", "run",
                    "--iterations", "2", "--set", "rollout.samples_per_prompt=2", "--set",
                    "rollout.prompts_per_iteration=2",
                    "--set", "rollout.max_new_tokens_per_turn=1", "--set", "checkpoint.every=1", "--set",
                    "logging.tensorboard=false",
                    "--set", "logging.progress=false", capsys=capsys)
    assert trained.returncode == 0, trained.stderr[-2000:]
    return "run"


@pytest.mark.parametrize("which, step, why", [("latest", 2, "the newest checkpoint"), ("1", 1, "as asked")])
def test_a_checkpoint_of_a_run_teaches(trained_run, capsys, which, step, why):
    done = stppo("sft", "--model", "tiny", "--teacher", f"hf:{trained_run}@{which}", "--benchmarks", "nq",
                 "--limit", "2", "--max-turns", "2", "--steps", "1", "--output-dir", "warm", capsys=capsys)
    assert f"teacher hf:{trained_run}@{which} -> step-{step}: {why}" in done.stdout.splitlines()
    # the toy-env model never answers an nq question, so it is refused for that, by the checkpoint it played
    assert (done.returncode, done.stderr.splitlines()[-1]) == (
        1, f"stppo sft: error: the teacher 'hf:{trained_run}/checkpoints/step-{step}/actor' earned no reward on nq: no "
           "demonstrations to learn from")


# Datasets given per benchmark: another spelling of its name, a stray dataset, a benchmark named twice.


def _sft_config(monkeypatch, capsys, *args):
    import stppo_agent.training.sft as sft

    seen = []

    def captured(config):
        seen.append(config)
        raise ValueError("captured")  # the training itself is not the point

    monkeypatch.setattr(sft, "train_sft", captured)
    done = stppo("sft", "--model", "tiny", "--output-dir", "unused", *args, capsys=capsys)
    return done, (seen[0] if seen else None)


def test_sft_uses_the_dataset_given_for_a_benchmark_spelt_another_way(monkeypatch, capsys):
    # --benchmarks NQ --dataset nq=PATH: the dataset was keyed "nq", looked up as "NQ", and the demo set played
    done, config = _sft_config(monkeypatch, capsys, "--benchmarks", "NQ,mmlu-medical", "--dataset", "nq=data/nq.jsonl",
                               "--dataset", "mmlu_med=data/mmlu", "--retriever", "bm25:idx")
    assert "captured" in done.stderr
    assert [config.datasets.get(name) for name in config.benchmarks] == ["data/nq.jsonl", "data/mmlu"]


@pytest.mark.parametrize("args, says", [
    (("--benchmarks", "nq", "--dataset", "hotpotqa=data/h.jsonl"), "--dataset given for hotpotqa"),
    (("--benchmarks", "nq,NQ"), "--benchmarks names nq twice"),
])
def test_sft_refuses_a_stray_dataset_and_a_benchmark_named_twice(monkeypatch, capsys, args, says):
    done, config = _sft_config(monkeypatch, capsys, *args)
    assert done.returncode == 1 and says in done.stderr and config is None
