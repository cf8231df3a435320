"""What every test of the command line shares: no ``STPPO_VERBOSE`` from the caller's shell and the
libraries' log levels put back after each test (every ``main`` call sets them), and run folders to point at."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _quiet_environment(monkeypatch):
    """No STPPO_VERBOSE from the caller's shell, and the libraries' log levels back as they were afterwards (every
    `main` call sets them)."""
    from datasets.utils import logging as ds_logging
    from transformers.utils import logging as hf_logging

    monkeypatch.setenv("STPPO_VERBOSE", "")  # recorded, so a command that sets it has it removed afterwards
    monkeypatch.delenv("STPPO_VERBOSE")
    for name in ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    saved = (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(), ds_logging.get_verbosity(),
             ds_logging.is_progress_bar_enabled())
    yield
    hf_logging.set_verbosity(saved[0])
    hf_logging.enable_progress_bar() if saved[1] else hf_logging.disable_progress_bar()
    ds_logging.set_verbosity(saved[2])
    ds_logging.enable_progress_bar() if saved[3] else ds_logging.disable_progress_bar()


@pytest.fixture
def run_folders(tmp_path, monkeypatch):
    """Run folders r, r1 and r2 (each with a metrics.jsonl) in the current folder: `stppo plot` refuses a run
    folder that is not there before the plotting the tests replace."""
    monkeypatch.chdir(tmp_path)
    for name in ("r", "r1", "r2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text('{"step": 1}\n')
