"""docs/trl.md's example runs as written, with a tiny tool-calling model (tests/support/trl_models.py) in place of
SmolLM2: TRL's GRPOTrainer trains on the dict of envs, each rollout in the env its row names, on the train split.

Needs TRL: skipped without it; ``make test`` runs it in the TRL venv with ``STPPO_REQUIRE_TRL=1``.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.requires import require_trl

require_trl("docs/trl.md's example needs TRL (`pip install .[trl]`)")

from tests.support.trl_models import tiny_tool_model  # noqa: E402

DOC = Path(__file__).resolve().parents[3] / "docs" / "trl.md"
MODEL_LINE = re.compile(r"^model_path = .*$", re.M)


def example() -> str:
    """The first Python block of docs/trl.md: the GRPOTrainer example."""
    return re.search(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S).group(1)


def test_the_documented_example_trains_on_the_three_envs(tmp_path, monkeypatch):
    code = example()
    assert len(MODEL_LINE.findall(code)) == 1, "the example must name its model on one `model_path = ...` line"
    model = tiny_tool_model(tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(MODEL_LINE.sub(f"model_path = {str(model)!r}", code), str(DOC), "exec"), namespace)
    trainer, environments = namespace["trainer"], namespace["environments"]
    assert trainer.state.global_step == trainer.args.max_steps == 2
    assert "rewards/SearchEnvironment/mean" in trainer.state.log_history[0]
    benchmarks = {"nq", "hotpotqa", "medqa"}
    assert {f().env.benchmark for f in environments.values()} == benchmarks
    for environment in trainer.environments:  # the last batch's rollouts: each on a train question of its env
        assert environment.env.benchmark in benchmarks and environment.env.split == "train"
        assert environment.env.example in environment.env.examples
