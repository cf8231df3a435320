"""``stppo export verl`` hands every option to ``export_verl``: the dataset folder, the env's reward settings, the
question mark and the agent loop too."""

from __future__ import annotations

import stppo_agent.integrations.verl.data as verl_data
from stppo_agent.cli import main


def test_export_verl_passes_every_env_setting_and_the_agent_loop(monkeypatch, tmp_path, capsys):
    calls = []

    def fake_export(benchmarks, split, out, **kwargs):
        calls.append((benchmarks, split, out, kwargs))
        return [f"{out}/nq_test.parquet"]

    monkeypatch.setattr(verl_data, "export_verl", fake_export)
    assert main(["export", "verl", "--benchmarks", "nq", "--split", "test", "--out", str(tmp_path),
                 "--dataset", "/data/nq", "--limit", "2", "--max-turns", "3", "--format-reward", "0.1",
                 "--reward", "f1", "--no-question-mark", "--agent-loop", "stppo_tool_agent"]) == 0
    [(benchmarks, split, out, kwargs)] = calls
    assert list(benchmarks) == ["nq"] and split == "test" and str(out) == str(tmp_path)
    assert kwargs == {"dataset": "/data/nq", "limit": 2, "max_turns": 3, "format_reward": 0.1, "reward": "f1",
                      "question_mark": False, "agent_name": "stppo_tool_agent"}
    assert capsys.readouterr().out.split() == [f"{tmp_path}/nq_test.parquet"]
