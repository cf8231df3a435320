"""benchmarks/robustness.py --quick: every attack of the at-scale script holds (about a minute)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support.paths import REPO


def test_every_attack_holds_at_small_scale():
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "robustness.py"), "--quick"],
                            capture_output=True, text=True, timeout=900)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr[-3000:]
    assert re.search(r"fuzzed actions\s+2000 steps: exceptions 0,", out)
    assert re.search(r"of repeated tags (0\.[5-9]\d|1\.\d\d|2\.\d\d)x", out)  # linear parsing, with noise
    assert "good answered with their own results 100.0%, bad refused with a 4xx 100.0%" in out
    assert "loaded silently 0," in out
    assert re.search(r"command lines\s+(\d+) bad invocations: a clear error and a non-zero exit \1$", out, re.M)
    assert re.search(r"kill -9\s+1 kills at random moments over [2-5] runs", out)
    assert "final weights equal to an uninterrupted run yes, optimizer state yes, metrics records 1..10 once each yes" \
        in out
