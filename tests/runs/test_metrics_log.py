"""``stppo_agent.runs.metrics_log``: metrics.jsonl, TensorBoard and W&B, and the
truncation a resume makes."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

from stppo_agent.runs.metrics_log import MetricsLogger, json_value, read_metrics


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
