"""``stppo_agent.runs.recording``: recorded rollouts -- tensors, metadata, transcripts,
every rank's share -- and what a resume drops."""

from __future__ import annotations

import json

import pytest
import torch

from stppo_agent.runs.recording import drop_recordings_after, recorded_iterations


# -- recording -----------------------------------------------------------------------------------------------------
def tokenizer():
    from stppo_agent.models.tiny import word_tokenizer

    return word_tokenizer()  # <pad>=0 <eos>=1 <unk>=2 say=3 ok=4 red=5 green=6 blue=7 gold=8


def multi_turn_batch(rows=(0, 1, 2), info=True):
    """Three trajectories: P = 3 (left-padded), T = 5. Row 0: policy turn 0, an observation, policy turn 1; row 1:
    two policy turns back to back; row 2: an observation first."""
    from stppo_agent.rollouts.batch import RolloutBatch

    prompt_ids = [[0, 3, 4], [3, 3, 4], [0, 0, 4]]
    prompt_mask = [[0, 1, 1], [1, 1, 1], [0, 0, 1]]
    response = [[5, 6, 7, 8, 0], [5, 6, 7, 0, 0], [8, 5, 0, 0, 0]]
    response_mask = [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    policy = [[1, 1, 0, 1, 0], [1, 1, 1, 0, 0], [0, 1, 0, 0, 0]]
    turns = [[0, 0, -1, 1, -1], [0, 1, 1, -1, -1], [-1, 2, -1, -1, -1]]
    infos = [{"example_id": f"e{r}", "benchmark": "nq", "question": f"¿q{r}?", "finish_reason": "answer",
              "extra": r} for r in range(3)]
    pick = list(rows)
    return RolloutBatch(
        input_ids=torch.tensor([prompt_ids[r] + response[r] for r in pick]),
        attention_mask=torch.tensor([prompt_mask[r] + response_mask[r] for r in pick]), prompt_width=3,
        response_ids=torch.tensor([response[r] for r in pick]),
        loss_mask=torch.tensor([policy[r] for r in pick], dtype=torch.bool),
        turn_ids=torch.tensor([turns[r] for r in pick]),
        sample_logprobs=torch.tensor([[-0.5 * r - 0.1 * t for t in range(5)] for r in pick]),
        rewards=torch.tensor([1.0, 0.0, 0.5])[pick], group_ids=torch.tensor([0, 0, 1])[pick],
        terminated=torch.tensor([True, False, True])[pick], truncated=torch.tensor([False, True, False])[pick],
        stats={"turns": 2.0, "reward": 0.5}, episode_info=[infos[r] for r in pick] if info else None)


TRANSCRIPTS = [
    {"benchmark": "nq", "example_id": "e0", "extra": 0, "finish_reason": "answer", "group_id": 0, "question": "¿q0?",
     "reward": 1.0, "row": 0, "transcript": [["prompt", -1, "say ok"], ["policy", 0, "red green"],
                                             ["observation", -1, "blue"], ["policy", 1, "gold"]]},
    {"benchmark": "nq", "example_id": "e1", "extra": 1, "finish_reason": "answer", "group_id": 0, "question": "¿q1?",
     "reward": 0.0, "row": 1, "transcript": [["prompt", -1, "say say ok"], ["policy", 0, "red"],
                                             ["policy", 1, "green blue"]]},
    {"benchmark": "nq", "example_id": "e2", "extra": 2, "finish_reason": "answer", "group_id": 1, "question": "¿q2?",
     "reward": 0.5, "row": 2, "transcript": [["prompt", -1, "ok"], ["observation", -1, "gold"], ["policy", 2, "red"]]},
]


def test_recording_tokenizer_fingerprint_and_file_names(tmp_path):
    from stppo_agent.models.tiny import word_tokenizer
    from stppo_agent.runs.recording import batch_file, tokenizer_fingerprint

    assert tokenizer_fingerprint(tokenizer()) == {
        "vocab_size": 9, "vocab_sha256": "dc91fd2e5b141273d5ed4603ec37c9863025089e39661b1a2a72e91443c648c5",
        "pad_token_id": 0, "eos_token_id": 1}
    assert tokenizer_fingerprint(word_tokenizer(["é", "a"]))["vocab_sha256"] == (
        "e7008b73e12d328c8abf6f5be7e5726f5fae90c405bba2054edf0a22ef5ea72e")  # the vocabulary as UTF-8, not \\u escapes
    assert batch_file(tmp_path, 7, 2, "jsonl") == tmp_path / "iter-000007.rank-2.jsonl"
    assert batch_file(tmp_path, 1234567, 0, "safetensors").name == "iter-1234567.rank-0.safetensors"


def test_recording_format_json_is_written_by_rank_zero_only(tmp_path):
    from stppo_agent.runs.recording import FORMAT_NAME, FORMAT_VERSION, RolloutRecorder, read_format

    assert (FORMAT_NAME, FORMAT_VERSION) == ("stppo-rollouts", 2)
    other = RolloutRecorder(tmp_path / "r1", tokenizer(), 1, 2)
    assert other.folder == tmp_path / "r1" / "rollouts" and other.folder.is_dir()
    assert list(other.folder.iterdir()) == []
    recorder = RolloutRecorder(tmp_path / "run", tokenizer(), 0, 2)
    assert (recorder.rank, recorder.world) == (0, 2)
    text = (tmp_path / "run" / "rollouts" / "format.json").read_text()
    assert text == json.dumps({"format": "stppo-rollouts", "version": 2, "tokenizer": {
        "vocab_size": 9, "vocab_sha256": "dc91fd2e5b141273d5ed4603ec37c9863025089e39661b1a2a72e91443c648c5",
        "pad_token_id": 0, "eos_token_id": 1}}, indent=1) + "\n"
    assert sorted(p.name for p in recorder.folder.iterdir()) == ["format.json"]
    assert read_format(recorder.folder)["version"] == 2


def test_recording_read_format_refuses_a_missing_or_foreign_format(tmp_path):
    from stppo_agent.runs.recording import read_format

    folder = tmp_path / "run" / "rollouts"
    folder.mkdir(parents=True)
    with pytest.raises(FileNotFoundError) as caught:
        read_format(folder)
    assert str(caught.value) == (f"{tmp_path / 'run'} has no recorded rollouts ({folder / 'format.json'} is missing): "
                                 "train it with --set logging.save_rollouts=true to record them")
    for meta, shown in (({"format": "other", "version": 2}, "'other' v2"), ({"format": "stppo-rollouts", "version": 3},
                                                                             "'stppo-rollouts' v3"),
                        ({"version": 0}, "None v0"), ({"format": "stppo-rollouts"}, "'stppo-rollouts' vNone")):
        (folder / "format.json").write_text(json.dumps(meta))
        with pytest.raises(ValueError) as caught:
            read_format(folder)
        assert str(caught.value) == (f"{folder / 'format.json'}: unsupported rollout format {shown} (this stppo reads "
                                     "stppo-rollouts v1, v2)")
    for version in (1, 2):
        (folder / "format.json").write_text(json.dumps({"format": "stppo-rollouts", "version": version, "x": 1}))
        assert read_format(folder) == {"format": "stppo-rollouts", "version": version, "x": 1}


def test_recording_record_writes_the_tensors_metadata_and_transcripts(tmp_path):
    from safetensors import safe_open

    from stppo_agent.runs.recording import TENSOR_FIELDS, RolloutRecorder, load_batch

    assert TENSOR_FIELDS == ("input_ids", "attention_mask", "response_ids", "loss_mask", "turn_ids",
                             "sample_logprobs", "rewards", "group_ids", "terminated", "truncated")
    batch = multi_turn_batch()
    recorder = RolloutRecorder(tmp_path, tokenizer(), 0, 1)
    recorder.record(2, batch)
    folder = tmp_path / "rollouts"
    assert sorted(p.name for p in folder.iterdir()) == ["format.json", "iter-000002.rank-0.jsonl",
                                                        "iter-000002.rank-0.safetensors"]
    with safe_open(str(folder / "iter-000002.rank-0.safetensors"), framework="pt") as handle:
        assert handle.metadata() == {"prompt_width": "3", "iteration": "2", "stats": '{"reward": 0.5, "turns": 2.0}',
                                     "rank": "0", "world_size": "1"}
        assert sorted(handle.keys()) == sorted(TENSOR_FIELDS)
        for name in TENSOR_FIELDS:
            assert torch.equal(handle.get_tensor(name), getattr(batch, name)), name
    lines = (folder / "iter-000002.rank-0.jsonl").read_text(encoding="utf-8")
    assert lines == "".join(json.dumps(t, ensure_ascii=False, sort_keys=True) + "\n" for t in TRANSCRIPTS)
    assert "¿q0?" in lines
    loaded = load_batch(folder, 2, 0)
    assert loaded.prompt_width == 3 and loaded.stats == {"reward": 0.5, "turns": 2.0}
    for name in TENSOR_FIELDS:
        assert torch.equal(getattr(loaded, name), getattr(batch, name)), name
    assert loaded.episode_info == [{"example_id": f"e{r}", "benchmark": "nq", "question": f"¿q{r}?",
                                    "finish_reason": "answer"} for r in range(3)]
    RolloutRecorder(tmp_path, tokenizer(), 1, 2).record(5, multi_turn_batch(info=False))
    plain = [json.loads(line) for line in (folder / "iter-000005.rank-1.jsonl").read_text().splitlines()]
    assert plain == [{k: v for k, v in t.items() if k in ("row", "group_id", "reward", "transcript")}
                     for t in TRANSCRIPTS]
    with safe_open(str(folder / "iter-000005.rank-1.safetensors"), framework="pt") as handle:
        assert (handle.metadata()["rank"], handle.metadata()["world_size"]) == ("1", "2")
    assert load_batch(folder, 5, 1).episode_info == [{}, {}, {}]  # no info: empty records, not None
    (folder / "iter-000005.rank-1.jsonl").unlink()
    assert load_batch(folder, 5, 1).episode_info is None
    from safetensors.torch import save_file

    save_file({name: getattr(batch, name) for name in TENSOR_FIELDS}, str(folder / "iter-000006.rank-0.safetensors"),
              metadata={"prompt_width": "3"})
    assert load_batch(folder, 6, 0).stats == {}  # written without statistics
    assert not list(folder.glob("*.tmp"))


def test_recording_rank_zero_removes_the_shares_of_ranks_this_run_lacks(tmp_path):
    from stppo_agent.runs.recording import RolloutRecorder

    folder = tmp_path / "rollouts"
    folder.mkdir()
    stale = ["iter-000003.rank-1.safetensors", "iter-000003.rank-1.jsonl", "iter-000003.rank-2.safetensors",
             "iter-000003.rank-3.jsonl", "iter-000004.rank-2.safetensors", "iter-000003.rank-x.jsonl",
             "iter-000003.rank-9"]
    for name in stale:
        (folder / name).write_text("old")
    RolloutRecorder(tmp_path, tokenizer(), 1, 2).record(3, multi_turn_batch([2]))  # rank 1 removes nothing
    assert all((folder / name).exists() for name in stale)
    RolloutRecorder(tmp_path, tokenizer(), 0, 2).record(3, multi_turn_batch([0, 1]))
    assert sorted(p.name for p in folder.glob("iter-*")) == sorted(
        ["iter-000003.rank-0.jsonl", "iter-000003.rank-0.safetensors", "iter-000003.rank-1.jsonl",
         "iter-000003.rank-1.safetensors", "iter-000004.rank-2.safetensors", "iter-000003.rank-x.jsonl",
         "iter-000003.rank-9"])
    assert (folder / "iter-000003.rank-1.jsonl").read_text() != "old"  # rank 1's own share, kept
    RolloutRecorder(tmp_path, tokenizer(), 0, 1).record(3, multi_turn_batch())
    assert sorted(p.name for p in folder.glob("iter-000003.*")) == [
        "iter-000003.rank-0.jsonl", "iter-000003.rank-0.safetensors", "iter-000003.rank-9", "iter-000003.rank-x.jsonl"]


def test_recording_world_size_of_an_iteration_and_missing_shares(tmp_path):
    from safetensors.torch import save_file

    from stppo_agent.runs.recording import (
        RolloutRecorder,
        check_iteration_files,
        recorded_iterations,
        recorded_world_size,
    )

    folder = tmp_path / "rollouts"
    for rank in (0, 1, 2):
        RolloutRecorder(tmp_path, tokenizer(), rank, 4).record(1, multi_turn_batch([rank]))
    assert recorded_world_size(folder, 1) == 4
    with pytest.raises(ValueError) as caught:
        check_iteration_files(folder, 1)
    assert str(caught.value) == (f"{folder}: iteration 1 was recorded by 4 processes, but the share of rank-3 is "
                                 "missing; a replay would use part of its data")
    (folder / "iter-000001.rank-1.safetensors").unlink()
    with pytest.raises(ValueError, match=r"but the share of rank-1, rank-3 is missing;"):
        check_iteration_files(folder, 1)
    with pytest.raises(FileNotFoundError) as caught:
        recorded_world_size(folder, 9)
    assert str(caught.value) == f"{folder / 'iter-000009.rank-0.safetensors'} is missing: iteration 9 was not recorded"
    with pytest.raises(FileNotFoundError, match="iteration 9 was not recorded"):
        check_iteration_files(folder, 9)
    # version 1: no world_size in the metadata; the world is the run of rank files from 0
    for rank in (0, 1, 3):
        save_file({"x": torch.zeros(1)}, str(folder / f"iter-000002.rank-{rank}.safetensors"),
                  metadata={"prompt_width": "1"})
    (folder / "iter-000002.rank-2.jsonl").write_text("")
    (folder / "iter-000002.rank-x.safetensors").write_text("")
    assert recorded_world_size(folder, 2) == 2 and check_iteration_files(folder, 2) == 2
    save_file({"x": torch.zeros(1)}, str(folder / "iter-000005.rank-0.safetensors"))  # no metadata at all
    assert recorded_world_size(folder, 5) == 1
    RolloutRecorder(tmp_path, tokenizer(), 0, 1).record(3, multi_turn_batch())
    assert check_iteration_files(folder, 3) == 1
    (folder / "iter-abc.rank-0.safetensors").write_text("")
    (folder / "iter-000007.rank-0.jsonl").write_text("")
    assert recorded_iterations(folder, 0) == [1, 2, 3, 5]
    assert recorded_iterations(folder, 1) == [2] and recorded_iterations(folder, 3) == [2]
    assert recorded_iterations(folder, 6) == []


def test_recording_load_iteration_merges_every_ranks_share_in_prompt_order(tmp_path):
    from stppo_agent.rollouts.batch import RolloutBatch
    from stppo_agent.runs.recording import RolloutRecorder, load_batch, load_iteration

    folder = tmp_path / "rollouts"
    RolloutRecorder(tmp_path, tokenizer(), 0, 1).record(1, multi_turn_batch())
    one = load_iteration(folder, 1, pad_id=0)
    assert one.group_ids.tolist() == [0, 0, 1] and one.stats == {"reward": 0.5, "turns": 2.0}
    assert one.episode_info[0]["example_id"] == "e0"

    whole = multi_turn_batch()
    first = whole.select([2])  # group 1
    first.stats = {"reward": 0.5, "turns": 1.0}
    second = whole.select([0, 1])  # group 0, with a narrower prompt
    second = RolloutBatch(**{**{f: getattr(second, f) for f in second.__dataclass_fields__},
                             "input_ids": second.input_ids[:, 1:], "attention_mask": second.attention_mask[:, 1:],
                             "prompt_width": 2, "stats": {"reward": 0.5, "turns": 4.0}})
    RolloutRecorder(tmp_path, tokenizer(), 0, 2).record(2, first)
    RolloutRecorder(tmp_path, tokenizer(), 1, 2).record(2, second)
    merged = load_iteration(folder, 2, pad_id=9)
    assert merged.group_ids.tolist() == [0, 0, 1] and merged.rewards.tolist() == [1.0, 0.0, 0.5]
    assert merged.prompt_width == 3
    assert merged.input_ids.tolist() == [[9, 3, 4, 5, 6, 7, 8, 0], [9, 3, 4, 5, 6, 7, 0, 0],
                                         [0, 0, 4, 8, 5, 0, 0, 0]]
    assert merged.stats == {"reward": pytest.approx(0.5), "turns": pytest.approx(3.0)}  # (1 * 1 + 4 * 2) / 3
    assert [info["example_id"] for info in merged.episode_info] == ["e0", "e1", "e2"]
    (folder / "iter-000002.rank-1.jsonl").unlink()
    assert load_iteration(folder, 2, pad_id=9).episode_info is None  # kept only where every share has it
    assert load_batch(folder, 2, 0).episode_info is not None
    (folder / "iter-000002.rank-1.safetensors").unlink()
    with pytest.raises(ValueError, match="share of rank-1 is missing"):
        load_iteration(folder, 2, pad_id=9)
    with pytest.raises(FileNotFoundError) as caught:
        load_batch(folder, 2, 1)
    assert str(caught.value) == f"{folder / 'iter-000002.rank-1.safetensors'} is missing: iteration 2 was not recorded"


def test_recording_initial_weights_from_the_trainer_at_iteration_zero_only(tmp_path, monkeypatch):
    from stppo_agent.models import loading
    from stppo_agent.runs.recording import RolloutRecorder

    saved = []

    def save_policy(folder, actor, tok, critic, actor_state, critic_state):
        assert tok is words
        saved.append((folder.name, actor, critic, actor_state, critic_state))
        (folder / "actor").mkdir(parents=True)
        (folder / "actor" / "w").write_text(actor)

    words = tokenizer()
    monkeypatch.setattr(loading, "save_policy", save_policy)
    calls = []
    monkeypatch.setattr(RolloutRecorder, "save_initial", lambda self, *args: calls.append((self.rank, *args)))

    def recorder_at(iteration, critic_model, rank=0):
        return RolloutRecorder.for_run(tmp_path / "run", tokenizer(), rank, 2, iteration=iteration, actor="A",
                                       critic="C", critic_model=critic_model, full_states=lambda: ("AS", "CS"))

    recorder = recorder_at(0, None)
    assert (recorder.folder, recorder.rank, recorder.world) == (tmp_path / "run" / "rollouts", 0, 2)
    assert calls == [(0, "A", None, "AS", None)]  # a critic built from the actor is rebuilt on replay
    recorder_at(0, "critic-path", rank=1)
    assert calls[-1] == (1, "A", "C", "AS", "CS")
    recorder_at(3, "critic-path")
    assert len(calls) == 2  # a resumed run's initial weights are already recorded
    monkeypatch.undo()
    monkeypatch.setattr(loading, "save_policy", save_policy)

    folder = tmp_path / "run" / "rollouts"
    RolloutRecorder(tmp_path / "run", words, 1, 2).save_initial("A1", None)
    assert saved == [] and not (folder / "initial").exists()
    RolloutRecorder(tmp_path / "first", words, 0, 1).save_initial("A0", None)  # nothing to replace yet
    assert (tmp_path / "first" / "rollouts" / "initial" / "actor" / "w").read_text() == "A0"
    saved.clear()
    (folder / ".initial.tmp" / "junk").mkdir(parents=True)  # left by an interrupted save
    (folder / "initial" / "old").mkdir(parents=True)
    RolloutRecorder(tmp_path / "run", words, 0, 2).save_initial("A2", "C2", {"a": 1}, {"c": 1})
    assert saved == [(".initial.tmp", "A2", "C2", {"a": 1}, {"c": 1})]
    assert sorted(p.name for p in (folder / "initial").iterdir()) == ["actor"]
    assert (folder / "initial" / "actor" / "w").read_text() == "A2" and not (folder / ".initial.tmp").exists()
    RolloutRecorder(tmp_path / "run", words, 0, 2).save_initial("A3", None)
    assert saved[-1] == (".initial.tmp", "A3", None, None, None)
    assert (folder / "initial" / "actor" / "w").read_text() == "A3"


def test_recording_transcripts_keep_special_tokens_and_an_empty_response(tmp_path):
    from stppo_agent.rollouts.batch import RolloutBatch
    from stppo_agent.runs.recording import RolloutRecorder

    batch = RolloutBatch(
        input_ids=torch.tensor([[1, 3, 5, 6, 1], [0, 3, 0, 0, 0]]),
        attention_mask=torch.tensor([[1, 1, 1, 1, 1], [0, 1, 0, 0, 0]]), prompt_width=2,
        response_ids=torch.tensor([[5, 6, 1], [0, 0, 0]]), loss_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]).bool(),
        turn_ids=torch.tensor([[0, 0, 0], [-1, -1, -1]]), sample_logprobs=torch.zeros(2, 3),
        rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 0]), terminated=torch.tensor([True, False]),
        truncated=torch.tensor([False, True]), stats={})
    RolloutRecorder(tmp_path, tokenizer(), 0, 1).record(1, batch)
    records = [json.loads(line) for line in (tmp_path / "rollouts" / "iter-000001.rank-0.jsonl").read_text()
               .splitlines()]
    assert [r["transcript"] for r in records] == [
        [["prompt", -1, "<eos> say"], ["policy", 0, "red green <eos>"]],  # special tokens kept as sampled
        [["prompt", -1, "say"]]]  # nothing sampled: no response segment


# A resume drops the recorded iterations its checkpoint did not train on.


# -- a resumed run's recording holds its own iterations only ------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer

    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", word_tokenizer())


@pytest.mark.parametrize("still_recording", [True, False])
def test_resume_drops_the_recorded_iterations_the_checkpoint_did_not_train_on(tiny_model, tmp_path, still_recording):
    """Killed after recording iterations 3 and 4 but before checkpoint step-4, then resumed from step-2 for
    iterations=3: the recording of iteration 4 came from the dead run, and a replay (which replays every recorded
    iteration) trained on a batch this run never saw."""
    import shutil

    from stppo_agent.runs.recording import recorded_iterations
    from stppo_agent.training.replay import replay_config
    from stppo_agent.training.trainer import Trainer
    from tests.support.runs import toy_config

    small = dict(rollout=dict(prompts_per_iteration=2, samples_per_prompt=2),
                 optimizer=dict(mini_batch_size=4, micro_batch_size=4, epochs=1), checkpoint=dict(every=2, keep=3),
                 logging=dict(save_rollouts=True), monitor=dict(on_collapse="none"))
    Trainer(toy_config(tiny_model, tmp_path, "grpo", iterations=4, **small)).train()
    shutil.rmtree(tmp_path / "checkpoints" / "step-4")  # the kill came before iteration 4's checkpoint
    assert recorded_iterations(tmp_path / "rollouts", 0) == [1, 2, 3, 4]
    resumed = toy_config(tiny_model, tmp_path, "grpo", iterations=3,
                         **dict(small, logging=dict(save_rollouts=still_recording)))
    Trainer(resumed, resume=True, report=lambda _: None).train()
    kept = [1, 2, 3] if still_recording else [1, 2]  # not recording: the dead run's iteration 3 goes too
    assert recorded_iterations(tmp_path / "rollouts", 0) == kept
    assert not list((tmp_path / "rollouts").glob("iter-000004.*"))
    assert replay_config(tmp_path, None, str(tmp_path / "replay")).iterations == len(kept)


def test_a_resume_drops_every_ranks_files_of_later_iterations_only(tmp_path):
    rollouts = tmp_path / "rollouts"
    rollouts.mkdir()
    kept = ["iter-000001.rank-0.safetensors", "iter-000002.rank-0.safetensors", "iter-000002.rank-1.json",
            "iter-latest.rank-0.safetensors", "format.json", "initial.safetensors"]
    dropped = ["iter-000003.rank-0.safetensors", "iter-000003.rank-1.json", "iter-000010.rank-2.transcripts.jsonl"]
    for name in kept + dropped:
        (rollouts / name).write_text("x")
    (tmp_path / "iter-000005.rank-0.safetensors").write_text("x")  # not in rollouts/: not a recording
    drop_recordings_after(tmp_path, 2)  # the boundary: iteration 2 is the checkpoint's, kept
    assert sorted(p.name for p in rollouts.iterdir()) == sorted(kept)
    assert (tmp_path / "iter-000005.rank-0.safetensors").exists()
    assert recorded_iterations(rollouts, 0) == [1, 2]


def test_dropping_from_a_run_that_never_recorded_is_a_no_op(tmp_path):
    drop_recordings_after(tmp_path, 0)
    assert list(tmp_path.iterdir()) == []


def test_a_file_gone_between_listing_and_removal_is_no_error(tmp_path, monkeypatch):
    from pathlib import Path

    (tmp_path / "rollouts").mkdir()
    vanished = tmp_path / "rollouts" / "iter-000004.rank-0.safetensors"  # listed, then removed by someone else
    monkeypatch.setattr(Path, "glob", lambda self, pattern: iter([vanished]))
    drop_recordings_after(tmp_path, 1)
    assert not vanished.exists()
