"""A misspelt name anywhere on the command line gets the closest known one besides the list."""

from __future__ import annotations

from pathlib import Path

import pytest

from stppo_agent.cli import main
from stppo_envs.suggest import closest, did_you_mean, unknown_name

TRAIN = ["train", "--model", "m", "--output-dir", "{tmp}/run", "--iterations", "1"]


@pytest.mark.parametrize("argv, suggestion, listed", [
    (TRAIN + ["--algo", "st_ppp", "--env", "stppo/Toy-v0"], "did you mean st_ppo?", "grpo, gspo"),
    (TRAIN + ["--algo", "ppo", "--env", "stppo/NQ-v1"], "did you mean stppo/NQ-v0?", "Registered stppo envs"),
    (TRAIN + ["--algo", "ppo", "--env", "stppo/Toy-v0", "--model", "smolm2"], "did you mean smollm2?", "aliases"),
    (TRAIN + ["--algo", "ppo", "--env", "stppo/Toy-v0", "--set", "actor_lrr=1e-6"],
     "did you mean 'optimizer.actor_lr'?", "stppo train --help lists every key"),
    (TRAIN + ["--algo", "ppo", "--env", "stppo/Toy-v0", "--set", "algorithm.clip_hihg=0.3"],
     "did you mean clip_high?", "clip_low"),
    (TRAIN + ["--algo", "ppo", "--env", "stppo/NQ-v0", "--set", "env_kwargs.topkk=3"], "did you mean topk?",
     "max_turns"),
    (TRAIN + ["--algo", "ppo", "--env", "stppo/NQ-v0", "--set", "env_kwargs.retriever=bm52:idx"],
     "did you mean bm25?", "dense"),
    (["eval", "--agent", "oracle", "--benchmarks", "nq,hotpotq", "--output-dir", "{tmp}/e"],
     "did you mean hotpotqa?", "musique"),
    (["eval", "--agent", "orcale", "--benchmarks", "nq", "--output-dir", "{tmp}/e"], "did you mean oracle?",
     "search-copy"),
    (["eval", "--agent", "oracle", "--benchmarks", "nq", "--retriever", "dens:idx", "--output-dir", "{tmp}/e"],
     "did you mean dense?", "bm25"),
    (["sft", "--model", "smolm2", "--output-dir", "{tmp}/s"], "did you mean smollm2?", "aliases"),
])
def test_a_misspelt_name_gets_the_closest_known_one(tmp_path, capsys, argv, suggestion, listed):
    code = main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert code == 1 and suggestion in err and listed in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_replay_through_a_misspelt_algorithm(tmp_path, capsys):
    from stppo_agent.training.config import TrainConfig

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(TrainConfig(algo="ppo", model="m").to_yaml())
    assert main(["replay", str(tmp_path / "run"), "--algo", "turn_pp", "--output-dir", str(tmp_path / "rep")]) == 1
    assert "unknown algorithm 'turn_pp' (did you mean turn_ppo?)" in capsys.readouterr().err


def test_nothing_is_suggested_when_nothing_is_close():
    assert closest("nope", ["ppo", "st_ppo", "grpo"]) is None and did_you_mean("nope", ["ppo"]) == ""
    assert closest("ST_PPO", ["st_ppo"]) == "st_ppo"  # case-insensitive, the known spelling returned
    assert unknown_name("benchmark", "nqq", ["nq", "popqa"]) == \
        "unknown benchmark 'nqq' (did you mean nq?); known: nq, popqa"


def test_a_correct_name_passes_the_checks(tmp_path):
    from stppo_agent.plugins.name_checks import check_train_config
    from stppo_agent.training.config import TrainConfig

    model = Path(tmp_path)  # an existing folder is never taken for a misspelt alias
    check_train_config(TrainConfig(algo="st_ppo", env="stppo/NQ-v0,stppo/HotpotQA-v0", model=str(model),
                                   env_kwargs={"topk": 3, "retriever": "http://127.0.0.1:8000"}))
    check_train_config(TrainConfig(algo="grpo", env="stppo/Toy-v0", model="HuggingFaceTB/SmolLM2-135M"))
