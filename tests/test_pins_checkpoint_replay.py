"""Pins for checkpointing and replay (issue 27): the manifest a checkpoint is verified against, which checkpoints
pruning keeps, which one a resume or rollback may read, the health verdicts that choose @healthy and @best, and
the trainer state a resume puts back. Fake models that save a small state dict keep every test in milliseconds."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from stppo_agent.runs import checkpoint as ck
from stppo_agent.runs.checkpoint_health import (
    best_step,
    checkpoint_reward,
    finite_number,
    healthy_steps,
    monitored,
    tripped_iterations,
)


class FakeModel(torch.nn.Module):
    """A module that saves like a Hugging Face model (``save_pretrained``) and remembers what it was asked to save."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.layer = torch.nn.Linear(3, 2)
        self.saved: list[dict | None] = []

    def save_pretrained(self, path: Path, state_dict=None, safe_serialization=True):
        assert safe_serialization
        self.saved.append(state_dict)
        path.mkdir(parents=True, exist_ok=True)
        torch.save(dict(state_dict if state_dict is not None else self.state_dict()), path / "weights.pt")


class FakeTokenizer:
    def save_pretrained(self, path: Path):
        (path / "tokenizer.json").write_text("{}")


def save(run: Path, step: int, *, keep: int = 5, config: dict | None = None, optimizer: bool = True,
         protect=(), actor=None, critic=None, **kwargs) -> Path:
    tensors = {"actor_scheduler": {"last_epoch": step}, "torch_rng": torch.arange(3)}
    if optimizer:
        tensors["actor_optimizer"] = {"m": torch.full((2,), float(step))}
        tensors["critic_optimizer"] = {"m": torch.full((2,), -float(step))}
    return ck.save_checkpoint(run, step, actor=actor or FakeModel(), tokenizer=FakeTokenizer(), critic=critic,
                              tensor_state=tensors, json_state={"iteration": step, "config": config or {}},
                              keep=keep, protect=protect, **kwargs)


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


# --- the manifest and verification ---------------------------------------------------------------------------


def test_the_manifest_lists_every_file_with_its_sha256_and_size_and_verifies(tmp_path):
    folder = save(tmp_path, 3)
    assert folder == tmp_path / "checkpoints" / "step-3"
    listed = manifest(folder)
    files = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(listed) == files and "actor/weights.pt" in files and ck.OPTIMIZER_FILE in files
    for name, entry in listed.items():
        data = (folder / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    ck.verify_checkpoint(folder)
    assert not list((tmp_path / "checkpoints").glob(".*"))  # the scratch folder was renamed, not left behind


def test_verification_refuses_each_kind_of_damage(tmp_path):
    folder = save(tmp_path, 1)
    weights = folder / "actor" / "weights.pt"
    good = weights.read_bytes()
    flipped = bytearray(good)
    flipped[-1] ^= 1
    weights.write_bytes(bytes(flipped))  # same size, other bytes
    with pytest.raises(ck.CorruptCheckpointError, match="actor/weights.pt does not match its checksum"):
        ck.verify_checkpoint(folder)
    weights.write_bytes(good + b"x")  # other size
    with pytest.raises(ck.CorruptCheckpointError, match="does not match its checksum"):
        ck.verify_checkpoint(folder)
    weights.write_bytes(good)
    ck.verify_checkpoint(folder)
    (folder / "extra.bin").write_text("x")
    with pytest.raises(ck.CorruptCheckpointError, match="does not list extra.bin"):
        ck.verify_checkpoint(folder)
    (folder / "extra.bin").unlink()
    weights.unlink()
    with pytest.raises(ck.CorruptCheckpointError, match="actor/weights.pt is missing"):
        ck.verify_checkpoint(folder)


@pytest.mark.parametrize("text, message", [
    (None, "has no manifest.json"), ("{not json", "is not valid JSON"), ("[1]", "is not a mapping"),
    ('{"a": 1}', "is not a mapping"), ('{"trainer_state.pt": {"sha256": "x"}}', "is not a mapping"),
    ('{"trainer_state.pt": {"bytes": 1}}', "is not a mapping"), (b"\xff\xfe", "is not valid JSON")])
def test_a_missing_or_malformed_manifest_is_corrupt(tmp_path, text, message):
    folder = tmp_path / "step-1"
    folder.mkdir()
    if isinstance(text, bytes):
        (folder / "manifest.json").write_bytes(text)
    elif text is not None:
        (folder / "manifest.json").write_text(text)
    with pytest.raises(ck.CorruptCheckpointError, match=message):
        ck.verify_checkpoint(folder)


def test_an_empty_manifest_vouches_for_nothing(tmp_path):
    folder = tmp_path / "step-1"
    folder.mkdir()
    (folder / "manifest.json").write_text("{}")
    with pytest.raises(ck.CorruptCheckpointError, match="does not list any file"):
        ck.verify_checkpoint(folder)


def test_an_unlisted_optimizer_file_is_tolerated_and_never_read(tmp_path):
    folder = save(tmp_path, 2)
    ck.drop_optimizer_state(folder)
    torch.save({"actor_optimizer": {"m": torch.zeros(2)}}, folder / ck.OPTIMIZER_FILE)  # a drop cut short
    ck.verify_checkpoint(folder)
    tensors, state = ck.load_trainer_state(folder, optimizer=False)
    assert "actor_optimizer" not in tensors and state["iteration"] == 2
    with pytest.raises(ck.NoOptimizerStateError, match="holds no optimizer state.*--model .*step-2/actor"):
        ck.load_trainer_state(folder)


# --- what a checkpoint holds -----------------------------------------------------------------------------------


def test_optimizer_state_goes_to_its_own_file_and_comes_back_merged(tmp_path):
    folder = save(tmp_path, 4)
    alone = torch.load(folder / "trainer_state.pt", weights_only=True)
    assert set(alone) == {"actor_scheduler", "torch_rng"}
    optimizer = torch.load(folder / ck.OPTIMIZER_FILE, weights_only=True)
    assert set(optimizer) == {"actor_optimizer", "critic_optimizer"}
    tensors, state = ck.load_trainer_state(folder)
    assert set(tensors) == {"actor_scheduler", "torch_rng", "actor_optimizer", "critic_optimizer"}
    assert tensors["actor_optimizer"]["m"].tolist() == [4.0, 4.0]
    assert tensors["critic_optimizer"]["m"].tolist() == [-4.0, -4.0]
    assert state == {"iteration": 4, "config": {}}


def test_without_optimizer_state_no_optimizer_file_is_written(tmp_path):
    folder = save(tmp_path, 1, optimizer=False)
    assert not (folder / ck.OPTIMIZER_FILE).exists()
    with pytest.raises(ck.NoOptimizerStateError):
        ck.load_trainer_state(folder)
    assert ck.load_trainer_state(folder, optimizer=False)[1]["iteration"] == 1


def test_load_trainer_state_refuses_a_corrupt_checkpoint(tmp_path):
    folder = save(tmp_path, 1)
    (folder / "trainer_state.json").write_text('{"iteration": 99}')
    with pytest.raises(ck.CorruptCheckpointError):
        ck.load_trainer_state(folder)


def test_checkpoint_dtype_casts_the_weights_on_disk_and_keeps_integers(tmp_path):
    actor, critic = FakeModel(0), FakeModel(1)
    folder = save(tmp_path, 1, actor=actor, critic=critic, config={"checkpoint_dtype": "bfloat16"})
    assert actor.saved[0]["layer.weight"].dtype == torch.bfloat16
    assert critic.saved[0]["layer.weight"].dtype == torch.bfloat16
    assert torch.equal(actor.saved[0]["layer.weight"], actor.layer.weight.detach().bfloat16())
    assert json.loads((folder / "critic" / "critic.json").read_text())["kind"] == "value-head"
    given = {"w": torch.ones(2, dtype=torch.float32), "n": torch.tensor([7])}
    actor2 = FakeModel()
    save(tmp_path / "b", 1, actor=actor2, actor_state=given, config={"checkpoint_dtype": "float16"})
    assert actor2.saved[0]["w"].dtype == torch.float16 and actor2.saved[0]["n"].dtype == torch.int64
    actor3, critic3 = FakeModel(), FakeModel()
    save(tmp_path / "c", 1, actor=actor3, critic=critic3)  # no checkpoint_dtype: the modules' own state
    assert actor3.saved == [None] and critic3.saved == [None]


def test_in_dtype_keeps_tied_tensors_tied_and_distinct_ones_distinct():
    shared = torch.randn(2, 3)
    other = torch.randn(2, 3)
    out = ck.in_dtype({"embed": shared, "head": shared, "other": other, "steps": torch.tensor([1, 2])}, "bfloat16")
    assert out["embed"] is out["head"] and out["embed"].dtype == torch.bfloat16
    assert out["other"] is not out["embed"] and torch.equal(out["other"], other.bfloat16())
    assert out["steps"].dtype == torch.int64
    view = torch.randn(4, 3)
    halves = ck.in_dtype({"a": view[:2], "b": view[2:]}, "float16")  # one storage, other offsets: two tensors
    assert torch.equal(halves["a"], view[:2].half()) and torch.equal(halves["b"], view[2:].half())


@pytest.mark.parametrize("dtype, policy, on_collapse, message", [
    ("float64", "all", None, "checkpoint_dtype must be bfloat16, float16, float32 or null, got 'float64'"),
    (None, "oldest", None, "checkpoint_optimizer must be all or newest, got 'oldest'"),
    (None, "newest", "rollback", "checkpoint_optimizer=newest drops the optimizer state")])
def test_bad_checkpoint_settings_are_refused(dtype, policy, on_collapse, message):
    with pytest.raises(ValueError, match=message):
        ck.check_checkpoint_settings(dtype, policy, on_collapse)


@pytest.mark.parametrize("dtype, policy, on_collapse", [
    (None, "all", "rollback"), ("float32", "newest", "stop"), ("float16", "newest", None), ("bfloat16", "all", None)])
def test_good_checkpoint_settings_pass(dtype, policy, on_collapse):
    ck.check_checkpoint_settings(dtype, policy, on_collapse)


def test_save_checkpoint_checks_the_recorded_settings_before_writing(tmp_path):
    with pytest.raises(ValueError, match="checkpoint_optimizer=newest drops"):
        save(tmp_path, 1, config={"checkpoint_optimizer": "newest", "on_collapse": "rollback"})
    with pytest.raises(ValueError, match="checkpoint_dtype must be"):
        save(tmp_path, 1, config={"checkpoint_dtype": "int8"})
    assert ck.list_checkpoints(tmp_path) == []


# --- pruning, the optimizer policy, rewriting ----------------------------------------------------------------


def test_pruning_keeps_the_newest_and_the_protected(tmp_path):
    for step in (1, 2, 3, 9, 10):
        save(tmp_path, step, keep=2, protect=(1,))
    assert ck.list_checkpoints(tmp_path) == [1, 9, 10]
    save(tmp_path, 11, keep=1)
    assert ck.list_checkpoints(tmp_path) == [11]


def test_newest_optimizer_policy_drops_the_older_ones_optimizer_state_only(tmp_path):
    newest = {"checkpoint_optimizer": "newest"}
    save(tmp_path, 1, keep=3, config=newest, protect=(1,))
    save(tmp_path, 2, keep=3, config=newest)
    root = tmp_path / "checkpoints"
    assert not (root / "step-1" / ck.OPTIMIZER_FILE).exists()
    assert ck.OPTIMIZER_FILE not in manifest(root / "step-1")
    assert (root / "step-2" / ck.OPTIMIZER_FILE).exists()
    assert ck.load_trainer_state(root / "step-2")[0]["actor_optimizer"]["m"].tolist() == [2.0, 2.0]
    assert ck.valid_checkpoints(tmp_path) == [1, 2]
    save(tmp_path, 3, keep=3)  # the default policy (all) keeps every one's
    assert (root / "step-3" / ck.OPTIMIZER_FILE).exists() and (root / "step-2" / ck.OPTIMIZER_FILE).exists()


def test_rewriting_a_step_replaces_it_and_a_stale_scratch_folder_is_cleared(tmp_path):
    save(tmp_path, 5)
    scratch = tmp_path / "checkpoints" / ".step-5.tmp"
    scratch.mkdir()
    (scratch / "leftover").write_text("x")
    folder = ck.save_checkpoint(tmp_path, 5, actor=FakeModel(), tokenizer=FakeTokenizer(), critic=None,
                                tensor_state={"torch_rng": torch.zeros(1)}, json_state={"iteration": 55}, keep=3)
    ck.verify_checkpoint(folder)
    assert ck.load_trainer_state(folder, optimizer=False)[1] == {"iteration": 55}
    assert not scratch.exists() and not (folder / "leftover").exists()


class BrokenModel(FakeModel):
    def save_pretrained(self, path, state_dict=None, safe_serialization=True):
        path.mkdir(parents=True, exist_ok=True)
        (path / "half").write_text("x")
        raise OSError("No space\n left on device")


def test_a_failed_write_removes_its_partial_copy_and_names_the_intact_checkpoint(tmp_path):
    with pytest.raises(ck.CheckpointWriteError, match="no complete checkpoint exists yet"):
        save(tmp_path, 1, actor=BrokenModel())
    save(tmp_path, 2)
    save(tmp_path, 4)
    with pytest.raises(ck.CheckpointWriteError) as error:
        save(tmp_path, 6, actor=BrokenModel(), keep=1)
    text = str(error.value)
    assert "No space left on device" in text and "step-4, is intact" in text and "step-6" in text
    assert "rerun with --resume" in text and isinstance(error.value.__cause__, OSError)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2", "step-4"]


# --- listing, verifying, setting aside -----------------------------------------------------------------------


def test_list_checkpoints_reads_step_folders_only_in_numeric_order(tmp_path):
    assert ck.list_checkpoints(tmp_path) == []
    root = tmp_path / "checkpoints"
    for name in ("step-10", "step-9", "step-2", ".step-3.tmp", "step-x", "step-4-old", ".rollback-step-7"):
        (root / name).mkdir(parents=True)
    (root / "step-5").write_text("a file")
    assert ck.list_checkpoints(tmp_path) == [2, 9, 10]


def test_valid_checkpoints_leaves_out_the_corrupt_ones_oldest_first(tmp_path):
    for step in (3, 1, 2):
        save(tmp_path, step)
    (tmp_path / "checkpoints" / "step-2" / "manifest.json").unlink()
    assert ck.valid_checkpoints(tmp_path) == [1, 3]


def test_set_aside_hides_a_checkpoint_and_replaces_an_older_one_set_aside(tmp_path):
    first = save(tmp_path, 4)
    aside = ck.set_aside(first, "collapsed")
    assert aside == tmp_path / "checkpoints" / ".collapsed-step-4" and (aside / "manifest.json").exists()
    assert ck.list_checkpoints(tmp_path) == [] and not first.exists()
    again = save(tmp_path, 4)
    (again / "marker").write_text("new")
    ck.set_aside(again, "collapsed")
    assert (aside / "marker").read_text() == "new"


def test_drop_optimizer_state_edits_the_manifest_then_removes_the_file(tmp_path):
    folder = save(tmp_path, 1)
    ck.drop_optimizer_state(folder)
    assert not (folder / ck.OPTIMIZER_FILE).exists() and ck.OPTIMIZER_FILE not in manifest(folder)
    assert "trainer_state.pt" in manifest(folder)
    assert [p.name for p in folder.parent.iterdir()] == ["step-1"]  # no manifest scratch left
    ck.verify_checkpoint(folder)
    before = (folder / "manifest.json").read_text()
    ck.drop_optimizer_state(folder)  # nothing left to drop
    assert (folder / "manifest.json").read_text() == before
    (folder / ck.OPTIMIZER_FILE).write_text("leftover of a drop cut short")
    ck.drop_optimizer_state(folder)
    assert not (folder / ck.OPTIMIZER_FILE).exists()


def test_drop_optimizer_state_leaves_a_folder_with_a_bad_manifest_alone(tmp_path):
    folder = tmp_path / "step-1"
    folder.mkdir()
    (folder / ck.OPTIMIZER_FILE).write_text("x")
    ck.drop_optimizer_state(folder)  # no manifest
    (folder / "manifest.json").write_text("{broken")
    ck.drop_optimizer_state(folder)
    (folder / "manifest.json").write_text("[]")
    ck.drop_optimizer_state(folder)
    assert (folder / ck.OPTIMIZER_FILE).exists() and (folder / "manifest.json").read_text() == "[]"


def test_full_state_round_trips_without_a_process_group():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    state = ck.full_model_state(model)
    assert set(state) == {"weight", "bias"} and torch.equal(state["weight"], model.weight.detach())
    saved = ck.full_optimizer_state(model, optimizer)
    assert set(saved["state"]) == {"weight", "bias"}
    other = torch.nn.Linear(2, 2)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=0.1)
    ck.load_full_optimizer_state(other, other_optimizer, saved)
    assert torch.equal(other_optimizer.state[other.weight]["exp_avg"], optimizer.state[model.weight]["exp_avg"])
    assert torch.equal(other_optimizer.state[other.bias]["exp_avg_sq"], optimizer.state[model.bias]["exp_avg_sq"])


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


def test_tripped_iterations_count_a_positive_signal_count_or_an_alarm_and_not_a_bool_or_zero():
    rows = [{"step": 1, "collapse/tripped": 0}, {"step": 2, "collapse/tripped": 2}, {"step": "3", "collapse/alarm": 1},
            {"step": 4, "collapse/tripped": True}, {"step": 5, "collapse/tripped": float("nan")},
            {"step": 6}, {"step": 7, "collapse/tripped": 0.5}]
    assert tripped_iterations(rows) == {2, 3, 7}


def test_a_checkpoints_reward_is_the_next_iterations_else_its_own():
    rows = [{"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.2}, {"step": 3, "reward": float("inf")},
            {"step": 4, "reward": True}, {"step": "5", "reward": 5}, {"other": 1}]
    assert checkpoint_reward(rows, 1) == 0.2
    assert checkpoint_reward(rows, 2) == 0.2  # 3's reward is not finite
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
