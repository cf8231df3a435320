"""Pins for what a run writes for a researcher to read later (issue 27): result labels, metrics.jsonl and its
resume, every rank's random streams, what --resume may change, the run folder's verdicts and the end-of-run summary
(plots and recorded rollouts: tests/test_pins_run_records_plots_recording.py). Exact file contents and messages;
fakes for TensorBoard, wandb and the process group; no model, no subprocess."""

from __future__ import annotations

import json
import random
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from stppo_agent.distributed import process_group
from stppo_agent.runs import rank_streams, resume_settings, run_folder
from stppo_agent.runs.checkpoint import CorruptCheckpointError, _write_manifest
from stppo_agent.runs.labels import distinct_labels
from stppo_agent.runs.metrics_log import MetricsLogger, json_value, read_metrics


# -- labels --------------------------------------------------------------------------------------------------------
def test_labels_take_as_many_parents_as_it_takes_and_drop_results_json():
    assert distinct_labels(["runs/a/eval/results.json", "runs/b/eval/results.json", "x/c"]) == ["a/eval", "b/eval",
                                                                                              "c"]
    assert distinct_labels(["p/x/run/results.json", "q/x/run/results.json"]) == ["p/x/run", "q/x/run"]
    assert distinct_labels(["a/run", "b/other"]) == ["run", "other"]  # one part each is enough
    assert distinct_labels(["a/b/results.json"]) == ["b"]
    assert distinct_labels(["a/results.txt"]) == ["results.txt"]  # only results.json names its folder
    assert distinct_labels(["same/run", "same/run"]) == ["same/run", "same/run"]  # nothing tells them apart
    assert distinct_labels(["run", "x/run"]) == ["run", "x/run"]
    assert distinct_labels([]) == []


# -- metrics_log ---------------------------------------------------------------------------------------------------
class FakeWriter:
    def __init__(self, log_dir):
        self.log_dir, self.scalars, self.flushes, self.closed = log_dir, [], 0, False

    def add_scalar(self, key, value, step):
        self.scalars.append((key, value, step))

    def flush(self):
        self.flushes += 1

    def close(self):
        self.closed = True


@pytest.fixture
def fake_tensorboard(monkeypatch):
    module = types.ModuleType("torch.utils.tensorboard")
    made = []
    module.SummaryWriter = lambda log_dir: made.append(FakeWriter(log_dir)) or made[-1]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    return made


def test_metrics_log_writes_one_json_line_per_iteration_and_the_finite_numbers_to_tensorboard(tmp_path,
                                                                                            fake_tensorboard):
    run = tmp_path / "new" / "run"
    logger = MetricsLogger(run)  # TensorBoard on by default
    assert logger.path == run / "metrics.jsonl" and run.is_dir()
    assert [w.log_dir for w in fake_tensorboard] == [str(run / "tensorboard")]
    logger.log(3, {"reward": torch.tensor(0.5), "loss": float("nan"), "name": "x", "turns": 2, "up": float("inf")})
    logger.log(4, {"reward": 1.0})
    assert (run / "metrics.jsonl").read_text() == (
        '{"step": 3, "reward": 0.5, "loss": "nan", "name": "x", "turns": 2, "up": "inf"}\n'
        '{"step": 4, "reward": 1.0}\n')
    writer = fake_tensorboard[0]
    assert writer.scalars == [("reward", 0.5, 3), ("turns", 2, 3), ("reward", 1.0, 4)]
    assert writer.flushes == 2 and not writer.closed
    logger.close()
    assert writer.closed
    assert read_metrics(run) == [{"step": 3, "reward": 0.5, "loss": "nan", "name": "x", "turns": 2, "up": "inf"},
                                 {"step": 4, "reward": 1.0}]
    assert MetricsLogger(tmp_path / "off", tensorboard=False)._tb is None and len(fake_tensorboard) == 1


def test_metrics_log_without_tensorboard_installed_keeps_the_json_lines(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    logger = MetricsLogger(tmp_path)
    assert logger._tb is None
    logger.log(1, {"a": 1})
    logger.close()
    assert read_metrics(tmp_path) == [{"step": 1, "a": 1}]


def test_metrics_log_sends_numbers_to_wandb_when_a_project_is_named(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, numbers, step):
            calls.append(("log", numbers, step))

        def finish(self):
            calls.append(("finish",))

    module = types.ModuleType("wandb")
    module.init = lambda **kwargs: calls.append(("init", kwargs)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", module)
    logger = MetricsLogger(tmp_path, tensorboard=False, wandb_project="proj", config={"seed": 1})
    logger.log(2, {"reward": 0.25, "note": "text", "bad": float("nan")})
    logger.close()
    assert calls == [("init", dict(project="proj", dir=str(tmp_path), config={"seed": 1}, resume="allow")),
                     ("log", {"reward": 0.25}, 2), ("finish",)]
    assert MetricsLogger(tmp_path / "b", tensorboard=False)._wandb is None and len(calls) == 3
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ValueError, match=r"^logging.wandb_project is set but wandb is not installed: pip install "
                                         r"wandb$"):
        MetricsLogger(tmp_path, tensorboard=False, wandb_project="proj")


def test_metrics_log_truncate_after_keeps_the_checkpoints_iterations_and_drops_a_torn_last_line(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    notes = []
    logger.truncate_after(2, report=notes.append)  # no file yet: nothing made
    assert not logger.path.exists() and notes == []
    logger.path.write_text('{"step": 1, "r": 1}\n\n{"note": 0}\n{"step": 2, "r": 2}\n{"step": 3, "r": 3}\n'
                           '{"step": 4, "r": 4}\n{"step": 5, "r"')
    logger.truncate_after(3, report=notes.append)
    assert logger.path.read_text() == '{"step": 1, "r": 1}\n{"note": 0}\n{"step": 2, "r": 2}\n{"step": 3, "r": 3}\n'
    assert notes == [f"{logger.path}: dropped a torn last record (line 7, an interrupted write)"]  # the file's line
    logger.truncate_after(2, report=notes.append)
    assert logger.path.read_text() == '{"step": 1, "r": 1}\n{"note": 0}\n{"step": 2, "r": 2}\n' and len(notes) == 1
    logger.path.write_text('{"step": 1}\n\n{"step": 2\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 3 is not JSON \(.*\); fix or remove that line, then "
                                         r"--resume$"):
        logger.truncate_after(5, report=notes.append)
    logger.path.write_text("")
    logger.truncate_after(0)
    assert logger.path.read_text() == ""


def test_metrics_log_json_values_and_reading_another_file(tmp_path):
    assert json_value(torch.tensor(2)) == 2 and isinstance(json_value(torch.tensor(2)), int)
    assert json_value(float("-inf")) == "-inf" and json_value(1.5) == 1.5 and json_value("a") == "a"
    assert json_value(np.float64("nan")) == "nan"
    assert read_metrics(tmp_path) == [] and read_metrics(tmp_path / "missing") == []
    (tmp_path / "steps.jsonl").write_text('{"step": 7}\n  \n{"step": 8}\n')
    assert read_metrics(tmp_path, "steps.jsonl") == [{"step": 7}, {"step": 8}]
    assert read_metrics(str(tmp_path), name="steps.jsonl")[1] == {"step": 8}
    assert read_metrics(tmp_path) == []


def test_metrics_log_truncate_after_a_write_torn_inside_a_character(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.path.write_bytes('{"note": "start"}\n{"step": 1, "q": "é"}\n{"step": 2, "q": "'.encode() + b"\xc3")
    notes = []
    logger.truncate_after(0, report=notes.append)  # a record without a step belongs before the first iteration
    assert logger.path.read_text(encoding="utf-8") == '{"note": "start"}\n'
    assert notes == [f"{logger.path}: dropped a torn last record (line 3, an interrupted write)"]


# -- rank_streams --------------------------------------------------------------------------------------------------
def draws():
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def test_rank_streams_save_nothing_with_one_process_and_every_ranks_streams_with_several(monkeypatch):
    tensors, json_state = {}, {}
    rank_streams.save(tensors, json_state)
    assert tensors == {} and json_state == {}
    other = {"torch": torch.tensor([9], dtype=torch.uint8), "python": "p1", "numpy": "n1", "cuda": ["c1"]}
    gathered = []
    monkeypatch.setattr(process_group, "world_size", lambda: 2)
    monkeypatch.setattr(process_group, "all_gather_objects", lambda local: gathered.append(local) or [local, other])
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    rank_streams.save(tensors, json_state)
    local = gathered[0]
    assert set(local) == {"torch", "python", "numpy"}  # no CUDA here
    assert torch.equal(local["torch"], torch.get_rng_state())
    assert local["python"] == json.loads(json.dumps(rank_streams.jsonable(random.getstate())))
    assert local["numpy"][1]["dtype"] == "uint32"
    assert [sorted(entry) for entry in tensors["rank_rng"]] == [["torch"], ["cuda", "torch"]]
    assert torch.equal(tensors["rank_rng"][0]["torch"], local["torch"]) and tensors["rank_rng"][1]["cuda"] == ["c1"]
    assert json_state["rank_rng"] == [{"python": local["python"], "numpy": local["numpy"]},
                                      {"python": "p1", "numpy": "n1"}]


def test_rank_streams_restore_this_ranks_entry_or_start_a_fresh_stream(monkeypatch):
    def state_of(seed):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        return ({"torch": torch.get_rng_state()},
                {"python": rank_streams.jsonable(random.getstate()),
                 "numpy": rank_streams.jsonable(np.random.get_state())})

    saved = [state_of(s) for s in (10, 11, 12)]
    expected = {}
    for seed in (10, 11, 12):
        state_of(seed)
        expected[seed] = draws()
    tensors = {"rank_rng": [t for t, _ in saved]}
    json_state = json.loads(json.dumps({"rank_rng": [j for _, j in saved]}))
    notes = []
    run = dict(seed=7, iteration=4, report=notes.append)  # the run this rank resumes

    monkeypatch.setattr(process_group, "rank", lambda: 0)
    state_of(99)
    untouched = draws()
    state_of(99)
    rank_streams.restore(tensors, json_state, **run)
    assert draws() == untouched and notes == []  # rank 0: the caller restores the main entries
    for rank, seed in ((1, 11), (2, 12)):
        monkeypatch.setattr(process_group, "rank", lambda rank=rank: rank)
        state_of(99)
        rank_streams.restore(tensors, json_state, **run)
        assert draws() == expected[seed] and notes == []

    seeded = []
    monkeypatch.setattr(process_group, "seed_everything", seeded.append)
    monkeypatch.setattr(process_group, "rank", lambda: 2)
    fresh = int(np.random.SeedSequence([7, 2, 4]).generate_state(1)[0])
    for short_tensors, short_json, written in ((tensors["rank_rng"][:2], json_state["rank_rng"], 2),
                                               (tensors["rank_rng"], json_state["rank_rng"][:2], 3),
                                               ([], [], 1), (None, None, 1)):
        rank_streams.restore({"rank_rng": short_tensors}, {"rank_rng": short_json}, **run)
        assert seeded[-1] == fresh
        assert notes[-1] == (f"rank 2: the checkpoint holds no random state for this rank (written by {written} "
                             f"process(es)); its sampling continues from a fresh stream (seed {fresh})")
    rank_streams.restore({}, {}, **run)
    assert len(seeded) == 5 and "written by 1 process(es)" in notes[-1]
    rank_streams.restore({}, {}, seed=2**64 + 7, iteration=4, report=notes.append)
    assert seeded[-1] == fresh  # the seed is taken modulo 2**64, as rank_seed does


def test_rank_streams_json_states_round_trip_through_json():
    random.seed(3)
    np.random.seed(3)
    python = json.loads(json.dumps(rank_streams.jsonable(random.getstate())))
    numpy = json.loads(json.dumps(rank_streams.jsonable(np.random.get_state())))
    assert numpy[1]["dtype"] == "uint32" and len(numpy[1]["ndarray"]) == 624
    expected = (random.random(), float(np.random.rand()))
    random.seed(4)
    np.random.seed(4)
    random.setstate(rank_streams.python_state(python))
    np.random.set_state(rank_streams.numpy_state(numpy))
    assert (random.random(), float(np.random.rand())) == expected
    assert rank_streams.jsonable((1, np.array([2], dtype=np.int64), (3,))) == [1, {"ndarray": [2], "dtype": "int64"},
                                                                               [3]]
    assert rank_streams.python_state([3, [1, 2], None]) == (3, (1, 2), None)
    state = rank_streams.numpy_state(["MT19937", {"ndarray": [1, 2], "dtype": "uint32"}, 5, 0, 0.5])
    assert state[0] == "MT19937" and state[1].dtype == np.uint32 and state[1].tolist() == [1, 2]
    assert state[2:] == (5, 0, 0.5)


def test_rank_streams_cuda_streams_travel_when_a_gpu_is_there(monkeypatch):
    set_calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: ["gpu state"])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_calls.append)
    monkeypatch.setattr(process_group, "world_size", lambda: 2)
    monkeypatch.setattr(process_group, "all_gather_objects", lambda local: [local, local])
    tensors, json_state = {}, {}
    rank_streams.save(tensors, json_state)
    assert [entry["cuda"] for entry in tensors["rank_rng"]] == [["gpu state"], ["gpu state"]]
    assert sorted(tensors["rank_rng"][1]) == ["cuda", "torch"]

    monkeypatch.setattr(process_group, "rank", lambda: 1)
    run = dict(seed=1, iteration=0, report=print)
    rank_streams.restore({"rank_rng": [{}, {"torch": torch.get_rng_state(), "cuda": ["rank 1 gpu"]}]},
                         json.loads(json.dumps(json_state)), **run)
    assert set_calls == [["rank 1 gpu"]]
    rank_streams.restore({"rank_rng": [{}, {"torch": torch.get_rng_state()}]}, json_state, **run)
    assert len(set_calls) == 1  # written without a GPU: nothing to put back
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rank_streams.restore({"rank_rng": [{}, {"torch": torch.get_rng_state(), "cuda": ["x"]}]}, json_state, **run)
    assert len(set_calls) == 1  # resumed without a GPU


# -- resume_settings -----------------------------------------------------------------------------------------------
def test_resume_settings_flatten_opens_every_mapping_as_set_spells_its_keys():
    config = {"algorithm": {"clip_high": 0.2}, "env_kwargs": {"split": "dev"},
              "monitor": {"thresholds": {"a": 1}, "z": 6.0}, "seed": 3}
    assert resume_settings.flatten(config) == {"algorithm.clip_high": 0.2, "env_kwargs.split": "dev",
                                               "monitor.thresholds.a": 1, "monitor.z": 6.0, "seed": 3}
    assert resume_settings.flatten({"algorithm": "ppo"}) == {"algorithm": "ppo"}


def test_resume_settings_changes_in_order_with_numbers_compared_by_value():
    previous = {"seed": 1, "actor_lr": 1, "gone": 5, "output_dir": "a", "flag": True, "xs": [1, 2],
                "algorithm": {"clip_high": 0.2, "old": 1}}
    current = {"actor_lr": 1.0, "seed": 1, "flag": 1, "xs": (1.0, 2.0), "output_dir": "b", "new": None,
               "algorithm": {"clip_high": 0.3}, "ys": [1]}
    assert resume_settings.changes(previous, current) == [
        ("algorithm.clip_high", 0.2, 0.3), ("ys", None, [1]), ("gone", 5, None),
        ("algorithm.old", 1, None)]
    assert resume_settings.changes({"xs": [1, 2]}, {"xs": [1]}) == [("xs", [1, 2], [1])]
    assert resume_settings.changes({"xs": [1, 2]}, {"xs": [1, 3]}) == [("xs", [1, 2], [1, 3])]
    assert resume_settings.changes({"a": 1}, {"a": False}) == [("a", 1, False)]
    assert resume_settings.changes({"a": 0}, {"a": False}) == []  # bools compare as Python does
    assert resume_settings.changes({"a": 1.5}, {"a": 3 / 2}) == [] and resume_settings.changes({"a": 2}, {"a": 2.5})
    assert resume_settings.changes({"a": [[1]]}, {"a": [[1.0]]}) == []
    assert resume_settings.changes({"a": "1"}, {"a": 1}) == [("a", "1", 1)]
    assert resume_settings.describe([("seed", 1, 2), ("model", None, "m")]) == "seed 1 -> 2, model unset -> m"
    assert resume_settings.describe([]) == ""


FIXED_REASONS = {
    "model": "the reference policy (KL) and the recorded initial weights are this model; the checkpoint's actor was "
             "trained from it (a moved copy of the same weights is accepted: checkpoints record their sha256, "
             "those written before that cannot tell)",
    "critic_model": "the checkpoint's critic was trained from it",
    "algo": "a run trains one algorithm; to apply another rule to the same start, replay recorded rollouts or start a "
            "new run from the checkpoint's actor",
    "algorithm.use_critic": "the checkpoint holds (or lacks) a critic and its optimizer state",
    "seed": "the random streams and the prompt order continue from the checkpoint; a new seed would make one run "
            "of two seeds",
    "env": "the checkpoint's prompt position indexes these envs' examples",
    "precision.dtype": "the weights and optimizer state are in this precision; a run, its resume and its replays "
                       "share it",
    "precision.autocast_dtype": "a run, its resume and its replays share the precision of their forward passes",
    "rollout.staleness": "the checkpoint holds the lagged weights of exactly this many iterations",
}
TAIL = (". Start a new run in another --output-dir instead (--model RUN/checkpoints/step-N/actor starts it from "
        "these weights)")


def test_resume_settings_check_refuses_what_the_checkpoint_is_tied_to_with_one_line():
    assert resume_settings.FIXED == FIXED_REASONS
    for key, reason in FIXED_REASONS.items():
        previous, current = resume_settings.flatten({key: "a"}), {key: None}
        with pytest.raises(ValueError) as caught:
            resume_settings.check(previous, current, 3)
        assert str(caught.value) == f"--resume cannot change {key} (a -> unset): {reason}{TAIL}"
    for name in ("dataset", "split", "limit", "shuffle_seed", "benchmark", "family"):
        with pytest.raises(ValueError) as caught:
            resume_settings.check({"env_kwargs": {name: 1}}, {"env_kwargs": {name: 2}}, 0)
        assert str(caught.value) == (f"--resume cannot change env_kwargs.{name} (1 -> 2): the checkpoint's prompt "
                                     f"position indexes the examples this selects{TAIL}")
    allowed = resume_settings.check({"env_kwargs": {"retriever": "bm25"}, "actor_lr": 1e-5, "output_dir": "a",
                                     "dataset": 1},
                                    {"env_kwargs": {"retriever": "dense"}, "actor_lr": 2e-5, "output_dir": "b",
                                     "dataset": 2}, 5)
    assert allowed == [("env_kwargs.retriever", "bm25", "dense"), ("actor_lr", 1e-5, 2e-5), ("dataset", 1, 2)]
    # the whole inner name is compared: a dotted env kwarg is not the dataset
    assert len(resume_settings.check({"env_kwargs": {"dataset.x": 1, "a.dataset": 1}},
                                     {"env_kwargs": {"dataset.x": 2, "a.dataset": 2}}, 3)) == 2
    first = {"seed": 1, "model": "a"}
    with pytest.raises(ValueError, match=r"^--resume cannot change seed \(1 -> 2\)"):  # the first in order
        resume_settings.check(first, {"seed": 2, "model": "b"}, 1)


def test_resume_settings_turning_recording_on_is_refused_only_after_the_first_iteration():
    off, on = {"logging": {"save_rollouts": False}}, {"logging": {"save_rollouts": True}}
    with pytest.raises(ValueError) as caught:
        resume_settings.check(off, on, 4)
    assert str(caught.value) == ("--resume cannot change logging.save_rollouts (False -> True): the recording would "
                                 "lack the initial weights and iterations 1..4, so stppo replay could not use it"
                                 + TAIL)
    with pytest.raises(ValueError, match=r"logging.save_rollouts \(unset -> True\).*iterations 1\.\.1,"):
        resume_settings.check({}, on, 1)
    assert resume_settings.check(off, on, 0) == [("logging.save_rollouts", False, True)]
    assert resume_settings.check(on, off, 4) == [("logging.save_rollouts", True, False)]
    assert resume_settings.check({"save_tokens": False}, {"save_tokens": True}, 4) == [("save_tokens", False, True)]


# -- run_folder ----------------------------------------------------------------------------------------------------
def checkpoint(run: Path, step: int, payload: bytes = b"weights") -> Path:
    folder = run / "checkpoints" / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / "actor.bin").write_bytes(payload)
    _write_manifest(folder)
    return folder


def corrupt(folder: Path) -> None:
    (folder / "actor.bin").write_bytes(b"edited")


def test_run_folder_holds_a_run_with_metrics_or_checkpoints_and_describes_it(tmp_path):
    assert not run_folder.holds_run(tmp_path) and not run_folder.holds_run(tmp_path / "missing")
    assert run_folder.describe(tmp_path) == "0 checkpoint(s), 0 metrics record(s)"
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n\n  \n{"step": 2}\n')
    assert run_folder.holds_run(tmp_path)
    assert run_folder.describe(tmp_path) == "0 checkpoint(s), 2 metrics record(s)"
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n{"step": 2, "q": "\xc3')  # torn inside a character
    assert run_folder.describe(tmp_path) == "0 checkpoint(s), 2 metrics record(s)"
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    assert not run_folder.holds_run(other)
    checkpoint(other, 2)
    checkpoint(other, 10)
    assert run_folder.holds_run(other)
    assert run_folder.describe(other) == "2 checkpoint(s) (steps 2, 10), 0 metrics record(s)"


def test_run_folder_prepare_refuses_mixing_and_overwrite_removes_exactly_the_runs_files(tmp_path):
    notes = []
    with pytest.raises(ValueError, match=r"^--resume continues the run in the folder and --overwrite replaces it: "
                                         r"pass one$"):
        run_folder.prepare(tmp_path / "none", resume=True, overwrite=True, report=notes.append)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match=r"^output dir .*/file is a file$"):
        run_folder.prepare(tmp_path / "file", resume=False, overwrite=False, report=notes.append)
    empty = tmp_path / "empty"
    assert run_folder.prepare(empty, resume=False, overwrite=False, report=notes.append) is None and notes == []
    assert run_folder.prepare(empty, resume=False, overwrite=True, report=notes.append) is None and notes == []
    assert run_folder.prepare(empty, resume=True, overwrite=False, report=notes.append) is None
    assert notes == [f"--resume: {empty} holds no run yet; starting one"]

    run = tmp_path / "run"
    checkpoint(run, 1)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(FileExistsError) as caught:
        run_folder.prepare(run, resume=False, overwrite=False, report=notes.append)
    assert str(caught.value) == (f"{run} already holds a run (1 checkpoint(s) (steps 1), 1 metrics record(s)); pass "
                                 "--resume to continue it, --overwrite to replace it, or choose another --output-dir")
    for name in ("steps.jsonl", "config.yaml", "replay.json", "notes.txt"):
        (run / name).write_text("x")
    for name in ("rollouts", "tensorboard", "eval"):
        (run / name / "inner").mkdir(parents=True)
    assert run_folder.prepare(run, resume=False, overwrite=True, report=notes.append) is None
    assert notes[-1] == f"--overwrite: removing the run in {run} (1 checkpoint(s) (steps 1), 1 metrics record(s))"
    assert sorted(p.name for p in run.iterdir()) == ["eval", "notes.txt"]  # not the run's: kept


def test_run_folder_resume_takes_the_newest_checkpoint_that_verifies(tmp_path):
    notes = []
    run = tmp_path / "run"
    for step in (1, 2, 3):
        checkpoint(run, step)
    assert run_folder.prepare(run, resume=True, overwrite=False, report=notes.append) == run / "checkpoints" / "step-3"
    assert notes == []
    corrupt(run / "checkpoints" / "step-3")
    corrupt(run / "checkpoints" / "step-2")
    assert run_folder.prepare(run, resume=True, overwrite=False, report=notes.append) == run / "checkpoints" / "step-1"
    assert notes == [f"skipping corrupt checkpoint (moved to .corrupt-step-3): {run}/checkpoints/step-3: actor.bin "
                     "does not match its checksum (corrupt or edited)",
                     f"skipping corrupt checkpoint (moved to .corrupt-step-2): {run}/checkpoints/step-2: actor.bin "
                     "does not match its checksum (corrupt or edited)"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [".corrupt-step-2", ".corrupt-step-3", "step-1"]
    corrupt(run / "checkpoints" / "step-1")
    with pytest.raises(CorruptCheckpointError) as caught:
        run_folder.prepare(run, resume=True, overwrite=False, report=notes.append)
    assert str(caught.value) == (f"--resume: nothing in {run} can be resumed: {run}/checkpoints/step-1: actor.bin "
                                 "does not match its checksum (corrupt or edited). Starting over would mix two runs "
                                 "in one folder: pass --overwrite to start again there, or another --output-dir")
    two = tmp_path / "two"
    for step in (1, 2):
        corrupt(checkpoint(two, step))
    with pytest.raises(CorruptCheckpointError, match=(r"can be resumed: .*step-2: actor.bin does not match its "
                                                      r"checksum \(corrupt or edited\); .*step-1: actor.bin does not "
                                                      r"match its checksum \(corrupt or edited\)\. Starting over")):
        run_folder.prepare(two, resume=True, overwrite=False, report=notes.append)
    metrics_only = tmp_path / "metrics_only"
    metrics_only.mkdir()
    (metrics_only / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(CorruptCheckpointError, match=r"^--resume: nothing in .* can be resumed: no checkpoint at all "
                                                     r"\(the run stopped before its first save\)\. Starting over"):
        run_folder.prepare(metrics_only, resume=True, overwrite=False, report=notes.append)


def test_run_folder_prepare_on_all_ranks_runs_on_the_first_process_and_shares_its_verdict(tmp_path, monkeypatch):
    run = tmp_path / "run"
    checkpoint(run, 4)
    notes = []
    assert run_folder.prepare_on_all_ranks(run, resume=True, overwrite=False, report=notes.append) == (
        run / "checkpoints" / "step-4")
    with pytest.raises(FileExistsError, match="already holds a run"):
        run_folder.prepare_on_all_ranks(run, resume=False, overwrite=False)
    with pytest.raises(ValueError, match="pass one"):
        run_folder.prepare_on_all_ranks(run, resume=True, overwrite=True)
    corrupt(run / "checkpoints" / "step-4")
    with pytest.raises(CorruptCheckpointError, match="nothing in"):
        run_folder.prepare_on_all_ranks(run, resume=True, overwrite=False, report=notes.append)
    assert notes == [f"skipping corrupt checkpoint (moved to .corrupt-step-4): {run}/checkpoints/step-4: actor.bin "
                     "does not match its checksum (corrupt or edited)"]
    sent = []
    monkeypatch.setattr(process_group, "is_main", lambda: False)
    monkeypatch.setattr(process_group, "all_gather_objects", lambda value: sent.append(value) or ["rank 0's", value])
    assert run_folder.prepare_on_all_ranks(tmp_path / "x", resume=True, overwrite=True) == "rank 0's"
    assert sent == [None]  # this rank did not look at the folder
    monkeypatch.setattr(process_group, "all_gather_objects", lambda value: [FileExistsError("from rank 0"), value])
    with pytest.raises(FileExistsError, match="^from rank 0$"):
        run_folder.prepare_on_all_ranks(tmp_path / "x", resume=False, overwrite=False)


def test_run_folder_is_run_folder_only_with_checkpoints_and_no_model_config(tmp_path):
    assert not run_folder.is_run_folder(tmp_path / "missing")
    (tmp_path / "checkpoints").write_text("")
    assert not run_folder.is_run_folder(tmp_path)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    assert run_folder.is_run_folder(run)
    (run / "config.json").write_text("{}")  # a Hugging Face model folder
    assert not run_folder.is_run_folder(run)
    assert run_folder.CHECKPOINT_CHOICES == ("latest", "best", "healthy")


def monitored_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    for step in (1, 2, 3, 4):
        checkpoint(run, step)
    records = [{"step": 1, "reward": 0.1, "collapse/tripped": 0}, {"step": 2, "reward": 0.9, "collapse/tripped": 0},
               {"step": 3, "reward": 0.5, "collapse/tripped": 0}, {"step": 4, "reward": 0.2, "collapse/tripped": 0},
               {"step": 5, "reward": 0.3, "collapse/tripped": 1}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_run_folder_pick_checkpoint_by_name(tmp_path):
    run = monitored_run(tmp_path)
    steps = run / "checkpoints"
    assert run_folder.pick_checkpoint(run) == (steps / "step-4", "step-4: the newest checkpoint")
    assert run_folder.pick_checkpoint(run, "best") == (
        steps / "step-1", "step-1: the healthy checkpoint with the highest training reward (0.900, iteration 2's "
                          "rollouts: its weights sampled)")
    assert run_folder.pick_checkpoint(run, "healthy") == (steps / "step-3", "step-3: the newest healthy checkpoint")
    assert run_folder.pick_checkpoint(run, "3") == (steps / "step-3", "step-3: as asked")
    with pytest.raises(ValueError) as caught:
        run_folder.pick_checkpoint(run, "7")
    assert str(caught.value) == f"{run}@7: choose @latest, @best, @healthy or one of the steps 1, 2, 3, 4"
    with pytest.raises(ValueError, match="@newest: choose"):
        run_folder.pick_checkpoint(run, "newest")
    corrupt(steps / "step-4")
    assert run_folder.pick_checkpoint(run) == (  # the newest that verifies, saying so
        steps / "step-3", "step-3: the newest checkpoint that verifies (the newer step-4 does not)")
    records = read_metrics(run)
    for record in records:
        record["collapse/tripped"] = 1
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for which in ("best", "healthy"):
        with pytest.raises(FileNotFoundError) as caught:
            run_folder.pick_checkpoint(run, which)
        assert str(caught.value) == (f"{run}: no checkpoint is known healthy (kept: steps 1, 2, 3); a healthy one "
                                     "needs its iteration and the one its weights sampled logged without a collapse "
                                     "signal. Use @latest or @STEP")
    with pytest.raises(FileNotFoundError, match=r"^/.* has no checkpoint that verifies$"):
        run_folder.pick_checkpoint(tmp_path / "empty")


def test_run_folder_pick_checkpoint_of_an_unmonitored_run(tmp_path):
    run = tmp_path / "run"
    for step in (1, 2, 3):
        checkpoint(run, step)
    (run / "metrics.jsonl").write_text('{"step": 1, "reward": 0.4}\n{"step": 2, "reward": 0.8}\n'
                                       '{"step": 3, "reward": 0.1}\n')
    assert run_folder.pick_checkpoint(run, "best") == (
        run / "checkpoints" / "step-1", "step-1: the checkpoint with the highest training reward (0.800, iteration "
                                        "2's rollouts: its weights sampled); the run was not monitored "
                                        "(monitor.on_collapse=none), so its health is unknown")
    with pytest.raises(FileNotFoundError) as caught:
        run_folder.pick_checkpoint(run, "healthy")
    assert str(caught.value) == (f"{run} was trained with monitor.on_collapse=none: no collapse monitor judged its "
                                 "iterations, so no checkpoint is known healthy. Use @best, @latest or @STEP")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 0.4}\n')
    with pytest.raises(FileNotFoundError) as caught:
        run_folder.pick_checkpoint(run, "best")
    assert str(caught.value) == f"{run}: no kept checkpoint has a logged training reward. Use @latest or @STEP"
    (run / "metrics.jsonl").unlink()  # no records: judged as a monitored run with nothing healthy
    with pytest.raises(FileNotFoundError, match="no checkpoint is known healthy"):
        run_folder.pick_checkpoint(run, "best")
    assert run_folder.pick_checkpoint(run, "2")[1] == "step-2: as asked"


# -- run_summary ---------------------------------------------------------------------------------------------------
def test_run_summary_human_bytes_in_decimal_units_at_the_boundaries():
    from stppo_agent.runs.run_summary import human_bytes

    assert [human_bytes(n) for n in (0, 999, 1000, 1536000, 999_949, 10**9, 2.5e12, 10**15, 10**16)] == [
        "0 B", "999 B", "1.0 kB", "1.5 MB", "999.9 kB", "1.0 GB", "2.5 TB", "1000.0 TB", "10000.0 TB"]
    # a size that rounds up to 1000 of a unit is shown in the next one (not "1000.0 kB")
    assert [human_bytes(n) for n in (999_950, 999_999, 999_999_999, 999.6)] == ["1.0 MB", "1.0 MB", "1.0 GB",
                                                                                "1.0 kB"]


def test_run_summary_reward_line_first_best_last_and_the_earliest_of_equal_bests():
    from stppo_agent.runs.run_summary import reward_line

    records = [{"step": 1, "reward": 0.25}, {"step": 2, "reward": "nan"}, {"step": 3, "reward": 0.75},
               {"step": 4, "reward": True}, {"step": 5}, {"step": 6, "reward": 0.75}, {"step": 7, "reward": 0.5},
               {"step": 8, "reward": float("inf")}]
    assert reward_line(records) == "0.250 (iteration 1) -> best 0.750 (iteration 3) -> 0.500 (iteration 7)"
    assert reward_line([{"step": "2", "reward": -1}]) == "-1.000 (iteration 2) -> best -1.000 (iteration 2) -> " \
                                                          "-1.000 (iteration 2)"
    assert reward_line([{"step": 1, "loss": 1.0}]) == reward_line([]) == "no iteration recorded a reward"
    assert reward_line([{"step": 1, "reward": float("nan")}]) == "no iteration recorded a reward"


def test_run_summary_clipping_line_follows_the_rules_ratio_level_and_corrections():
    from stppo_agent.runs.run_summary import clipping_line

    records = [{"step": 1, "clip_frac": 0.1, "turn_clip_frac": 0.4, "clip_bias_scale": 1.0,
                "rollout_correction/truncated_frac": 0.0, "rollout_correction/masked_frac": 0.0},
               {"step": 2, "clip_frac": 0.3, "turn_clip_frac": 0.2, "clip_bias_scale": 0.5,
                "rollout_correction/truncated_frac": 0.0, "rollout_correction/masked_frac": 0.25},
               {"step": 3, "clip_frac": 0.2, "turn_clip_frac": 0.1, "clip_bias_scale": 0.75,
                "rollout_correction/masked_frac": 0.125}]
    assert clipping_line(records, {}) == ("token clip share 0.100 -> 0.200 (max 0.300); rollout-correction masked "
                                          "share 0.000 -> 0.125 (max 0.250)")
    assert clipping_line(records, {"ratio_level": "turn", "clip_bias_correction": True}) == (
        "turn clip share 0.400 -> 0.100 (max 0.400); clip-bias correction scale 1.000 -> 0.750 (max 1.000); "
        "rollout-correction masked share 0.000 -> 0.125 (max 0.250)")
    assert clipping_line(records, {"ratio_level": "sequence", "clip_bias_correction": False}).startswith(
        "sequence clip share 0.100 -> 0.200 (max 0.300); rollout-correction masked")
    truncated = [{"step": 1, "rollout_correction/truncated_frac": 0.5}]
    assert clipping_line(truncated, {}) == "rollout-correction truncated share 0.500 -> 0.500 (max 0.500)"
    assert clipping_line([{"step": 1, "rollout_correction/truncated_frac": 0.0}], {}) == "no clipping figures recorded"
    assert clipping_line([], {"clip_bias_correction": True}) == "no clipping figures recorded"


def test_run_summary_alarms_line_names_alarms_rollbacks_and_skipped_updates():
    from stppo_agent.runs.run_summary import alarms_line

    records = [{"step": 1, "nan_skips_total": 0}, {"step": 2, "collapse/alarm": True, "nan_skips_total": 2},
               {"step": 3, "collapse/alarm": 0, "collapse/rollback_to": 1, "nan_skips_total": 1},
               {"step": 4, "collapse/alarm": 1, "collapse/rollback_to": 3}]
    assert alarms_line(records) == ("collapse alarm at iteration 2, 4; rolled back to step 1, 3; 2 update(s) skipped "
                                    "for NaN/inf")
    assert alarms_line([{"step": 1, "nan_skips_total": 0}]) == "no collapse alarm"
    assert alarms_line([{"step": 1, "nan_skips_total": 1}]) == "no collapse alarm; 1 update(s) skipped for NaN/inf"
    assert alarms_line([{"step": 1, "collapse/rollback_to": 0}]) == "no collapse alarm; rolled back to step 0"


def test_run_summary_eval_command_on_the_trained_benchmarks_and_limits():
    from stppo_agent.runs.run_summary import eval_command

    config = {"env": "stppo/HotpotQA-v0, stppo/Toy-v0,stppo/NQ-v0", "env_kwargs": {"retriever": "bm25"},
              "max_turns": 3, "max_new_tokens_per_turn": 64}
    assert eval_command("runs/a b", config) == (
        "stppo eval --agent 'hf:runs/a b@latest' --benchmarks hotpotqa,nq --retriever bm25 --max-turns 3 "
        "--max-new-tokens 64 --output-dir 'runs/a b/eval'")
    assert eval_command("r", {"env": "stppo/Toy-v0", "env_kwargs": {"retriever": {"k": 1}}, "max_turns": 2.5,
                              "max_new_tokens_per_turn": 8}) == (
        "stppo eval --agent hf:r@latest --benchmarks nq --max-new-tokens 8 --output-dir r/eval")
    assert eval_command("r", {}) == "stppo eval --agent hf:r@latest --benchmarks nq --output-dir r/eval"
    assert eval_command("r", {"env_kwargs": None, "max_turns": 4}) == (
        "stppo eval --agent hf:r@latest --benchmarks nq --max-turns 4 --output-dir r/eval")


def test_run_summary_of_a_whole_run_folder(tmp_path, monkeypatch):
    from stppo_agent.runs.run_summary import folder_bytes, run_summary

    monkeypatch.chdir(tmp_path)
    run = Path("runs") / "r1"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("algo: st_ppo\nenv: stppo/MedQA-v0\nrollout:\n  max_turns: 2\noptimizer:\n"
                                     "  actor_lr: 1e-6\nalgorithm:\n  ratio_level: turn\n")
    (run / "metrics.jsonl").write_text(
        '{"step": 3, "reward": 0.5, "clip_frac": 0.9, "turn_clip_frac": 0.2}\n'
        '{"step": 4, "reward": 0.25, "turn_clip_frac": 0.1, "collapse/alarm": true}\n')
    (run / "checkpoints" / "step-3").mkdir(parents=True)
    (run / "checkpoints" / "step-4" / "actor").mkdir(parents=True)
    (run / "checkpoints" / "step-4" / "actor" / "w.bin").write_bytes(b"x" * 1500)
    (run / "checkpoints" / "step-4" / "t.json").write_bytes(b"y" * 100)
    size = folder_bytes(run)
    assert folder_bytes(run / "checkpoints") == 1600 and size > 1600
    assert run_summary(str(run), title="replay") == "\n".join([
        "replay runs/r1: st_ppo on stppo/MedQA-v0, iterations 3-4",
        "  reward      0.500 (iteration 3) -> best 0.500 (iteration 3) -> 0.250 (iteration 4)",
        "  clipping    turn clip share 0.200 -> 0.100 (max 0.200)",
        "  alarms      collapse alarm at iteration 4",
        "  checkpoint  runs/r1/checkpoints/step-4 (1.6 kB; 2 kept)",
        "  evaluate    stppo eval --agent hf:runs/r1@latest --benchmarks medqa --max-turns 2 --output-dir runs/r1/eval",
        f"  run folder  runs/r1: {size / 1000:.1f} kB on disk; every iteration's figures in metrics.jsonl"])
    (run / "steps.jsonl").write_text("{}\n")
    import shutil

    shutil.rmtree(run / "checkpoints" / "step-3")
    lines = run_summary(run).splitlines()
    assert lines[4] == "  checkpoint  runs/r1/checkpoints/step-4 (1.6 kB)"  # one kept: no count
    assert lines[0].startswith("run runs/r1: ")
    assert lines[-1].endswith("every iteration's figures in metrics.jsonl (each optimizer step's: steps.jsonl)")
    empty = Path("empty")
    empty.mkdir()
    (empty / "config.yaml").write_text("- a list\n")
    assert run_summary(empty) == "\n".join([
        "run empty: ? on ?, no iteration recorded", "  reward      no iteration recorded a reward",
        "  clipping    no clipping figures recorded", "  alarms      no collapse alarm", "  checkpoint  none written",
        f"  run folder  empty: {folder_bytes(empty)} B on disk; every iteration's figures in metrics.jsonl"])
    assert folder_bytes(empty) == 9
    (empty / "config.yaml").unlink()
    assert run_summary(empty).splitlines()[0] == "run empty: ? on ?, no iteration recorded"
    (empty / "metrics.jsonl").write_text('{"step": 5}\n{"step": 6}\n{"step": 7}\n')
    assert run_summary(empty).splitlines()[0] == "run empty: ? on ?, iterations 5-7"
