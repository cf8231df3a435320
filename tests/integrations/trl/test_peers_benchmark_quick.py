"""benchmarks/peers.py --quick end to end: both workers run one iteration of the same work, on the same questions and
prompt tokens, with every setting the benchmark settles in effect on both sides, and the report says so.

Needs TRL: skipped without it; ``make test`` runs it in the TRL venv with ``STPPO_REQUIRE_TRL=1``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.paths import REPO
from tests.support.requires import require_trl

require_trl("benchmarks/peers.py needs TRL (`pip install .[trl]`)")

PROMPTS, SAMPLES, NEW_TOKENS = 2, 2, 8


def test_quick_pair_runs_the_same_work_and_reports_it(tmp_path):
    out = tmp_path / "peers.json"
    command = [sys.executable, str(REPO / "benchmarks" / "peers.py"), "--quick", "--threads", "1", "--prompts",
               str(PROMPTS), "--samples", str(SAMPLES), "--micro", "2", "--new-tokens", str(NEW_TOKENS),
               "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    reported = {kind: figures["rows"][kind] for kind in ("stppo", "trl")}
    assert [len(rows) for rows in reported.values()] == [1, 1]  # --quick: one iteration each, no warm-up
    stppo, trl_row = reported["stppo"][0], reported["trl"][0]
    assert stppo["questions"] == trl_row["questions"] and len(stppo["questions"]) == PROMPTS
    assert stppo["first_prompt"] == trl_row["first_prompt"]
    for row in (stppo, trl_row):
        assert 0 < row["tokens"] <= PROMPTS * SAMPLES * NEW_TOKENS
        assert row["generate"] + row["score"] + row["update"] == pytest.approx(row["seconds"], rel=0.02, abs=0.05)
    in_effect = figures["sides"]  # the settings each worker read back from its own trainer
    shared = set(in_effect["stppo"]) & set(in_effect["trl"])
    assert {"optimizer", "lr", "dtype", "gradient_checkpointing", "bf16", "reference_model", "threads",
            "THP_MEM_ALLOC_ENABLE", "stop_strings", "max_new_tokens", "completions_per_optimizer_step"} <= shared
    assert {key: in_effect["stppo"][key] for key in shared} == {key: in_effect["trl"][key] for key in shared}
    assert in_effect["trl"]["stop_strings"] == ["</search>", "</answer>"] and in_effect["trl"]["threads"] == 1
    text = result.stdout
    assert "same questions in the same order: yes; same prompt tokens: yes" in text
    assert "SETTING DIFFERS" not in text and "ratio" in text and "work that still differs" in text
