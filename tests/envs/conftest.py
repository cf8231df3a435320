"""What the env tests share: the dataset loader's in-process cache emptied around each test,
so that a cached table cannot hide what a test changed."""

from __future__ import annotations

import pytest

from stppo_envs.data import loading


@pytest.fixture(autouse=True)
def _fresh_dataset_cache():
    """load_examples memoises by (source, file stamps): a cached table would hide what a test changed."""
    loading._load_cached.cache_clear()
    yield
    loading._load_cached.cache_clear()
