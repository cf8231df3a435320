"""``stppo_agent.monitoring.step_diagnostics``: the values of one
optimizer step's diagnostics on a hand-made batch, their means, and a skipped step kept out of the ratio tails."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from stppo_agent.monitoring import step_diagnostics
from stppo_agent.monitoring.step_diagnostics import StepDiagnostics
from tests.support.training_parts import make_batch, update_stage

LOW, HIGH = math.log(1 - 0.2), math.log1p(0.28)


def micro(log_ratios, mask, turns):
    """A micro-batch whose old log-probs are 0, so ``logprobs`` are the log ratios; positions off the mask hold
    a huge ratio that must never count."""
    mask = torch.tensor(mask)
    logprobs = torch.where(mask, torch.tensor(log_ratios, dtype=torch.float32), torch.tensor(9.0))
    batch = SimpleNamespace(loss_mask=mask, old_logprobs=torch.zeros(mask.shape), turn_ids=torch.tensor(turns))
    return batch, logprobs


def first_micro():
    return micro([[0.0, 0.1, 0.3, -0.5], [0.0, LOW, HIGH, 0.0]],
                 [[False, True, True, True], [False, True, True, False]], [[0, 0, 0, 1], [0, 0, 1, 1]])


# -- step_diagnostics.py -----------------------------------------------------------------------------------------
def test_step_diagnostics_ratio_tails_and_outside_shares_of_one_step(tmp_path):
    diagnostics = StepDiagnostics(tmp_path / "steps.jsonl", clip_low=0.2, clip_high=0.28, gradients=False)
    diagnostics.begin_iteration(3)
    diagnostics.observe_micro(*first_micro())
    diagnostics.observe_micro(*micro([[0.0, -0.05]], [[True, True]], [[0, 0]]))
    metrics = {"clip_frac": 0.5, "turn_clip_frac": 0.25, "clip_bias_norm": 1.5, "clip_bias_scale": 2.0,
               "grad_norm": 3.0, "pg_grad_norm": 4.0, "loss": 9.0}
    out = diagnostics.finish_step([], metrics, optimizer_steps=6)
    tokens = torch.tensor([0.1, 0.3, -0.5, LOW, HIGH, 0.0, -0.05])
    turns = torch.tensor([0.2, -0.5, LOW, HIGH, -0.025])  # per (row, turn) means, row-major
    assert out["tail/ratio_max"] == pytest.approx(math.exp(0.3)) and out["tail/ratio_min"] == pytest.approx(
        math.exp(-0.5))
    assert out["tail/ratio_p99"] == pytest.approx(math.exp(float(torch.quantile(tokens.double(), 0.99))), rel=1e-6)
    assert out["tail/turn_ratio_max"] == pytest.approx(math.exp(HIGH), rel=1e-6)
    assert out["tail/turn_ratio_min"] == pytest.approx(math.exp(-0.5))
    assert out["tail/turn_ratio_p99"] == pytest.approx(math.exp(float(torch.quantile(turns.double(), 0.99))),
                                                       rel=1e-6)
    # 0.3 and -0.5 are outside [log 0.8, log 1.28]; the two ratios exactly on the bounds are not
    assert out["tail/token_outside_frac"] == pytest.approx(2 / 7)
    assert out["tail/turn_outside_frac"] == pytest.approx(1 / 5)  # -0.5; 0.2 is inside [-0.223, 0.247]
    assert "grad_cos_to_first" not in out and len(out) == 8
    record = json.loads((tmp_path / "steps.jsonl").read_text())
    assert (record["iteration"], record["step"], record["minibatch"], record["on_policy"]) == (3, 7, 0, True)
    assert {k: record[k] for k in metrics if k in record} == {k: v for k, v in metrics.items() if k != "loss"}
    assert record["ratio_max"] == pytest.approx(math.exp(0.3)) and "tail/ratio_max" not in record
    again = diagnostics.finish_step([], {}, optimizer_steps=7)  # nothing observed since: no tails
    assert again == {}
    second = json.loads((tmp_path / "steps.jsonl").read_text().splitlines()[1])
    assert second == {"iteration": 3, "step": 8, "minibatch": 1, "on_policy": False}


def test_step_diagnostics_a_clip_low_of_one_has_no_lower_bound():
    diagnostics = StepDiagnostics(None, clip_low=1.0, clip_high=0.2, gradients=False)
    assert diagnostics.log_low == -math.inf and diagnostics.log_high == pytest.approx(math.log(1.2))
    diagnostics.observe_micro(*micro([[-5.0, 0.0, 0.18]], [[True, True, True]], [[0, 1, 2]]))
    out = diagnostics.finish_step([], {}, 0)
    assert out["tail/token_outside_frac"] == 0.0 and out["tail/turn_outside_frac"] == 0.0
    narrow = StepDiagnostics(None, clip_low=0.1, clip_high=0.1, gradients=False)
    assert narrow.log_low == pytest.approx(math.log(0.9))
    narrow.observe_micro(*micro([[-0.2, 0.0, 0.19]], [[True, True, True]], [[0, 1, 2]]))
    assert narrow.finish_step([], {}, 0)["tail/token_outside_frac"] == pytest.approx(2 / 3)


def test_step_diagnostics_gradient_cosine_to_the_iterations_first_step():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    diagnostics = StepDiagnostics(None)
    diagnostics.begin_iteration(1)
    a.grad = torch.tensor([2.0, 0.0])  # b has no gradient: zeros of its size
    assert diagnostics.finish_step([a, b], {}, 0) == {"grad_cos_to_first": 1.0}
    a.grad, b.grad = torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0, 1.0])
    assert diagnostics.finish_step([a, b], {}, 1)["grad_cos_to_first"] == pytest.approx(1 / math.sqrt(3))
    a.grad = torch.tensor([-1.0, 0.0])
    assert diagnostics.finish_step([a, b], {}, 2)["grad_cos_to_first"] == pytest.approx(-1 / math.sqrt(2))
    a.grad, b.grad = torch.zeros(2), None
    assert diagnostics.finish_step([a, b], {}, 3)["grad_cos_to_first"] == 0.0  # a zero gradient: no direction
    diagnostics.begin_iteration(2)  # a new iteration: a new reference
    a.grad = torch.tensor([0.0, 3.0])
    assert diagnostics.finish_step([a, b], {}, 4)["grad_cos_to_first"] == 1.0
    assert diagnostics.minibatch == 1 and diagnostics.iteration == 2


def test_step_diagnostics_small_and_zero_gradients():
    a = torch.nn.Parameter(torch.zeros(2))
    diagnostics = StepDiagnostics(None)
    a.grad = torch.zeros(2)  # a zero first gradient: nothing to compare with
    assert diagnostics.finish_step([a], {}, 0)["grad_cos_to_first"] == 0.0
    a.grad = torch.tensor([0.5, 0.0])
    assert diagnostics.finish_step([a], {}, 1)["grad_cos_to_first"] == 0.0
    small = StepDiagnostics(None)
    a.grad = torch.tensor([0.3, 0.4])  # norms below 1 are directions too
    assert small.finish_step([a], {}, 0)["grad_cos_to_first"] == pytest.approx(1.0)
    a.grad = torch.tensor([0.4, -0.3])
    assert small.finish_step([a], {}, 1)["grad_cos_to_first"] == pytest.approx(0.0, abs=1e-12)
    a.grad = torch.tensor([0.0, 0.5])
    assert small.finish_step([a], {}, 2)["grad_cos_to_first"] == pytest.approx(0.8)


def test_step_diagnostics_sharded_gradients_sum_the_products_over_ranks(monkeypatch):
    from stppo_agent.distributed import process_group

    reduced = []

    def all_reduce_sum(sums):  # the other rank's shard: gradient (0, 1) now, (0, 1) first
        reduced.append(sums.tolist())
        return sums + torch.tensor([1.0, 1.0, 1.0], dtype=sums.dtype)

    monkeypatch.setattr(process_group, "all_reduce_sum", all_reduce_sum)
    a = torch.nn.Parameter(torch.zeros(1))
    sharded = StepDiagnostics(None, sharded=True)
    a.grad = torch.tensor([1.0])
    assert sharded.finish_step([a], {}, 0)["grad_cos_to_first"] == pytest.approx(1.0)
    a.grad = torch.tensor([-1.0])
    assert sharded.finish_step([a], {}, 1)["grad_cos_to_first"] == pytest.approx(0.0)  # (-1, 1) . (1, 1)
    assert reduced == [[1.0, 1.0, 1.0], [-1.0, 1.0, 1.0]]
    reduced.clear()
    a.grad = torch.tensor([1.0])
    StepDiagnostics(None).finish_step([a], {}, 0)  # not sharded (the default): no collective
    assert reduced == []


def test_step_diagnostics_defaults(tmp_path):
    fresh = StepDiagnostics(None)
    assert (fresh.log_low, fresh.log_high) == (pytest.approx(math.log(0.8)), pytest.approx(math.log(1.2)))
    assert not fresh.sharded and fresh.gradients and fresh.reference is None
    path = tmp_path / "steps.jsonl"
    path.write_text('{"iteration": 0}\n{"iteration": 1}\n')
    fresh = StepDiagnostics(path, gradients=False)  # a new run (start_iteration 0) keeps nothing after 0
    assert path.read_text() == '{"iteration": 0}\n'
    fresh.finish_step([], {}, 0)
    assert json.loads(path.read_text().splitlines()[-1]) == {"iteration": 0, "step": 1, "minibatch": 0,
                                                             "on_policy": True}


def test_step_diagnostics_gathers_every_ranks_ratios(monkeypatch):
    from stppo_agent.distributed import process_group

    other = [torch.tensor([0.5, -0.7]), torch.tensor([0.5])]
    monkeypatch.setattr(process_group, "world_size", lambda: 2)
    monkeypatch.setattr(process_group, "all_gather_objects", lambda local: [local, other])
    diagnostics = StepDiagnostics(None, gradients=False)
    diagnostics.observe_micro(*micro([[0.1]], [[True]], [[0]]))
    out = diagnostics.finish_step([], {}, 0)
    assert out["tail/ratio_max"] == pytest.approx(math.exp(0.5)) and out["tail/ratio_min"] == pytest.approx(
        math.exp(-0.7))
    assert out["tail/turn_ratio_min"] == pytest.approx(math.exp(0.1)) and out["tail/turn_outside_frac"] == 0.5


def test_step_diagnostics_on_resume_drops_the_steps_of_redone_iterations(tmp_path):
    path = tmp_path / "steps.jsonl"
    lines = [{"iteration": 1, "step": 1}, {"iteration": 2, "step": 2}, {"iteration": 3, "step": 3}]
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n\n" + '{"iteration": 1, "st')
    StepDiagnostics(path, start_iteration=2)
    assert [json.loads(x) for x in path.read_text().splitlines()] == lines[:2]  # the torn line goes too
    assert path.read_text().endswith("}\n")
    StepDiagnostics(path, start_iteration=0)
    assert path.read_text() == ""
    assert not (tmp_path / "new.jsonl").exists() and StepDiagnostics(tmp_path / "new.jsonl").path.name == "new.jsonl"
    assert step_diagnostics._iteration_of('{"step": 1}') == 0 and step_diagnostics._iteration_of('{"st') == 1 << 62
    assert step_diagnostics._iteration_of('{"iteration": null}') == step_diagnostics._iteration_of(
        '{"iteration": "x"}') == 1 << 62 and step_diagnostics._iteration_of('{"iteration": 7}') == 7
    # a line that is JSON but not an object (a hand edit) is dropped like a torn one, not a crash of the resume
    assert step_diagnostics._iteration_of("[1]") == step_diagnostics._iteration_of("7") == 1 << 62


def test_step_diagnostics_for_a_run_follow_its_config(tmp_path):
    from stppo_agent.algorithms import AlgorithmConfig

    algo = AlgorithmConfig(clip_low=0.1, clip_high=0.3)

    def diagnostics(diagnose, on_collapse):
        return StepDiagnostics.for_run(tmp_path, algo, step_diagnostics=diagnose, on_collapse=on_collapse,
                                       sharded=True, iteration=4)

    assert diagnostics(False, "none") is None
    full = diagnostics(True, "none")
    assert full.path == tmp_path / "steps.jsonl" and full.gradients and full.sharded
    assert (full.log_low, full.log_high) == (pytest.approx(math.log(0.9)), pytest.approx(math.log(1.3)))
    tails = diagnostics(False, "warn")
    assert tails.path is None and not tails.gradients


def test_step_diagnostics_resume_keeps_the_start_iterations_steps(tmp_path):
    from stppo_agent.algorithms import AlgorithmConfig

    path = tmp_path / "steps.jsonl"
    path.write_text('{"iteration": 4}\n{"iteration": 5}\n')
    StepDiagnostics.for_run(tmp_path, AlgorithmConfig(clip_low=0.2, clip_high=0.2), step_diagnostics=True,
                            on_collapse="none", iteration=4)
    assert path.read_text() == '{"iteration": 4}\n'


# -- a skipped (non-finite) step's importance ratios stay out of the next step's tails ------------------------------

def _diagnosed_trainer():
    from stppo_agent.monitoring.step_diagnostics import StepDiagnostics

    t = update_stage(critic=False, monitor=dict(max_nan_skips=5))
    t.diagnostics = StepDiagnostics(None, gradients=False)
    return t


def _far_off_policy_nan_step():
    mini = make_batch().select([0, 1, 2, 3])
    mini.advantages[0, 0] = math.nan  # the step is skipped
    mini.old_logprobs[:] = -30.0  # and its ratios are e^20 and more
    return mini


def test_a_skipped_steps_ratios_do_not_leak_into_the_next_applied_steps_tails():
    """The skipped step observed its micro-batches' ratios but never finished: the next applied step's tails
    (tail/ratio_max, _p99, ..., collapse signals of the off-policy family) were taken over both mini-batches, so a
    clean step logged the skipped one's e^20 ratios (or NaN, which the monitor ignores)."""

    t = _diagnosed_trainer()
    updater = t
    assert updater._optimizer_step(_far_off_policy_nan_step())["skipped"] == 1.0
    after_skip = updater._optimizer_step(make_batch().select([0, 1, 2, 3]))
    alone = _diagnosed_trainer()._optimizer_step(make_batch().select([0, 1, 2, 3]))
    tails = [key for key in alone if key.startswith("tail/")]
    assert tails and alone["tail/ratio_max"] < 10
    assert {key: after_skip[key] for key in tails} == {key: alone[key] for key in tails}


def test_a_skipped_last_step_does_not_leak_into_the_next_iterations_first_step():

    t = _diagnosed_trainer()
    updater = t
    t.diagnostics.begin_iteration(1)
    updater._optimizer_step(_far_off_policy_nan_step())
    t.diagnostics.begin_iteration(2)
    first = updater._optimizer_step(make_batch().select([0, 1, 2, 3]))
    assert first["tail/ratio_max"] < 10
