"""``stppo_agent.runs.checkpoint``: the manifest a checkpoint is verified against, the
damage it refuses, optimizer state in its own file, pruning and what it protects, atomic writes. Fake models that
save a small state dict keep every test in milliseconds."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from stppo_agent.monitoring import collapse_guard as guard_module
from stppo_agent.runs import checkpoint as ck
from stppo_agent.runs.checkpoint import load_full_model_state
from tests.support.checkpoints import FakeModel, FakeTokenizer, manifest, save

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


def test_load_full_model_state_copies_every_tensor_plain_or_sharded(tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    source, target = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    load_full_model_state(target, source.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(target.state_dict().values(), source.state_dict().values()))
    # a model sharded by FSDP2 (one gloo rank, in this process) takes the whole, unsharded checkpoint state
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sharded = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
        whole = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
        fully_shard(sharded)
        load_full_model_state(sharded, whole.state_dict())
        assert all(torch.equal(a.full_tensor(), b)
                   for a, b in zip(sharded.state_dict().values(), whole.state_dict().values()))
    finally:
        if owned:
            dist.destroy_process_group()
    assert guard_module.CollapseStopped.__mro__[1] is RuntimeError
