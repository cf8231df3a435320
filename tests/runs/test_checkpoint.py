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
        with torch.random.fork_rng():  # a checkpoint's own random state must not move
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
    text = (folder / "manifest.json").read_text()
    assert text == json.dumps(listed, indent=1, sort_keys=True)  # diffable: one field a line, files in order
    ck.verify_checkpoint(folder)
    assert not list((tmp_path / "checkpoints").glob(".*"))  # the scratch folder was renamed, not left behind


def test_verification_refuses_each_kind_of_damage(tmp_path):
    folder = save(tmp_path, 1)
    weights = folder / "actor" / "weights.pt"
    good = weights.read_bytes()
    flipped = bytearray(good)
    flipped[-1] ^= 1
    weights.write_bytes(bytes(flipped))  # same size, other bytes
    with pytest.raises(ck.CorruptCheckpointError, match=(r"step-1: actor/weights.pt does not match its checksum "
                                                         r"\(corrupt or edited\)$")):
        ck.verify_checkpoint(folder)
    weights.write_bytes(good + b"x")  # other size
    with pytest.raises(ck.CorruptCheckpointError, match="does not match its checksum"):
        ck.verify_checkpoint(folder)
    weights.write_bytes(good)
    ck.verify_checkpoint(folder)
    (folder / "extra.bin").write_text("x")  # not read by loading: someone else's file, not the checkpoint's
    (folder / "notes" / "results.json").parent.mkdir()
    (folder / "notes" / "results.json").write_text("{}")
    ck.verify_checkpoint(folder)
    (folder / "actor" / "added.bin").write_text("x")  # in the model folder a loader reads whole: must be vouched for
    with pytest.raises(ck.CorruptCheckpointError, match="does not list actor/added.bin$"):
        ck.verify_checkpoint(folder)
    (folder / "extra.bin").unlink()
    (folder / "actor" / "added.bin").unlink()
    weights.unlink()
    with pytest.raises(ck.CorruptCheckpointError, match="step-1: actor/weights.pt is missing$"):
        ck.verify_checkpoint(folder)


@pytest.mark.parametrize("text, message", [
    (None, r"step-1 has no manifest.json \(an interrupted or foreign write\)$"),
    ("{not json", "^/.*step-1/manifest.json is not valid JSON: Expecting"), ("[1]", "is not a mapping"),
    ('{"a": 1}', "step-1/manifest.json is not a mapping of file -> {sha256, bytes}$"),
    ('{"trainer_state.pt": {"sha256": "x"}}', "is not a mapping"),
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
    with pytest.raises(ck.CorruptCheckpointError, match="^/.*step-1/manifest.json does not list any file$"):
        ck.verify_checkpoint(folder)


def test_an_unlisted_optimizer_file_is_tolerated_and_never_read(tmp_path):
    folder = save(tmp_path, 2)
    ck.drop_optimizer_state(folder)
    torch.save({"actor_optimizer": {"m": torch.zeros(2)}}, folder / ck.OPTIMIZER_FILE)  # a drop cut short
    ck.verify_checkpoint(folder)
    tensors, state = ck.load_trainer_state(folder, optimizer=False)
    assert "actor_optimizer" not in tensors and state["iteration"] == 2
    with pytest.raises(ck.NoOptimizerStateError, match=(r"^/.*step-2 holds no optimizer state "
                                                        r"\(checkpoint.optimizer=newest keeps it in the newest "
                                                        r"checkpoint only\), so it cannot be resumed or rolled back "
                                                        r"to; its weights start a new run: --model /.*step-2/actor$")):
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
    assert (folder / "trainer_state.json").read_text() == json.dumps(state, indent=1, sort_keys=True)  # readable


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
    folder = save(tmp_path, 1, actor=actor, critic=critic, config={"checkpoint": {"dtype": "bfloat16"}})
    assert actor.saved[0]["layer.weight"].dtype == torch.bfloat16
    assert critic.saved[0]["layer.weight"].dtype == torch.bfloat16
    assert torch.equal(actor.saved[0]["layer.weight"], actor.layer.weight.detach().bfloat16())
    assert json.loads((folder / "critic" / "critic.json").read_text())["kind"] == "value-head"
    given = {"w": torch.ones(2, dtype=torch.float32), "n": torch.tensor([7])}
    actor2, critic2 = FakeModel(), FakeModel()
    save(tmp_path / "b", 1, actor=actor2, actor_state=given, critic=critic2, critic_state={"v": torch.ones(1)},
         config={"checkpoint": {"dtype": "float16"}})  # gathered full states, not the modules' own
    assert actor2.saved[0]["w"].dtype == torch.float16 and actor2.saved[0]["n"].dtype == torch.int64
    assert set(critic2.saved[0]) == {"v"} and critic2.saved[0]["v"].dtype == torch.float16
    actor3, critic3 = FakeModel(), FakeModel()
    save(tmp_path / "c", 1, actor=actor3, critic=critic3)  # no checkpoint.dtype: the modules' own state
    assert actor3.saved == [None] and critic3.saved == [None]


def test_in_dtype_keeps_tied_tensors_tied_and_distinct_ones_distinct():
    shared = torch.randn(2, 3)
    other = torch.randn(2, 3)
    out = ck.in_dtype({"embed": shared, "head": shared, "other": other, "steps": torch.tensor([1, 2])}, "bfloat16")
    assert out["embed"] is out["head"] and out["embed"].dtype == torch.bfloat16
    assert out["other"] is not out["embed"] and torch.equal(out["other"], other.bfloat16())
    assert out["steps"].dtype == torch.int64
    mixed = ck.in_dtype({"position_ids": torch.arange(3), "w": torch.ones(2)}, "float16")  # an integer first
    assert list(mixed) == ["position_ids", "w"] and mixed["w"].dtype == torch.float16
    view = torch.randn(4, 3)
    halves = ck.in_dtype({"a": view[:2], "b": view[2:]}, "float16")  # one storage, other offsets: two tensors
    assert torch.equal(halves["a"], view[:2].half()) and torch.equal(halves["b"], view[2:].half())


@pytest.mark.parametrize("dtype, policy, on_collapse, message", [
    ("bfloat61", "all", None, "^checkpoint.dtype must be bfloat16, float16, float32 or null, got 'bfloat61' "
                              r"\(did you mean bfloat16\?\)$"),
    ("int8", "all", None, "^checkpoint.dtype must be bfloat16, float16, float32 or null, got 'int8'$"),
    (None, "oldest", None, "^checkpoint.optimizer must be all, newest or none, got 'oldest'$"),
    (None, "newset", None, "^checkpoint.optimizer must be all, newest or none, got 'newset' "
                           r"\(did you mean newest\?\)$"),
    (None, "newest", "rollback", "^checkpoint.optimizer=newest drops the optimizer state that "
                                 "monitor.on_collapse=rollback restores from an older checkpoint: use "
                                 "checkpoint.optimizer=all with rollback$"),
    (None, "none", "rollback", "^checkpoint.optimizer=none never writes the optimizer state that "
                               "monitor.on_collapse=rollback restores from an older checkpoint: use "
                               "checkpoint.optimizer=all with rollback$")])
def test_bad_checkpoint_settings_are_refused(dtype, policy, on_collapse, message):
    with pytest.raises(ValueError, match=message):
        ck.check_checkpoint_settings(dtype, policy, on_collapse)


@pytest.mark.parametrize("dtype, policy, on_collapse", [
    (None, "all", "rollback"), ("float32", "newest", "stop"), ("float16", "newest", None), ("bfloat16", "all", None)])
def test_good_checkpoint_settings_pass(dtype, policy, on_collapse):
    ck.check_checkpoint_settings(dtype, policy, on_collapse)


def test_save_checkpoint_checks_the_recorded_settings_before_writing(tmp_path):
    with pytest.raises(ValueError, match="checkpoint.optimizer=newest drops"):
        save(tmp_path, 1, config={"checkpoint": {"optimizer": "newest"}, "monitor": {"on_collapse": "rollback"}})
    with pytest.raises(ValueError, match="checkpoint.dtype must be"):
        save(tmp_path, 1, config={"checkpoint": {"dtype": "int8"}})
    assert ck.list_checkpoints(tmp_path) == []


# --- pruning, the optimizer policy, rewriting ----------------------------------------------------------------


def test_pruning_keeps_the_newest_and_the_protected(tmp_path):
    for step in (1, 2, 3, 9, 10):
        save(tmp_path, step, keep=2, protect=(1,))
    assert ck.list_checkpoints(tmp_path) == [1, 9, 10]
    save(tmp_path, 11, keep=1)
    assert ck.list_checkpoints(tmp_path) == [11]


def test_newest_optimizer_policy_drops_the_older_ones_optimizer_state_only(tmp_path):
    newest = {"checkpoint": {"optimizer": "newest"}}
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
    with pytest.raises(ck.CheckpointWriteError, match=(r"^could not write checkpoint /.*step-1: No space left on "
                                                       r"device. The partial copy was removed and no complete "
                                                       r"checkpoint exists yet: free disk space \(or lower "
                                                       r"checkpoint.keep\), then rerun with --resume$")):
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
    assert (folder / "manifest.json").read_text() == json.dumps(manifest(folder), indent=1, sort_keys=True)
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


# --- trainer state: what a checkpoint holds besides the weights, and a resume ---------------------------------


class FakeSource:
    def __init__(self, position: int):
        self.position, self.loaded = position, None

    def state(self):
        return {"position": self.position}

    def load(self, state):
        self.loaded = state


class FakeStale:
    def __init__(self):
        self.loaded = "never"

    def state(self, actor):
        return {"model": {"w": torch.full((2,), 3.0)}, "pending": [{"w": torch.full((2,), 4.0)}],
                "pending_from_actor": True, "aliases": {}}

    def load(self, state, actor):
        self.loaded = state


def fake_run(tmp_path: Path, critic: bool = True, **overrides):
    """(a training state of linear models after two schedule steps, at iteration 6, and the config it trains
    under)."""
    from stppo_agent.training.config import from_dict, merged
    from stppo_agent.training.state import TrainingState

    values = dict(algo="ppo" if critic else "grpo", env="stppo/Toy-v0", model="tiny-model",
                  output_dir=str(tmp_path / "run"), optimizer=dict(actor_lr=0.01, critic_lr=0.02, weight_decay=0.05),
                  logging=dict(progress=False, tensorboard=False))
    config = from_dict(merged(values, overrides))

    def models(lr):
        module = torch.nn.Linear(2, 2)
        optimizer = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        module(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        scheduler.step()
        scheduler.step()
        return module, optimizer, scheduler

    actor, actor_optimizer, actor_scheduler = models(config.optimizer.actor_lr * 0.25)
    critic_model, critic_optimizer, critic_scheduler = models(config.optimizer.critic_lr) if critic else (None, None,
                                                                                                          None)
    state = TrainingState(tokenizer=None, actor=actor, actor_optimizer=actor_optimizer, actor_scheduler=actor_scheduler,
                          stale_policy=FakeStale(), critic=critic_model, critic_optimizer=critic_optimizer,
                          critic_scheduler=critic_scheduler, iteration=6, optimizer_steps=13, nan_skips_total=2,
                          actor_lr_scale=0.25, sampler=FakeSource(42))
    return state, config


def disturb(state) -> None:
    """Other optimizer moments and schedule positions than the saved state's."""
    for module, optimizer, scheduler in ((state.actor, state.actor_optimizer, state.actor_scheduler),
                                         (state.critic, state.critic_optimizer, state.critic_scheduler)):
        if optimizer is not None:
            module(torch.full((1, 2), 5.0)).sum().backward()
            optimizer.step()
            scheduler.last_epoch = 0


def checkpoint_of(run, folder: Path, step: int = 6) -> Path:
    state, config = run
    tensors, saved = state.states(config, config.algorithm_config())
    return ck.save_checkpoint(folder, step, actor=FakeModel(), tokenizer=FakeTokenizer(), critic=None,
                              tensor_state=tensors, json_state=saved, keep=3)


def resume(run, folder: Path) -> list[str]:
    """What the resume of ``run`` (state, config) from ``folder`` reported."""
    from stppo_agent.training.state import Restore

    state, config = run
    messages = []
    state.load(folder, config, config.algorithm_config(), Restore.RESUME, messages.append)
    return messages


def test_checkpoint_states_hold_the_counters_the_config_and_every_optimizer(tmp_path):
    from stppo_agent.runs.trainer_state import run_config

    state, config = fake_run(tmp_path)
    tensors, saved = state.states(config, config.algorithm_config())
    assert {"actor_optimizer", "actor_scheduler", "torch_rng", "critic_optimizer", "critic_scheduler"} <= set(tensors)
    assert "stale_policy" not in tensors
    assert torch.equal(tensors["torch_rng"], torch.get_rng_state())
    assert tensors["actor_scheduler"]["last_epoch"] == 2 and tensors["critic_scheduler"]["base_lrs"] == [0.02]
    assert set(tensors["actor_optimizer"]["state"]) == {"weight", "bias"}
    assert {k: saved[k] for k in ("iteration", "optimizer_steps", "nan_skips_total", "sampler", "algo", "model",
                                  "actor_lr_scale")} == {
        "iteration": 6, "optimizer_steps": 13, "nan_skips_total": 2, "sampler": {"position": 42}, "algo": "ppo",
        "model": "tiny-model", "actor_lr_scale": 0.25}
    assert saved["config"] == run_config(config, config.algorithm_config())
    assert saved["config"]["optimizer"]["actor_lr"] == 0.01
    assert saved["config"]["algorithm"]["use_critic"] is True  # every algorithm field resolved
    json.dumps(saved)  # the random states are JSON
    grpo, grpo_config = fake_run(tmp_path, critic=False, rollout=dict(staleness=1))
    tensors, _ = grpo.states(grpo_config, grpo_config.algorithm_config())
    assert "critic_optimizer" not in tensors and "critic_scheduler" not in tensors
    assert tensors["stale_policy"]["model"]["w"].tolist() == [3.0, 3.0]


def test_resume_puts_back_optimizers_schedules_streams_counters_and_the_sampler(tmp_path):
    import random

    import numpy as np

    saved, _ = run = fake_run(tmp_path, rollout=dict(staleness=1))
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    folder = checkpoint_of(run, tmp_path / "run")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    fresh, _ = again = fake_run(tmp_path, rollout=dict(staleness=1))
    fresh.iteration, fresh.optimizer_steps, fresh.nan_skips_total, fresh.actor_lr_scale = 0, 0, 0, 1.0
    disturb(fresh)
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    messages = resume(again, folder)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert (fresh.iteration, fresh.optimizer_steps, fresh.nan_skips_total) == (6, 13, 2)
    assert fresh.sampler.loaded == {"position": 42} and fresh.stale_policy.loaded["model"]["w"].tolist() == [3.0, 3.0]
    assert fresh.stale_policy.loaded["pending"][0]["w"].tolist() == [4.0, 4.0]
    assert fresh.stale_policy.loaded["pending_from_actor"]
    for name in ("actor", "critic"):
        old, new = getattr(saved, f"{name}_optimizer"), getattr(fresh, f"{name}_optimizer")
        model = getattr(fresh, name)
        assert torch.equal(new.state[model.weight]["exp_avg"], old.state[getattr(saved, name).weight]["exp_avg"])
        assert getattr(fresh, f"{name}_scheduler").last_epoch == 2
    assert fresh.actor_lr_scale == 0.25
    assert fresh.actor_optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.25 / 3)
    assert fresh.critic_optimizer.param_groups[0]["lr"] == pytest.approx(0.02 / 3)
    assert fresh.actor_optimizer.param_groups[0]["weight_decay"] == 0.05
    assert messages[0] == f"resumed from {folder} (iteration 6, 13 optimizer steps)"
    assert messages[1] == "actor learning rate 0.0025: optimizer.actor_lr 0.01 x0.25 from the run's rollbacks"
    assert len(messages) == 2


def test_a_resume_with_a_new_actor_lr_uses_it_as_given_and_says_so(tmp_path):
    folder = checkpoint_of(fake_run(tmp_path, logging=dict(save_rollouts=True)), tmp_path / "run")
    fresh, _ = again = fake_run(tmp_path, optimizer=dict(actor_lr=0.5), logging=dict(save_rollouts=True))
    messages = resume(again, folder)
    assert fresh.actor_lr_scale == 1.0
    assert fresh.actor_optimizer.param_groups[0]["lr"] == pytest.approx(0.5 / 3)
    assert fresh.actor_scheduler.base_lrs == [0.5] and fresh.actor_optimizer.param_groups[0]["initial_lr"] == 0.5
    assert messages[1] == "changed since the checkpoint: optimizer.actor_lr 0.01 -> 0.5"
    assert messages[2] == ("optimizer.actor_lr 0.5 is the rate used from now on (the rollbacks' x0.25 applied to "
                           "the old one)")
    assert messages[3] == ("this run records its rollouts, and stppo replay applies one config (the one in "
                           "config.yaml) to every iteration: a replay will not reproduce the iterations before "
                           "this change exactly")
    assert len(messages) == 4


@pytest.mark.parametrize("change,warned", [({"iterations": 12, "checkpoint": {"every": 3, "keep": 5}}, False),
                                           ({"iterations": 12, "optimizer": {"epochs": 2}}, True)])
def test_a_recording_run_warns_about_replays_only_for_changes_a_replay_would_see(tmp_path, change, warned):
    # running longer or checkpointing more often leaves every recorded iteration's update as it was; more epochs
    # does not
    folder = checkpoint_of(fake_run(tmp_path, logging=dict(save_rollouts=True)), tmp_path / "run")
    messages = resume(fake_run(tmp_path, **change, logging=dict(save_rollouts=True)), folder)
    assert messages[1].startswith("changed since the checkpoint: iterations 100 -> 12")
    assert any("a replay will not reproduce" in m for m in messages) == warned


def test_a_resume_with_nothing_changed_and_no_rollback_says_only_where_it_resumed(tmp_path):
    saved, _ = run = fake_run(tmp_path, logging=dict(save_rollouts=True))
    saved.actor_lr_scale = 1.0
    folder = checkpoint_of(run, tmp_path / "run")
    fresh, _ = again = fake_run(tmp_path, logging=dict(save_rollouts=True))
    messages = resume(again, folder)
    assert fresh.actor_lr_scale == 1.0 and len(messages) == 1
    assert fresh.actor_optimizer.param_groups[0]["lr"] == pytest.approx(0.01 / 3)


def test_an_old_checkpoint_without_a_recorded_scale_takes_it_from_its_schedule(tmp_path):
    folder = checkpoint_of(fake_run(tmp_path), tmp_path / "run")  # its schedule's base rate is actor_lr x 0.25
    saved = json.loads((folder / "trainer_state.json").read_text())
    del saved["actor_lr_scale"]
    (folder / "trainer_state.json").write_text(json.dumps(saved))
    (folder / "manifest.json").unlink()
    ck._write_manifest(folder)
    fresh, _ = again = fake_run(tmp_path)
    resume(again, folder)
    assert fresh.actor_lr_scale == pytest.approx(0.25)
    del saved["config"]  # older still: no config either, the run's config.yaml is gone, the current rate is used
    (folder / "trainer_state.json").write_text(json.dumps(saved))
    (folder / "manifest.json").unlink()
    ck._write_manifest(folder)
    fresh, _ = again = fake_run(tmp_path, optimizer=dict(actor_lr=0.0025))
    resume(again, folder)
    assert fresh.actor_lr_scale == pytest.approx(1.0)


def test_checkpoint_config_reads_the_checkpoints_record_else_the_runs_config_yaml(tmp_path):
    from stppo_agent.runs.trainer_state import checkpoint_config

    folder = tmp_path / "run" / "checkpoints" / "step-1"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"iteration": 1, "config": {"actor_lr": 0.3}}))
    assert checkpoint_config(folder) == {"optimizer": {"actor_lr": 0.3}}  # an earlier version's flat record
    (folder / "trainer_state.json").write_text(json.dumps({"iteration": 1}))
    assert checkpoint_config(folder) is None
    (tmp_path / "run" / "config.yaml").write_text("actor_lr: 1e-6\nalgo: ppo\n")
    assert checkpoint_config(folder) == {"optimizer": {"actor_lr": 1e-6}, "algo": "ppo"}


def test_check_resume_settings_refuses_a_fixed_change_before_the_models_load(tmp_path):
    from stppo_agent.runs.trainer_state import check_resume_settings

    def check(folder, **overrides):
        config = fake_run(tmp_path, **overrides)[1]
        check_resume_settings(config, config.algorithm_config(), folder, report=lambda _: None)

    folder = checkpoint_of(fake_run(tmp_path), tmp_path / "run")
    check(folder, optimizer=dict(actor_lr=0.9))
    check(None, seed=5)
    with pytest.raises(ValueError, match=r"--resume cannot change seed \(0 -> 5\)"):
        check(folder, seed=5)
    with pytest.raises(ValueError, match="cannot change logging.save_rollouts .*iterations 1..6"):
        check(folder, logging=dict(save_rollouts=True))


def test_apply_learning_rates_scales_the_actor_only_at_the_schedules_step(tmp_path):
    state, config = fake_run(tmp_path, optimizer=dict(actor_lr=0.4, critic_lr=0.6, weight_decay=0.125))
    state.actor_lr_scale = 0.5
    state.apply_learning_rates(config)
    actor, critic = state.actor_optimizer.param_groups[0], state.critic_optimizer.param_groups[0]
    assert (actor["initial_lr"], actor["lr"], actor["weight_decay"]) == (0.2, pytest.approx(0.2 / 3), 0.125)
    assert (critic["initial_lr"], critic["lr"], critic["weight_decay"]) == (0.6, pytest.approx(0.6 / 3), 0.125)
    assert state.actor_scheduler.base_lrs == [0.2] and state.critic_scheduler.base_lrs == [0.6]
    assert state.actor_scheduler.get_last_lr() == [actor["lr"]]
    state.actor_scheduler.step()
    assert actor["lr"] == pytest.approx(0.2 / 4)
    grpo, grpo_config = fake_run(tmp_path, critic=False)
    grpo.apply_learning_rates(grpo_config)
    assert grpo.actor_optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.25 / 3)


def test_restore_optimizers_puts_back_both_optimizers_and_schedules(tmp_path):
    saved, config = fake_run(tmp_path)
    tensors, _ = saved.states(config, config.algorithm_config())
    fresh, _ = fake_run(tmp_path)
    disturb(fresh)
    fresh.restore_optimizers(tensors)
    assert torch.equal(fresh.actor_optimizer.state[fresh.actor.weight]["exp_avg_sq"],
                       saved.actor_optimizer.state[saved.actor.weight]["exp_avg_sq"])
    assert torch.equal(fresh.critic_optimizer.state[fresh.critic.bias]["exp_avg"],
                       saved.critic_optimizer.state[saved.critic.bias]["exp_avg"])
    assert fresh.actor_scheduler.last_epoch == 2 and fresh.critic_scheduler.last_epoch == 2


# --- replay: the config a replay runs with, the batches it serves --------------------------------------------


def synthetic_batch(groups: int, per_group: int = 2):
    from stppo_agent.rollouts.batch import RolloutBatch

    rows = groups * per_group
    return RolloutBatch(
        input_ids=torch.arange(rows * 3).reshape(rows, 3) % 7 + 3, attention_mask=torch.ones(rows, 3, dtype=torch.long),
        prompt_width=1, response_ids=torch.arange(rows * 2).reshape(rows, 2) % 7 + 3,
        loss_mask=torch.ones(rows, 2, dtype=torch.bool), turn_ids=torch.zeros(rows, 2, dtype=torch.long),
        sample_logprobs=torch.zeros(rows, 2), rewards=torch.arange(rows, dtype=torch.float),
        group_ids=torch.arange(rows) // per_group, terminated=torch.ones(rows, dtype=torch.bool),
        truncated=torch.zeros(rows, dtype=torch.bool), stats={"reward": 1.0})


def recorded_run(tmp_path: Path, iterations=(1, 2, 3), worlds: dict | None = None, backend: str = "hf",
                 algo: str = "ppo", algorithm: dict | None = None, critic: bool = False, **config) -> Path:
    from stppo_agent.models.tiny import word_tokenizer
    from stppo_agent.runs.recording import RolloutRecorder
    from stppo_agent.training.config import from_dict, merged

    run = tmp_path / "recorded"
    values = dict(algo=algo, env="stppo/Toy-v0", model="tiny-model", output_dir=str(run),
                  iterations=config.pop("planned", len(iterations)), algorithm=algorithm or {"clip_high": 0.3},
                  logging=dict(progress=False, tensorboard=False, save_rollouts=True),
                  rollout=dict(backend=backend, temperature=0.9), distributed=dict(share_retriever=True))
    original = from_dict(merged(values, config))
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(original.to_yaml(resolved=original.algorithm_config()))
    (run / "rollouts" / "initial" / "actor").mkdir(parents=True)
    if critic:
        (run / "rollouts" / "initial" / "critic").mkdir()
    tokenizer = word_tokenizer()
    RolloutRecorder(run, tokenizer, 0, 1)  # format.json
    for iteration in iterations:
        world = (worlds or {}).get(iteration, 1)
        whole = synthetic_batch(4)
        for rank in range(world):
            share = whole.select(torch.isin(whole.group_ids, torch.arange(4)[rank::world]).nonzero().flatten())
            RolloutRecorder(run, tokenizer, rank, world).record(iteration, share)
    return run


def test_replay_config_keeps_the_recorded_run_but_not_its_recording_settings(tmp_path):
    from stppo_agent.training.replay import replay_config

    run = recorded_run(tmp_path)
    config = replay_config(run, None, str(tmp_path / "out"), ["optimizer.actor_lr=0.5"])
    assert (config.algo, config.iterations, config.optimizer.actor_lr) == ("ppo", 3, 0.5)
    assert config.output_dir == str(tmp_path / "out")
    assert (config.logging.save_rollouts, config.rollout.backend, config.distributed.share_retriever) == (False, "hf",
                                                                                                          False)
    assert config.logging.step_diagnostics is True and config.rollout.temperature == 0.9
    assert config.model == str(run / "rollouts" / "initial" / "actor") and config.critic_model is None
    assert config.algorithm_config().clip_high == 0.3  # the same algorithm keeps the recorded overrides
    assert replay_config(run, "ppo", str(tmp_path / "o")).algorithm_config().clip_high == 0.3
    other = replay_config(run, "grpo", str(tmp_path / "o"))
    assert other.algo == "grpo" and other.algorithm_config().clip_high != 0.3
    assert replay_config(run, None, str(tmp_path / "o"), iterations=2).iterations == 2
    with pytest.raises(ValueError, match=r"^iterations=4: /.* recorded only 3$"):
        replay_config(run, None, str(tmp_path / "o"), iterations=4)
    with pytest.raises(ValueError, match="recorded only 3"):
        replay_config(run, None, str(tmp_path / "o"), ["iterations=4"])
    stopped = recorded_run(tmp_path / "s", planned=10)  # a run stopped after 3 of its 10 iterations
    assert replay_config(stopped, None, "o").iterations == 3
    with_critic = recorded_run(tmp_path / "c", critic=True)
    assert replay_config(with_critic, None, "o").critic_model == str(with_critic / "rollouts" / "initial" / "critic")


@pytest.mark.parametrize("override, said", [("rollout.temperature=0.7",
                                             "rollout.temperature=0.9 recorded, rollout.temperature=0.7 asked"),
                                            ("rollout.top_p=0.5",
                                             "rollout.top_p=1.0 recorded, rollout.top_p=0.5 asked"),
                                            ("rollout.top_k=3", "rollout.top_k=0 recorded, rollout.top_k=3 asked")])
def test_replay_config_refuses_another_sampling_distribution(tmp_path, override, said):
    from stppo_agent.training.replay import replay_config

    with pytest.raises(ValueError, match=(f"^a replay scores the recorded tokens with the settings that "
                                          f"sampled them; {said}: drop that --set$")):
        replay_config(recorded_run(tmp_path), "grpo", "o", [override])


def test_replay_config_refuses_a_folder_without_a_complete_recording(tmp_path):
    from stppo_agent.training.replay import replay_config

    with pytest.raises(FileNotFoundError, match=r"^/.* is not a run folder \(/.*/config.yaml is missing\)$"):
        replay_config(tmp_path, None, "o")
    with pytest.raises(FileNotFoundError, match="^/.*/rollouts holds no recorded iteration$"):
        replay_config(recorded_run(tmp_path / "a", iterations=()), None, "o")
    with pytest.raises(ValueError, match=r"recorded iterations are not 1..N \(\[1, 3\]\.\.\.\); was the run resumed"):
        replay_config(recorded_run(tmp_path / "b", iterations=(1, 3)), None, "o")
    with pytest.raises(ValueError, match=(r"recorded iterations are not 1..N \(\[2, 3\]\.\.\.\); was the "
                                          r"run resumed from a checkpoint after deleting recordings\?$")):
        replay_config(recorded_run(tmp_path / "d", iterations=(2, 3)), None, "o")
    with pytest.raises(ValueError, match=r"not 1..N \(\[1, 2, 3, 4, 5\]\.\.\.\)"):
        replay_config(recorded_run(tmp_path / "f", iterations=(1, 2, 3, 4, 5, 7)), None, "o")
    torn = recorded_run(tmp_path / "e", worlds={2: 2})
    (torn / "rollouts" / "iter-000002.rank-1.safetensors").unlink()
    with pytest.raises(ValueError, match=("^/.*/rollouts: iteration 2 was recorded by 2 processes, but "
                                          "the share of rank-1 is missing; a replay would use part of "
                                          "its data$")):
        replay_config(torn, None, "o")


def test_the_rollout_correction_follows_the_data_into_another_rule(tmp_path):
    from stppo_agent.training.config import load_config
    from stppo_agent.training.replay import describe_correction, recorded_correction, replay_config

    vllm = recorded_run(tmp_path / "v", backend="vllm", algorithm={"rollout_correction": "tis",
                                                                    "rollout_correction_level": "token",
                                                                    "rollout_correction_cap": 3.0})
    original = load_config(vllm / "config.yaml")
    assert recorded_correction(original) == {"rollout_correction": "tis", "rollout_correction_cap": 3.0}
    st = replay_config(vllm, "st_ppo", "o").algorithm_config()
    assert (st.rollout_correction, st.rollout_correction_level, st.rollout_correction_cap) == ("tis", "turn", 3.0)
    by_hand = recorded_run(tmp_path / "h", backend="vllm", algorithm={"rollout_correction": "mis",
                                                                       "rollout_correction_level": "sequence"})
    assert recorded_correction(load_config(by_hand / "config.yaml")) == {
        "rollout_correction": "mis", "rollout_correction_cap": 2.0, "rollout_correction_level": "sequence"}
    grpo = replay_config(vllm, "grpo", "o")
    assert describe_correction(grpo, original, []) == (
        "rollout correction: tis at token level, cap 3, kept from the recorded run (its batches were sampled by "
        "vllm); --set algorithm.rollout_correction=none|tis|mis to change it")
    off = replay_config(vllm, "grpo", "o", ["algorithm.rollout_correction=none"])
    assert describe_correction(off, original, ["algorithm.rollout_correction=none"]) == (
        "rollout correction: none (set here; the recorded run used tis)")
    plain = recorded_run(tmp_path / "p")
    assert describe_correction(replay_config(plain, "grpo", "o"), load_config(plain / "config.yaml"), []).startswith(
        "rollout correction: none, kept from the recorded run (its batches were sampled by hf)")


def test_recorded_rollouts_serve_each_rank_its_share_of_every_iteration(tmp_path):
    from stppo_agent.models.tiny import word_tokenizer
    from stppo_agent.training.replay import RecordedRollouts

    run = recorded_run(tmp_path, worlds={1: 2, 2: 1})

    def source(rank, world):
        return RecordedRollouts(run, word_tokenizer(), rank, world)

    one = source(0, 1)
    assert one.iterations == [1, 2, 3] and one.state() == {} and one.load({"x": 1}) is None
    assert one.next_batch(0).group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]  # two shares merged, prompt order
    assert one.next_batch(1).rewards.tolist() == list(map(float, range(8)))
    for rank in (0, 1):
        assert source(rank, 2).next_batch(0).group_ids.tolist() == [rank, rank, rank + 2, rank + 2]  # as recorded
        assert source(rank, 2).next_batch(1).group_ids.tolist() == [rank, rank, rank + 2, rank + 2]  # r::world
    assert source(3, 4).next_batch(2).group_ids.tolist() == [3, 3]
    from stppo_agent.runs.recording import RolloutRecorder

    RolloutRecorder(run, word_tokenizer(), 0, 1).record(4, synthetic_batch(3))
    with pytest.raises(ValueError, match="iteration 4 holds 3 prompts, which 2 processes cannot share evenly"):
        source(1, 2).next_batch(3)
    assert source(0, 1).next_batch(3).group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match=("^recorded iteration 3 holds 4 prompts, which 3 processes "
                                          "cannot share evenly: replay it with a number of processes "
                                          "that divides that$")):
        source(0, 3).next_batch(2)
    with pytest.raises(ValueError, match=(r"^tokenizer mismatch: the model's tokenizer differs from the "
                                          r"one that recorded /.* \(vocab_sha256, vocab_size\); recorded "
                                          r"token ids would mean other text$")):
        RecordedRollouts(run, word_tokenizer(["other", "words"]))


def test_replay_builds_the_trainer_on_the_recording_and_writes_replay_json(tmp_path, monkeypatch):
    import stppo_agent.training.trainer as trainer_module
    from stppo_agent.models.tiny import word_tokenizer
    from stppo_agent.rollouts.vllm_generation import VLLMGenerationBackend
    from stppo_agent.training.live_rollouts import RolloutContext
    from stppo_agent.training.replay import RecordedRollouts, replay

    run = recorded_run(tmp_path, backend="vllm", algorithm={"rollout_correction": "tis"})
    built = []

    class FakeTrainer:
        def __init__(self, config, report, rollout_source, resume, overwrite):
            self.config, self.report, self.rollout_source = config, report, rollout_source
            self.intent = (resume, overwrite)
            self.algo = config.algorithm_config()
            Path(config.output_dir).mkdir(parents=True)
            built.append(self)

        def train(self):
            return {"done": self.config.iterations}

    monkeypatch.setattr(trainer_module, "Trainer", FakeTrainer)
    messages = []
    out = tmp_path / "out"
    assert replay(run, "grpo", str(out), iterations=2, report=messages.append) == {"done": 2}
    trainer = built[0]
    assert trainer.config.algo == "grpo" and trainer.report == messages.append
    assert trainer.intent == (False, False)  # a folder holding a run is refused unless --resume or --overwrite
    engine = VLLMGenerationBackend.__new__(VLLMGenerationBackend)
    source = trainer.rollout_source(RolloutContext(trainer.config, trainer.algo, out, word_tokenizer(), engine, 1, 2))
    assert isinstance(source, RecordedRollouts) and source.folder == run / "rollouts"
    assert (source.rank, source.world, source.env_kwargs) == (1, 2, None)
    assert source.sampled_by_actor is False  # another rule than the recorded one
    written = {"replay_of": str(run.resolve()), "recorded_algo": "ppo", "algo": "grpo", "iterations": 2,
               "rollout_correction": "tis"}
    assert (out / "replay.json").read_text() == json.dumps(written, indent=1) + "\n"
    assert messages == ["rollout correction: tis at token level, cap 2, kept from the recorded run (its batches were "
                        "sampled by vllm); --set algorithm.rollout_correction=none|tis|mis to change it"]
    with pytest.raises(ValueError, match="^the replay's --output-dir must differ from the recorded run's folder$"):
        replay(run, None, str(run))
    assert len(built) == 1


def test_a_gpu_runs_cuda_random_state_is_saved_and_put_back(tmp_path, monkeypatch):
    streams = [torch.tensor([1, 2, 3], dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: streams)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    saved, config = run = fake_run(tmp_path)
    assert saved.states(config, config.algorithm_config())[0]["cuda_rng"] == streams
    folder = checkpoint_of(run, tmp_path / "run")
    resume(fake_run(tmp_path), folder)
    assert len(restored) == 1 and restored[0][0].tolist() == [1, 2, 3]


def test_with_two_processes_the_checkpoint_holds_rank_1s_streams_and_rank_1_resumes_them_silently(tmp_path,
                                                                                                   monkeypatch):
    import random

    from stppo_agent.distributed import process_group

    monkeypatch.setattr(process_group, "world_size", lambda: 2)
    monkeypatch.setattr(process_group, "all_gather_objects", lambda local: [local, local])
    saved, config = run = fake_run(tmp_path)
    random.seed(5)
    tensors, state = saved.states(config, config.algorithm_config())
    assert len(tensors["rank_rng"]) == 2 and len(state["rank_rng"]) == 2
    folder = checkpoint_of(run, tmp_path / "run")
    expected = random.random()
    monkeypatch.setattr(process_group, "rank", lambda: 1)
    fresh, _ = again = fake_run(tmp_path)
    random.seed(0)
    messages = resume(again, folder)
    assert random.random() == expected and fresh.iteration == 6
    assert messages == []  # rank 0 says what was resumed


def test_resume_itself_refuses_turning_recording_on_mid_run(tmp_path):
    folder = checkpoint_of(fake_run(tmp_path), tmp_path / "run")
    with pytest.raises(ValueError, match="cannot change logging.save_rollouts .*iterations 1..6"):
        resume(fake_run(tmp_path, logging=dict(save_rollouts=True)), folder)


def test_a_newer_checkpoint_is_written_even_when_an_older_ones_optimizer_file_already_vanished(tmp_path):
    newest = {"checkpoint": {"optimizer": "newest"}}
    older = save(tmp_path, 1, config=newest)
    (older / ck.OPTIMIZER_FILE).unlink()  # still listed: the drop only has the manifest entry left to remove
    save(tmp_path, 2, config=newest)
    assert ck.OPTIMIZER_FILE not in manifest(older) and ck.valid_checkpoints(tmp_path) == [1, 2]


def without_recorded_scale(folder: Path) -> None:
    state = json.loads((folder / "trainer_state.json").read_text())
    del state["actor_lr_scale"]
    (folder / "trainer_state.json").write_text(json.dumps(state))
    (folder / "manifest.json").unlink()
    ck._write_manifest(folder)


def test_an_old_checkpoints_scale_is_measured_against_its_own_actor_lr_not_the_new_one(tmp_path):
    folder = checkpoint_of(fake_run(tmp_path), tmp_path / "run")  # actor_lr 0.01, schedule at 0.0025
    without_recorded_scale(folder)
    fresh, _ = again = fake_run(tmp_path, optimizer=dict(actor_lr=0.02))
    messages = resume(again, folder)
    assert fresh.actor_lr_scale == 1.0
    assert messages[2] == ("optimizer.actor_lr 0.02 is the rate used from now on (the rollbacks' x0.25 applied to "
                           "the old one)")


def test_a_frozen_actor_without_a_recorded_scale_resumes_at_scale_1(tmp_path):
    folder = checkpoint_of(fake_run(tmp_path, optimizer=dict(actor_lr=0.0)), tmp_path / "run")
    without_recorded_scale(folder)
    fresh, _ = again = fake_run(tmp_path, optimizer=dict(actor_lr=0.0))
    messages = resume(again, folder)
    assert fresh.actor_lr_scale == 1.0 and len(messages) == 1


def test_a_new_actor_lr_without_rollbacks_is_only_listed_as_a_change(tmp_path):
    saved, _ = run = fake_run(tmp_path)
    saved.actor_lr_scale = 1.0
    folder = checkpoint_of(run, tmp_path / "run")
    messages = resume(fake_run(tmp_path, optimizer=dict(actor_lr=0.5)), folder)
    assert messages[1:] == ["changed since the checkpoint: optimizer.actor_lr 0.01 -> 0.5"]


class Smuggled:
    """Anything but tensors and plain containers: a checkpoint that holds it must not be unpickled."""


def test_a_checkpoint_holding_a_pickled_object_is_refused_not_unpickled(tmp_path):
    import pickle

    folder = save(tmp_path, 1)
    torch.save({"torch_rng": Smuggled()}, folder / "trainer_state.pt")
    (folder / "manifest.json").unlink()
    ck._write_manifest(folder)  # a manifest that vouches for it: only weights_only stands in the way
    with pytest.raises(pickle.UnpicklingError):
        ck.load_trainer_state(folder)
    folder = save(tmp_path, 2)
    torch.save({"actor_optimizer": Smuggled()}, folder / ck.OPTIMIZER_FILE)
    (folder / "manifest.json").unlink()
    ck._write_manifest(folder)
    with pytest.raises(pickle.UnpicklingError):
        ck.load_trainer_state(folder)


def test_a_gpu_checkpoint_resumes_on_a_machine_without_cuda(tmp_path, monkeypatch):
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.zeros(2, dtype=torch.uint8)])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    saved, config = run = fake_run(tmp_path)
    assert "cuda_rng" in saved.states(config, config.algorithm_config())[0]
    folder = checkpoint_of(run, tmp_path / "run")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fresh, _ = again = fake_run(tmp_path)
    resume(again, folder)
    assert restored == [] and fresh.iteration == 6


def test_rank_1_of_a_checkpoint_written_by_one_process_starts_a_fresh_stream_and_says_so(tmp_path, monkeypatch):
    from stppo_agent.distributed import process_group

    folder = checkpoint_of(fake_run(tmp_path), tmp_path / "run")
    monkeypatch.setattr(process_group, "rank", lambda: 1)
    monkeypatch.setattr(process_group, "seed_everything", lambda seed: None)
    messages = resume(fake_run(tmp_path), folder)
    assert len(messages) == 1 and messages[0].startswith(
        "rank 1: the checkpoint holds no random state for this rank (written by 1 process(es))")


def test_every_changed_sampling_setting_is_named(tmp_path):
    from stppo_agent.training.replay import replay_config

    with pytest.raises(ValueError, match="; rollout.temperature=0.9, rollout.top_p=1.0 recorded, "
                                         "rollout.temperature=0.7, rollout.top_p=0.5 asked: "):
        replay_config(recorded_run(tmp_path), "grpo", "o", ["rollout.temperature=0.7", "rollout.top_p=0.5"])
