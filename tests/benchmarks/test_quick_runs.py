"""--quick runs of the benchmark scripts say they check the plumbing, write to their own folder and are never
reused by a full run. The quick runs themselves: tests/benchmarks/test_stability_quick.py and
test_robustness_quick.py."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO


def script(name: str):
    if str(REPO / "benchmarks") not in sys.path:  # as `python benchmarks/NAME.py` has it (their _common import)
        sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def stability(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "stability.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("held, flags, refused", [
    ({"quick": True}, [], "holds a --quick run (plumbing, not a result); give this study another --out"),
    ({"quick": False}, ["--quick"], "holds a full study; give this --quick run another --out"),
])
def test_a_quick_run_and_a_full_study_never_share_a_folder(tmp_path, held, flags, refused):
    out = tmp_path / "study"
    (out / "sft").mkdir(parents=True)
    (out / "sft" / "sft.json").write_text("{}")  # a warm start the other kind of run must not pick up
    (out / "mode.json").write_text(json.dumps(held))
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    for extra in ([], ["--report-only"]):
        done = stability("--out", str(out), *flags, *extra, cwd=tmp_path)
        assert done.returncode != 0 and refused in done.stderr, done.stderr[-2000:]
        assert "Traceback" not in done.stderr
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing written, nothing cleared


def test_a_folder_from_before_the_marker_is_known_by_its_summary(tmp_path):
    out = tmp_path / "old"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({"settings": {"quick": True}}))
    done = stability("--out", str(out), cwd=tmp_path)
    assert done.returncode != 0 and "holds a --quick run" in done.stderr


def test_quick_runs_default_to_their_own_folder_and_their_report_says_what_they_are():
    module = script("stability")
    assert module.default_out(True) != module.default_out(False)
    assert module.default_out(True) == "runs/stability-quick"
    empty = {"before": {f: 0.0 for f in module.BENCHMARKS}, "replays": {}, "replay_reproduces_recording": None,
             "live": {}, "timings_s": {}, "total_s": 0.0}
    quick = module.render({**empty, "settings": {"quick": True}})
    assert quick.splitlines()[0].startswith("**quick: checks the plumbing, not a result")
    assert "quick" not in module.render({**empty, "settings": {"quick": False}})


def test_robustness_quick_says_it_checks_the_plumbing(monkeypatch, capsys):
    module = script("robustness")
    for name in ("attack_actions", "attack_server", "attack_checkpoints", "attack_kill9"):
        monkeypatch.setattr(module, name, lambda *a: (True, [f"{name} ok"]))
    monkeypatch.setattr(module, "attack_cli", lambda: (True, ["cli ok"]))
    assert module.main(["--quick"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("quick: checks the plumbing, not a result")
    assert module.main([]) == 0
    assert "quick" not in capsys.readouterr().out
