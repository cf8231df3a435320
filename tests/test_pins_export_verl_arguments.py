"""``stppo export verl`` hands every option to ``export_verl``: the dataset folder and the format reward too."""

from __future__ import annotations

import stppo_agent.integrations.verl.data as verl_data
from stppo_agent.cli import main


def test_export_verl_passes_the_dataset_limit_turns_and_format_reward(monkeypatch, tmp_path, capsys):
    calls = []

    def fake_export(benchmarks, split, out, **kwargs):
        calls.append((benchmarks, split, out, kwargs))
        return [f"{out}/nq_test.parquet"]

    monkeypatch.setattr(verl_data, "export_verl", fake_export)
    assert main(["export", "verl", "--benchmarks", "nq", "--split", "test", "--out", str(tmp_path),
                 "--dataset", "/data/nq", "--limit", "2", "--max-turns", "3", "--format-reward", "0.1"]) == 0
    [(benchmarks, split, out, kwargs)] = calls
    assert list(benchmarks) == ["nq"] and split == "test" and str(out) == str(tmp_path)
    assert kwargs == {"dataset": "/data/nq", "limit": 2, "max_turns": 3, "format_reward": 0.1}
    assert capsys.readouterr().out.split() == [f"{tmp_path}/nq_test.parquet"]
