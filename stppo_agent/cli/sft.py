"""``stppo sft``: a supervised warm start on a teacher agent's rewarded episodes."""

from __future__ import annotations

import argparse

from stppo_agent.cli.arguments import benchmarks_and_datasets, dataset_labels, positive_int


def add_parser(commands) -> None:
    from stppo_agent.plugins.loader import add_import_argument

    sft = commands.add_parser("sft", help="supervised warm start on a teacher agent's rewarded episodes")
    sft.add_argument("--model", required=True, help="Hugging Face folder or hub name; 'smollm2' for the default")
    sft.add_argument("--output-dir", required=True,
                     help="where the fine-tuned Hugging Face folder goes: a new or empty folder, or an earlier stppo "
                          "sft output (replaced whole)")
    sft.add_argument("--teacher", default="gold-search",
                     help="agent spec whose rewarded episodes are the data (default gold-search: search the "
                          "question, then any supporting passage not yet seen, then give the golden answer); "
                          "hf:PATH or openai:URL#MODEL for rejection sampling")
    sft.add_argument("--benchmarks", default="nq,hotpotqa", help="comma-separated benchmark names")
    sft.add_argument("--dataset", action="append", default=[], metavar="BENCH=PATH",
                     help="a FlashRAG-style dataset for a benchmark (default: the bundled demo set)")
    sft.add_argument("--split", default="train", help="dataset split the teacher plays")
    sft.add_argument("--limit", type=positive_int, default=None, help="examples per benchmark")
    sft.add_argument("--retriever", default=None,
                     help="retriever spec: demo, bm25:DIR, dense:DIR, http://HOST:PORT (default: demo, which only the "
                          "demo set may use implicitly: real data needs its own index or an explicit --retriever demo)")
    sft.add_argument("--max-turns", type=positive_int, default=3,
                     help="turns per demonstration (default 3: two searches)")
    sft.add_argument("--max-observation-tokens", type=positive_int, default=None,
                     help="tokens of one observation kept (default: train's max_observation_tokens default)")
    sft.add_argument("--max-total-tokens", type=positive_int, default=None,
                     help="longer demonstrations are skipped (default: train's max_total_tokens default)")
    sft.add_argument("--steps", type=positive_int, default=60, help="optimizer steps")
    sft.add_argument("--batch-size", type=positive_int, default=4, help="demonstrations per step")
    sft.add_argument("--lr", type=float, default=2e-5, help="learning rate")
    sft.add_argument("--dtype", default="float32", help="float32 or bfloat16 (float16 needs a loss scaler)")
    sft.add_argument("--autocast-dtype", default=None, choices=("bfloat16", "auto"),
                     help="forwards under torch.autocast with float32 weights (auto: bfloat16 on a GPU or AMX CPU)")
    sft.add_argument("--seed", type=int, default=0, help="seed")
    add_import_argument(sft)
    sft.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from stppo_agent.models.default_model import resolve_model
    from stppo_agent.plugins.loader import load_plugins
    from stppo_agent.plugins.name_checks import check_model, check_retriever
    from stppo_agent.rollouts.envs import refuse_real_data_without_retriever
    from stppo_agent.training.sft import SFTConfig, train_sft

    load_plugins(args.imports)  # a teacher of your own (register_agent)
    check_model(args.model)
    if args.retriever is not None:
        check_retriever(args.retriever)
    canonical, by_name = benchmarks_and_datasets(args.benchmarks, args.dataset)
    refuse_real_data_without_retriever(dataset_labels(by_name), args.retriever)
    # the names as given, as before; only the dataset lookup goes by canonical name
    benchmarks = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    datasets = {name: by_name[key] for name, key in zip(benchmarks, canonical) if key in by_name}
    limits = {name: getattr(args, name) for name in ("max_observation_tokens", "max_total_tokens")
              if getattr(args, name) is not None}  # unset: SFTConfig's defaults, which are training's
    summary = train_sft(SFTConfig(model=resolve_model(args.model), output_dir=args.output_dir, benchmarks=benchmarks,
                                  datasets=datasets, split=args.split, limit=args.limit, teacher=args.teacher,
                                  retriever=args.retriever or "demo", max_turns=args.max_turns, steps=args.steps,
                                  batch_size=args.batch_size, lr=args.lr, dtype=args.dtype,
                                  autocast_dtype=args.autocast_dtype, seed=args.seed, **limits))
    print(f"loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}; saved {args.output_dir}")
    return 0
