"""Fixtures every test folder sees: where the real benchmark slices live, a tiny Llama over the toy env's words,
an in-memory retriever, plugin registrations undone after each test, and the order files are run in."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

# Tests use local files only: a name that is not a local path must fail at once, as it does on a machine
# without the hub, instead of waiting on the network (set before anything imports huggingface_hub, which reads
# it once; subprocesses inherit it)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.support.retrievers import KeywordRetriever  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# The verl tests' helper modules import verl's own dependencies at module level; they run in .venv-verl (make
# test-verl), and --doctest-modules would otherwise import them in the main venv, where verl is absent.
collect_ignore = [] if importlib.util.find_spec("verl") else ["support/verl_agent_loops.py"]

# The slowest test files (paths under tests/), slowest first (wall time in a profile of the whole suite). `make test`
# hands whole files to two workers in collection order (`--dist loadfile --no-loadscope-reorder`), so these start
# first and the many quick files fill in at the end. xdist's default order (most tests first) ran them last -- files
# of one to ten tests, minutes each -- and left a worker idle for minutes while the other finished one.
SLOWEST_FIRST = (
    "benchmarks/test_stress_quick.py", "benchmarks/test_stability_quick.py", "docs/test_readme_walkthrough.py",
    "distributed/test_data_parallel_gradients.py", "runs/test_checkpoint_size.py", "runs/test_run_summary.py",
    "end_to_end/test_learning_on_the_toy_env.py", "training/test_m2po_whole_batch.py",
    "training/test_stale_policy.py", "training/test_sft.py", "envs/retrieval/test_backends_and_server.py",
    "distributed/test_shared_retrieval_stops_with_the_run.py", "distributed/test_rank_streams_under_torchrun.py",
    "benchmarks/test_robustness_quick.py", "evaluation/test_retriever_identity_in_comparisons.py",
    "monitoring/test_collapse_early_warning.py", "rollouts/test_append_cache.py",
    "training/test_metrics_independent_of_the_split.py", "monitoring/test_learning_signal.py", "cli/test_plot.py",
    "training/test_resampling.py", "envs/test_actions.py", "docs/test_commands_in_docs.py",
)


def suite_path(path: Path) -> str:
    """``path`` relative to tests/ (``runs/test_checkpoint.py``); "" for a file outside it (a library doctest)."""
    try:
        return path.resolve().relative_to(REPO / "tests").as_posix()
    except ValueError:
        return ""


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(suite_path(item.path), len(rank)))  # stable: a file's own order stays


def shared_data_dir() -> Path | None:
    """``$STPPO_SHARED_DATA`` or ``../shared/data`` beside the checkout (where CI puts the fixture pack)."""
    candidates = [os.environ.get("STPPO_SHARED_DATA"), REPO.parent / "shared" / "data"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "README.md").exists():
            return Path(candidate)
    return None


@pytest.fixture(autouse=True)
def _plugin_registrations_end_with_the_test():
    """A test that imports a plugin in-process registers its rule, loss, estimator or agent for the whole worker;
    the registries go back to what they held before, so no later test sees it (a test of the preset table would see a
    plugin's `my_algo` whenever the two tests share a worker)."""
    from stppo_agent.algorithms.advantages import ADVANTAGE_ESTIMATORS
    from stppo_agent.algorithms.config import ALGORITHMS
    from stppo_agent.algorithms.losses import POLICY_LOSSES, WHOLE_BATCH_STATISTICS
    from stppo_agent.evaluation.agent_specs import SCRIPTED_AGENTS

    registries = [r._items for r in (ALGORITHMS, ADVANTAGE_ESTIMATORS, POLICY_LOSSES, WHOLE_BATCH_STATISTICS)]
    registries.append(SCRIPTED_AGENTS)
    saved = [dict(registry) for registry in registries]
    modules_before, path_before = set(sys.modules), list(sys.path)
    yield
    for registry, before in zip(registries, saved):
        registry.clear()
        registry.update(before)
    # The plugin's module goes too: the loader skips a file whose module is imported already, so a later test
    # loading the same file would find it "loaded" and its rule unregistered. Only modules from outside the
    # interpreter and this checkout are plugins a test wrote; the folder the loader put on sys.path goes as well.
    # A venv layered on another (the verl and TRL venvs: a .pth file puts the main venv's site-packages on
    # sys.path) installs packages outside sys.prefix: every site-packages folder on the path counts as installed.
    roots = {sys.prefix, sys.base_prefix, REPO, *(p for p in path_before if Path(p).name == "site-packages")}
    installed = tuple(str(Path(p).resolve()) for p in roots)
    for name in set(sys.modules) - modules_before:
        origin = getattr(sys.modules[name], "__file__", None)
        if origin and not str(Path(origin).resolve()).startswith(installed):
            del sys.modules[name]
    sys.path[:] = path_before


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = shared_data_dir()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("CI must have the real-data fixture pack at ../shared/data or $STPPO_SHARED_DATA")
        pytest.skip("real-data fixture pack not found (set STPPO_SHARED_DATA)")
    return path


@pytest.fixture
def keyword_retriever() -> KeywordRetriever:
    return KeywordRetriever()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A random 2-layer Llama over the toy env's words (:func:`stppo_agent.models.tiny.build_tiny_llama`), one per
    test module."""
    from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer

    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", word_tokenizer())
