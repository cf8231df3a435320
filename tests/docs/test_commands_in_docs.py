"""Every command and flag the README, the docs pages and --help show exists, and --help shows defaults."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from stppo_agent.cli import build_parser, main
from tests.support.paths import REPO


def _subparsers(parser):
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return action.choices


DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def documented_commands() -> list[str]:
    """`stppo ...` command lines of the code blocks of the README and the docs pages, continuation lines joined."""
    blocks, current, language = [], None, ""
    for line in "\n".join(path.read_text() for path in DOCUMENTS).splitlines():
        if line.startswith("```"):
            if current is None:
                current, language = [], line[3:].strip()
            else:
                if language in ("", "bash", "sh"):
                    blocks.append("\n".join(current) + "\n")
                current = None
        elif current is not None:
            current.append(line)
    commands = []
    for block in blocks:
        joined = re.sub(r"\\\n\s*", " ", block)
        joined = re.sub(r"\n\s+(?=\[|--)", " ", joined)  # a synopsis wrapped onto indented lines
        for line in joined.splitlines():
            line = line.strip()
            for match in re.finditer(r"(?:^|[;&|]\s*)(stppo [a-z]+ [^#;&|]*)", line):
                commands.append(match.group(1).strip())
            if line.startswith("torchrun") and "stppo_agent.cli" in line:
                commands.append("stppo " + line.split("stppo_agent.cli", 1)[1].strip())
    return commands


def test_the_readme_shows_commands():
    assert len(documented_commands()) >= 8
    assert {command.split()[1] for command in documented_commands()} >= {"train", "eval", "compare", "index", "serve",
                                                                         "sft", "plot", "demo"}


@pytest.mark.parametrize("command", documented_commands())
def test_every_documented_flag_exists(command):
    tokens = shlex.split(command.replace("[", " ").replace("]", " ").replace("...", " "))
    assert tokens[0] == "stppo"
    parser = _subparsers(build_parser())[tokens[1]]
    if tokens[1] in ("index", "export"):  # commands with a sub-command of their own
        parser = _subparsers(parser)[tokens[2]]
    known = {option for action in parser._actions for option in action.option_strings}
    for token in tokens[2:]:
        if token.startswith("--"):
            assert token.split("=")[0] in known, f"{command}: {token} is not an option of stppo {tokens[1]}"


@pytest.mark.parametrize("command, shown", [(["eval"], "(default: 3)"), (["index", "bm25"], "(default: 1)"),
                                            (["serve"], "(default: 8000)"), (["train"], "optimizer.actor_lr=1e-6")])
def test_help_shows_defaults(command, shown, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert shown in out
    assert "lr=1e-6," not in out.replace("optimizer.actor_lr=1e-6", "")


def test_third_party_noise_is_hidden_unless_verbose(tmp_path):
    import subprocess
    import sys

    def run(*extra):
        # the installed console script, as a user types it (the one test that starts it: the others call the CLI's
        # entry point in-process or through `python -m stppo_agent.cli`)
        command = [str(Path(sys.executable).with_name("stppo")), *extra, "eval", "--agent", "search-copy",
                   "--benchmarks", "nq", "--limit", "2", "--output-dir", str(tmp_path / "out")]
        return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)

    quiet = run()
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "INFO" not in quiet.stderr and "MemorySegmentIndexInput" not in quiet.stderr, quiet.stderr[-2000:]
    assert "EM/acc" in quiet.stdout
    verbose = run("--verbose")
    assert verbose.returncode == 0 and "MemorySegmentIndexInput" in verbose.stderr


# The README's measured table compares the trainer with raw baselines: a baseline must do the trainer's work, no
# more, or the ratio flatters the trainer.


def _benchmark(name: str):
    import importlib.util
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_raw_update_baseline_does_exactly_the_trainers_forward_work(tmp_path):
    """Same micro-batches (length-sorted, trimmed), the same tokens through the body and the same positions (the
    response's only) through the LM head."""
    from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
    from stppo_agent.training.trainer import Trainer
    from tests.support.runs import toy_config

    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    # responses of 1-6 tokens over 1-3 turns, one row per micro-batch: each is trimmed to its own length
    trainer = Trainer(toy_config(model, tmp_path / "run", "grpo",
                                 rollout=dict(prompts_per_iteration=6, samples_per_prompt=2, max_turns=3,
                                              max_new_tokens_per_turn=2),
                                 optimizer=dict(mini_batch_size=12, micro_batch_size=1, epochs=1)),
                                                                                              report=lambda _: None)
    batch = trainer.rollout()
    trainer.score(batch)
    assert len(set(batch.lengths().tolist())) > 1  # rows differ in length, so trimming has something to trim
    seen = {"head": [], "body": []}
    head = trainer.state.actor.lm_head.register_forward_hook(lambda _m, i, _o: seen["head"].append(i[0].shape[:2]))
    body = trainer.state.actor.model.register_forward_pre_hook(
        lambda _m, args, kwargs: seen["body"].append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        trainer.update(batch)
        trainers = dict(seen)
        seen.update(head=[], body=[])
        _benchmark("trainer").raw_update(trainer.state.actor, batch, trainer.config.optimizer.micro_batch_size)
    finally:
        head.remove()
        body.remove()
    assert min(width for _, width in trainers["body"]) < batch.input_ids.shape[1]  # the trainer trims
    assert seen["body"] == trainers["body"]
    assert seen["head"] == trainers["head"]
    assert sum(rows * width for rows, width in seen["head"]) < batch.batch_size * batch.input_ids.shape[1]
