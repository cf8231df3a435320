"""What the commands' parsers share: the help format (defaults shown), argument types, BENCH=PATH pairs."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def share(text: str) -> float:
    """A rate in [0, 1] (NaN is outside)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a share in [0, 1], got {text}")
    return value


def distinct_benchmarks(names: str, option: str = "--benchmarks") -> list[str]:
    """Comma-separated benchmark names, canonical; one named twice (``nq,nq``, ``mmlu_med,mmlu-medical``) would be
    run twice and written as two records of one benchmark, so it is refused."""
    from stppo_envs import benchmark_info

    canonical = [benchmark_info(name.strip()).name for name in names.split(",") if name.strip()]
    twice = next((name for i, name in enumerate(canonical) if name in canonical[:i]), None)
    if twice is not None:
        raise ValueError(f"{option} names {twice} twice ({names}); name each benchmark once")
    return canonical


def benchmarks_and_datasets(names: str, items: list[str]) -> tuple[list[str], dict[str, str]]:
    """``--benchmarks`` and the ``--dataset BENCH=PATH`` pairs, both by canonical name (so ``--benchmarks NQ
    --dataset nq=PATH`` finds its dataset); a dataset named twice, or for a benchmark not asked for, is refused."""
    benchmarks = distinct_benchmarks(names)
    pairs = [key_value(item) for item in items]
    datasets = dict(pairs)
    if len(datasets) < len(pairs):  # a dict would keep the last silently
        twice = next(name for i, (name, _) in enumerate(pairs) if name in dict(pairs[:i]))
        raise ValueError(f"--dataset names {twice} twice; give one source per benchmark")
    stray = sorted(set(datasets) - set(benchmarks))
    if stray:
        raise ValueError(f"--dataset given for {', '.join(stray)}, which --benchmarks ({', '.join(benchmarks)}) does "
                         "not include; add it to --benchmarks or drop the --dataset")
    return benchmarks, datasets


def dataset_labels(datasets: dict[str, str]) -> dict[str, str]:
    """``--dataset nq=...`` -> its source, by benchmark name: how error messages name each dataset."""
    return {f"--dataset {name}=...": source for name, source in sorted(datasets.items())}


def key_value(item: str) -> tuple[str, str]:
    """``BENCH=PATH`` with the benchmark's canonical name (unknown names fail with a did-you-mean)."""
    key, sep, value = item.partition("=")
    if not sep:
        raise ValueError(f"expected BENCH=PATH, got {item!r}")
    from stppo_envs import benchmark_info

    return benchmark_info(key).name, value


class HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default unless its help already says it (or there is none to show)."""

    def _get_help_string(self, action):
        text = action.help or ""
        # by identity: `0 in (None, False)` is true, and a default of 0 (--seed, --format-reward) is worth showing
        nothing = action.default is None or action.default is False or action.default is argparse.SUPPRESS
        if "default" in text or action.required or nothing or action.default == []:
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)  # sub-commands get it too (they are built by this class)
        super().__init__(*args, **kwargs)
