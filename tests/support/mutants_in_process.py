"""Mutation scores in one process, fast: how NOTES.md's per-module scores were taken (`make mutants` is the
slower, forked confirmation).

    .venv/bin/mutmut run "stppo_agent.cli.*"      # generates mutants/ (interrupt it once "Running stats" shows)
    .venv/bin/mutmut results --all true | grep -o "stppo_agent[^:]*" > names.txt
    cd mutants && MUT_ALARM=120 ../.venv/bin/python ../tests/support/mutants_in_process.py out.txt ../names.txt \\
        tests/cli/test_main.py tests/cli/test_help_texts.py tests/cli/test_train.py ...

Pass the test modules of the modules mutated (tests/<subpackage>/test_<module>.py mirrors the library; the
``pytest_add_cli_args_test_selection`` of pyproject.toml lists them all) and test files only: a library module's path
adds its doctests, which fail when rerun in one process and would "kill" equivalent mutants.

Every collected test first runs once under mutmut's own "stats" trampoline, which records the mutated functions it
reaches; then each mutant (mutmut's switch, MUTANT_UNDER_TEST) runs only the tests that reach its function, in this
process, stopping at the first failure. Writes one line per mutant: killed / SURVIVED / NOTESTS, its name, the
seconds, the number of tests that reach it and the test that killed it. A mutant running past MUT_ALARM seconds
(default 60) is written "killed(timeout)": under load that is not a detection, so rerun those alone with a long
alarm. The tests must pass with no mutant first (asserted)."""

import os
import signal
import sys
import time
from collections import defaultdict

import pytest
from _pytest.runner import runtestprotocol

_reached_now: set[str] = set()


def _record_reached_functions() -> None:
    """mutmut's "stats" trampoline reports each mutated function a test reaches; keep the names. (Imported here:
    mutmut is installed by `make mutants` only, and the test session imports this file for its doctests.)"""
    import mutmut.mutation.trampoline as trampoline

    trampoline.record_trampoline_hit = lambda name, caller=None: _reached_now.add(name)


class _Timeout(BaseException):
    pass


def _alarm(*_):
    raise _Timeout()


def _failed(item) -> bool:
    return any(report.failed for report in runtestprotocol(item, log=False, nextitem=None))


class MutantLoop:
    def __init__(self, out: str, mutants: list[str]):
        self.out, self.mutants = out, mutants

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session):
        from mutmut.utils.format_utils import mangled_name_from_mutant_name

        signal.signal(signal.SIGALRM, _alarm)
        reached = defaultdict(list)
        os.environ["MUTANT_UNDER_TEST"] = "stats"
        failing = []
        for item in session.items:
            _reached_now.clear()
            if _failed(item):
                failing.append(item.nodeid)
            for function in _reached_now:
                reached[function].append(item)
        assert not failing, f"the tests fail with no mutant: {failing}"
        with open(self.out, "a") as out:
            for mutant in self.mutants:
                tests = reached.get(mangled_name_from_mutant_name(mutant), [])
                started = time.time()
                verdict, *killer = (self._run(mutant, tests) if tests else "NOTESTS").split()
                out.write(f"{verdict} {mutant} {time.time() - started:.1f}s {len(tests)} {' '.join(killer)}\n")
                out.flush()
        return True

    @staticmethod
    def _run(mutant: str, tests) -> str:
        os.environ["MUTANT_UNDER_TEST"] = mutant
        signal.alarm(int(os.environ.get("MUT_ALARM", "60")))
        try:
            return next((f"killed {item.name}" for item in tests if _failed(item)), "SURVIVED")
        except _Timeout:
            return "killed(timeout)"
        finally:
            signal.alarm(0)


if __name__ == "__main__":
    out_file, names_file, *pytest_args = sys.argv[1:]
    names = open(names_file).read().split()
    _record_reached_functions()
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args], plugins=[MutantLoop(out_file, names)]))
