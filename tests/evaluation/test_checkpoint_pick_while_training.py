"""``hf:RUN@latest`` while RUN trains: the checkpoint an evaluation picked is pinned, so the trainer does not prune it
before it is loaded (it prunes it at a later save instead), and picking races the writer without a raw error."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from stppo_agent.cli import main
from stppo_agent.models.tiny import toy_train_command
from stppo_agent.runs.checkpoint import list_checkpoints
from tests.support.cli_in_process import stppo
from tests.support.paths import REPO

KEEP_ONE = ("checkpoint.keep=1", "monitor.on_collapse=none")


def test_the_trainer_does_not_prune_the_checkpoint_an_evaluation_is_about_to_load(tiny_model, tmp_path, capsys,
                                                                                 monkeypatch):
    from stppo_agent.evaluation import hf_agent

    run = tmp_path / "run"
    assert main(toy_train_command(tiny_model, run, 2, extra=KEEP_ONE)[3:]) == 0
    load = hf_agent.HFAgent.__init__
    written = []

    def trainer_saves_twice_more_first(self, path, **kwargs):  # the writer, at the worst moment for the reader
        assert main(toy_train_command(tiny_model, run, 4, resume=True, extra=KEEP_ONE)[3:]) == 0
        written.append(list_checkpoints(run))
        load(self, path, **kwargs)

    monkeypatch.setattr(hf_agent.HFAgent, "__init__", trainer_saves_twice_more_first)
    done = stppo("eval", "--agent", f"hf:{run}@latest", "--benchmarks", "nq", "--limit", "1", "--max-turns", "1",
                 "--max-new-tokens", "2", "--output-dir", str(tmp_path / "eval"), capsys=capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"hf:{run}@latest -> step-2: the newest checkpoint" in done.stdout
    assert written == [[2, 4]]  # step-3 was pruned as keep_checkpoints=1 says; step-2, pinned, was kept
    assert f"hf:{run}/checkpoints/step-2/actor" in (tmp_path / "eval" / "results.json").read_text()


def test_picking_and_loading_the_latest_checkpoint_races_a_run_writing_and_pruning_them(tiny_model, tmp_path):
    from stppo_agent.evaluation.agent_specs import resolve_agent_spec
    from stppo_agent.models.loading import load_actor

    run = tmp_path / "run"
    assert main(toy_train_command(tiny_model, run, 1, extra=KEEP_ONE)[3:]) == 0
    writer = subprocess.Popen(toy_train_command(tiny_model, run, 25, resume=True, extra=KEEP_ONE), cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    picked, failures = [], []
    try:
        while writer.poll() is None:
            try:
                spec, _ = resolve_agent_spec(f"hf:{run}@latest")
                load_actor(spec[3:])
                picked.append(int(Path(spec).parent.name.split("-")[1]))
            except Exception as exc:  # any: the point is that none escapes
                failures.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.01)
    finally:
        if writer.poll() is None:
            writer.kill()
        stderr = writer.stderr.read().decode()
    assert writer.returncode == 0, stderr[-2000:]
    assert not failures, failures[:3]
    assert len(set(picked)) >= 5, picked  # it read many checkpoints while they were being written and pruned
    assert picked == sorted(picked)
