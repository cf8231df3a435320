"""What a newcomer's first run prints: nothing about optional extras a fresh install cannot avoid."""

from __future__ import annotations

import json
import sys

from stppo_agent.runs.metrics_log import MetricsLogger


def test_a_missing_tensorboard_is_silent_and_metrics_are_still_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as when it is not installed
    logger = MetricsLogger(tmp_path, tensorboard=True)
    logger.log(1, {"reward": 0.5})
    logger.close()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["reward"] == 0.5
    assert not (tmp_path / "tensorboard").exists()
