"""``stppo_envs.suggest``: the closest known name and the did-you-mean messages."""

from __future__ import annotations

from stppo_envs.suggest import closest, did_you_mean, unknown_name


def test_closest_names_ignore_case_keep_the_known_spelling_and_need_similarity():
    assert closest("st_ppp", ["ppo", "st_ppo", "grpo"]) == "st_ppo"
    assert closest("NQ-V1", ["NQ-v0", "HotpotQA-v0"]) == "NQ-v0"
    assert closest("nope", ["ppo", "st_ppo"]) is None
    assert closest("abcd", ["abxy"]) is None  # ratio 0.5 < 0.6
    assert closest("abcde", ["abcxy"]) == "abcxy"  # ratio exactly 0.6
    assert closest("ppo", ["PPO", "ppo"]) == "PPO"  # sorted: the first spelling of a lower-case name wins
    assert closest("grp", ["grpo", "gspo"]) == "grpo"
    assert closest(12, [11, 12]) == "12"


def test_did_you_mean_and_unknown_name_messages():
    assert did_you_mean("st_ppp", ["st_ppo"]) == " (did you mean st_ppo?)"
    assert did_you_mean("ppo", ["ppo"]) == "" and did_you_mean("nope", ["ppo"]) == ""
    assert did_you_mean("PPO", ["ppo"]) == " (did you mean ppo?)"
    assert unknown_name("algorithm", "st_ppp", ["st_ppo", "ppo"]) == \
        "unknown algorithm 'st_ppp' (did you mean st_ppo?); known: ppo, st_ppo"
    assert unknown_name("env", "x", iter(["b", "a"])) == "unknown env 'x'; known: a, b"
    assert unknown_name("kind", "aliax", ["alias", "z"], listing=["z", "y"]) == \
        "unknown kind 'aliax' (did you mean alias?); known: y, z"
