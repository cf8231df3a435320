"""How much the third-party libraries may print: their errors only, unless ``--verbose`` or ``STPPO_VERBOSE=1``."""

from __future__ import annotations

import os

VERBOSE_ENV = "STPPO_VERBOSE"  # read by stppo_envs.retrieval._pyserini (Lucene) and inherited by child processes


def verbose_requested(flag: bool) -> bool:
    """``--verbose``, or ``STPPO_VERBOSE=1`` in the environment (how a command's child processes inherit it)."""
    return flag or os.environ.get(VERBOSE_ENV) == "1"


def set_third_party_output(verbose: bool) -> None:
    """Without ``verbose``: transformers, datasets and huggingface_hub print errors only and no progress bars, and
    Lucene/Anserini keep their INFO lines to themselves (``STPPO_VERBOSE`` unset). With it: each library's own
    defaults. Set through the libraries' runtime switches, not only environment variables, because ``datasets``
    reads its variables once, when first imported -- which the command line has done before it parses ``--verbose``.
    """
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
    for name in ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):  # for child processes
        if verbose:
            os.environ.pop(name, None)
        else:
            os.environ[name] = "1"
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(hf_logging.WARNING if verbose else hf_logging.ERROR)
        hf_logging.enable_progress_bar() if verbose else hf_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        from datasets.utils import logging as ds_logging

        ds_logging.set_verbosity(ds_logging.WARNING if verbose else ds_logging.ERROR)
        ds_logging.enable_progress_bar() if verbose else ds_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        import huggingface_hub.utils as hub_utils

        hub_utils.enable_progress_bars() if verbose else hub_utils.disable_progress_bars()
    except ImportError:
        pass
