"""``stppo_agent.runs.checkpoint_health``: which checkpoints are healthy and
which is best."""

from __future__ import annotations

from stppo_agent.runs.checkpoint_health import (
    best_step,
    checkpoint_reward,
    finite_number,
    healthy_steps,
    monitored,
    tripped_iterations,
)

# --- health: which checkpoints are healthy, which is best -----------------------------------------------------


def records(*rows):
    return [dict(zip(("step", "collapse/tripped", "reward"), row)) for row in rows]


def test_a_checkpoint_is_healthy_only_when_its_iteration_and_the_next_were_judged_untripped():
    rows = records((1, 0, 0.1), (2, 0, 0.2), (3, 1, 0.3), (4, 0, 0.4), (5, 0, 0.5), (6, 0, 0.6))
    assert healthy_steps(rows, [1, 2, 3, 4, 5, 6]) == [1, 4, 5]  # 2: 3 tripped; 6: 7 unjudged
    assert healthy_steps(rows, [5, 1]) == [1, 5]
    alarm = rows + [{"step": 7, "collapse/tripped": 0, "collapse/alarm": True}]
    assert healthy_steps(alarm, [5, 6]) == [5]
    warm = [{**r, "collapse/warmup": r["step"] <= 2} for r in rows]
    assert healthy_steps(warm, [1, 2, 3, 4]) == [4]
    assert healthy_steps([{"step": 1, "reward": 1.0}, {"step": 2, "reward": 1.0}], [1]) == []
    assert healthy_steps(records((1, 0, 0.1), (2, 0, 0.2)), [1, 2]) == [1]  # exactly S and S + 1 judged is enough


def test_tripped_iterations_count_a_positive_signal_count_or_an_alarm_and_not_a_bool_or_zero():
    rows = [{"step": 1, "collapse/tripped": 0}, {"step": 2, "collapse/tripped": 2}, {"step": "3", "collapse/alarm": 1},
            {"step": 4, "collapse/tripped": True}, {"step": 5, "collapse/tripped": float("nan")},
            {"step": 6}, {"step": 7, "collapse/tripped": 0.5}]
    assert tripped_iterations(rows) == {2, 3, 7}


def test_a_checkpoints_reward_is_the_next_iterations_else_its_own():
    rows = [{"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.2}, {"step": 3, "reward": float("inf")},
            {"step": 4, "reward": True}, {"step": "5", "reward": 5}, {"other": 1}]
    assert checkpoint_reward(rows, 1) == 0.2
    assert checkpoint_reward(rows, 2) is None  # its own rollouts' (3's) reward is not finite: not the older 2's
    assert checkpoint_reward(rows, 4) == 5.0 and isinstance(checkpoint_reward(rows, 4), float)
    assert checkpoint_reward(rows, 3) is None  # neither 4 (a bool) nor 3 (infinite)
    assert checkpoint_reward(rows, 9) is None


def test_best_step_is_the_healthy_one_with_the_highest_reward_and_the_newest_among_equals():
    rows = records((1, 0, 0.1), (2, 0, 0.9), (3, 0, 0.9), (4, 0, 0.9), (5, 1, 2.0), (6, 0, 0.3), (7, 0, 0.0))
    assert best_step(rows, [1, 2, 3, 4, 5, 6]) == 3  # 1 -> 0.9, 2 -> 0.9, 3 -> 0.9: newest of equals
    assert best_step(rows, [1, 2, 3, 4, 5, 6], healthy_only=False) == 4  # 4 -> 2.0 (tripped but not judged)
    assert best_step(rows, [6]) == 6 and best_step(rows, [5]) is None
    assert best_step(records((1, 0, None), (2, 0, None)), [1]) is None
    assert best_step(rows, []) is None


def test_monitored_and_finite_number():
    assert monitored([{"step": 1}, {"step": 2, "collapse/tripped": 0}])
    assert not monitored([{"step": 1, "reward": 1.0}])
    assert finite_number(3) == 3.0 and isinstance(finite_number(3), float)
    assert finite_number(-2.5) == -2.5 and finite_number(0) == 0.0
    for bad in (True, False, None, "1", float("nan"), float("-inf")):
        assert finite_number(bad) is None
