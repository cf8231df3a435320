"""Recorded rollouts (``logging.save_rollouts=true``): every iteration's batch, as sampled, for ``stppo replay``.

Layout under the run folder (no pickle anywhere)::

    rollouts/
      format.json                      format name and version, the tokenizer's fingerprint
      initial/actor/                   the actor before the first update (Hugging Face folder)
      initial/critic/                  the critic before the first update, when the run had its own
                                       critic_model (otherwise a replay rebuilds it as the run did: the
                                       initial actor with a new zero value head)
      iter-000001.rank-0.safetensors   the batch of iteration 1 as rank 0 sampled it (tensors below)
      iter-000001.rank-0.jsonl         one line per trajectory: row, group_id, reward, example_id, benchmark,
                                       question, finish_reason and its transcript [[role, turn, text], ...]

Tensors (B trajectories, P prompt width, T response width): ``input_ids`` and ``attention_mask`` (B, P + T),
left-padded prompt then right-padded response; ``response_ids``, ``loss_mask`` (bool), ``turn_ids`` (-1 off the
policy tokens) and ``sample_logprobs`` (behaviour log-probs at sampling time) (B, T); ``rewards``,
``group_ids``, ``terminated``, ``truncated`` (B,). The safetensors metadata holds ``prompt_width``, the batch's
rollout statistics (``stats``, JSON), ``rank`` and ``world_size``: how many processes recorded that iteration, each
its share (prompts ``rank::world_size``). A run resumed with another process count records its later iterations
with the new count, so the count is per iteration; :func:`load_iteration` reads every rank's share of one. Each
file is written to a temporary name and renamed into place; rank 0 removes an iteration's files of ranks the
current run does not have (left by an earlier attempt with more processes).

Version 1 (before per-iteration world sizes) is read too: an iteration's world size is then the number of its
rank files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

FORMAT_NAME = "stppo-rollouts"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
TENSOR_FIELDS = ("input_ids", "attention_mask", "response_ids", "loss_mask", "turn_ids", "sample_logprobs",
                 "rewards", "group_ids", "terminated", "truncated")


def tokenizer_fingerprint(tokenizer) -> dict[str, Any]:
    """What must match for recorded token ids to mean the same text: the vocabulary and the special ids."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode()
    return {"vocab_size": len(tokenizer), "vocab_sha256": hashlib.sha256(vocab).hexdigest(),
            "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}


def drop_recordings_after(run_dir: Path, iteration: int) -> None:
    """On resume (recording or not): remove every rank's recordings of iterations after ``iteration``, as the
    metrics are cut back. They come from the run that died after the checkpoint; a replay takes every recorded
    iteration, so one the resumed run does not redo (it stops earlier, or no longer records) was trained on though
    this run never saw it."""
    for path in (Path(run_dir) / "rollouts").glob("iter-*.rank-*"):
        number = _iteration_of(path)
        if number is not None and number > iteration:
            path.unlink(missing_ok=True)


def batch_file(folder: Path, iteration: int, rank: int, suffix: str) -> Path:
    return folder / f"iter-{iteration:06d}.rank-{rank}.{suffix}"


class RolloutRecorder:
    """Writes ``rollouts/`` for one rank of a run."""

    def __init__(self, run_dir: Path, tokenizer, rank: int, world: int):
        self.folder = run_dir / "rollouts"
        self.tokenizer, self.rank, self.world = tokenizer, rank, world
        self.folder.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            _atomic_text(self.folder / "format.json", json.dumps(
                {"format": FORMAT_NAME, "version": FORMAT_VERSION, "tokenizer": tokenizer_fingerprint(tokenizer)},
                indent=1) + "\n")

    @classmethod
    def for_run(cls, run_dir: Path, tokenizer, rank: int, world: int, *, iteration: int, actor, critic,
                critic_model: str | None,
                full_states: Callable[[], tuple[dict | None, dict | None]]) -> "RolloutRecorder":
        """A recorder for a run at ``iteration``; at iteration 0 it also saves the initial weights: ``actor``, and
        ``critic`` when the run loaded it from ``critic_model``; ``full_states()`` gathers them from FSDP2 shards (a
        collective: every rank calls this)."""
        recorder = cls(run_dir, tokenizer, rank, world)
        if iteration == 0:
            # A critic built from the actor (a new zero value head) is rebuilt the same way on replay: saving and
            # reloading it gives the same values but not bit-identical updates (the head's memory differs).
            actor_state, critic_state = full_states()
            own_critic = critic if critic_model else None
            recorder.save_initial(actor, own_critic, actor_state, critic_state if own_critic else None)
        return recorder

    def save_initial(self, actor, critic, actor_state: dict | None = None, critic_state: dict | None = None) -> None:
        """The weights every recorded batch's first update starts from (call before the first update; rank 0
        writes; ``*_state``: full state dicts gathered from FSDP2 shards)."""
        from stppo_agent.models.loading import save_policy

        if self.rank != 0:
            return
        scratch, final = self.folder / ".initial.tmp", self.folder / "initial"
        shutil.rmtree(scratch, ignore_errors=True)
        save_policy(scratch, actor, self.tokenizer, critic, actor_state, critic_state)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(scratch, final)

    def record(self, iteration: int, batch) -> None:
        """Write ``batch`` (as sampled, before scoring) as iteration ``iteration`` (1-based)."""
        from safetensors.torch import save_file

        tensors = {name: getattr(batch, name).detach().cpu().contiguous() for name in TENSOR_FIELDS}
        metadata = {"prompt_width": str(batch.prompt_width), "iteration": str(iteration),
                    "stats": json.dumps(batch.stats, sort_keys=True), "rank": str(self.rank),
                    "world_size": str(self.world)}
        if self.rank == 0:  # shares of this iteration from an earlier attempt with more processes
            for stale in self.folder.glob(f"iter-{iteration:06d}.rank-*"):
                if _rank_of(stale) is not None and _rank_of(stale) >= self.world:
                    stale.unlink(missing_ok=True)
        target = batch_file(self.folder, iteration, self.rank, "safetensors")
        scratch = target.with_name(target.name + ".tmp")
        save_file(tensors, str(scratch), metadata=metadata)
        os.replace(scratch, target)
        lines = [json.dumps(record, ensure_ascii=False, sort_keys=True) for record in self._transcripts(batch)]
        _atomic_text(batch_file(self.folder, iteration, self.rank, "jsonl"), "".join(x + "\n" for x in lines))

    def _transcripts(self, batch):
        infos = batch.episode_info or [{} for _ in range(batch.batch_size)]
        for row in range(batch.batch_size):
            prompt = batch.input_ids[row, :batch.prompt_width][batch.attention_mask[row, :batch.prompt_width].bool()]
            segments = [["prompt", -1, self.tokenizer.decode(prompt.tolist(), skip_special_tokens=False)]]
            length = int(batch.attention_mask[row, batch.prompt_width:].sum())
            ids = batch.response_ids[row, :length].tolist()
            policy = batch.loss_mask[row, :length].tolist()
            turns = batch.turn_ids[row, :length].tolist()
            start = 0
            for end in range(1, length + 1):  # one segment per run of equal (role, turn)
                if end == length or policy[end] != policy[start] or (policy[end] and turns[end] != turns[start]):
                    role = "policy" if policy[start] else "observation"
                    segments.append([role, turns[start] if policy[start] else -1,
                                     self.tokenizer.decode(ids[start:end], skip_special_tokens=False)])
                    start = end
            yield {"row": row, "group_id": int(batch.group_ids[row]), "reward": float(batch.rewards[row]),
                   **infos[row], "transcript": segments}


def _atomic_text(path: Path, text: str) -> None:
    scratch = path.with_name(path.name + ".tmp")
    scratch.write_text(text, encoding="utf-8")
    os.replace(scratch, path)


def read_format(folder: Path) -> dict[str, Any]:
    path = folder / "format.json"
    if not path.exists():
        raise FileNotFoundError(f"{folder.parent} has no recorded rollouts ({path} is missing): train it with "
                                "--set logging.save_rollouts=true to record them")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT_NAME or meta.get("version") not in READABLE_VERSIONS:
        raise ValueError(f"{path}: unsupported rollout format {meta.get('format')!r} v{meta.get('version')} "
                         f"(this stppo reads {FORMAT_NAME} v{', v'.join(map(str, READABLE_VERSIONS))})")
    return meta


def _iteration_of(path: Path) -> int | None:
    number = path.name.split(".")[0].removeprefix("iter-")
    return int(number) if number.isdigit() else None


def _rank_of(path: Path) -> int | None:
    rank = path.name.split(".")[1].removeprefix("rank-") if path.name.count(".") >= 2 else ""
    return int(rank) if rank.isdigit() else None


def recorded_world_size(folder: Path, iteration: int) -> int:
    """How many processes recorded ``iteration``: rank 0's metadata, or (version 1) the number of rank files."""
    from safetensors import safe_open

    path = batch_file(folder, iteration, 0, "safetensors")
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: iteration {iteration} was not recorded")
    with safe_open(str(path), framework="pt") as handle:
        world = (handle.metadata() or {}).get("world_size")
    if world is not None:
        return int(world)
    ranks = {_rank_of(p) for p in folder.glob(f"iter-{iteration:06d}.rank-*.safetensors")}
    count = 0
    while count in ranks:
        count += 1
    return count


def check_iteration_files(folder: Path, iteration: int) -> int:
    """The iteration's world size, after checking that every rank's share is there (ValueError otherwise)."""
    world = recorded_world_size(folder, iteration)
    missing = [rank for rank in range(world) if not batch_file(folder, iteration, rank, "safetensors").exists()]
    if missing:
        raise ValueError(f"{folder}: iteration {iteration} was recorded by {world} processes, but the share of "
                         f"{', '.join(f'rank-{r}' for r in missing)} is missing; a replay would use part of its data")
    return world


def load_iteration(folder: Path, iteration: int, pad_id: int):
    """Every rank's recorded share of ``iteration`` as one batch, rows in single-process order (by prompt group,
    stably), prompts left-padded and responses right-padded to the widest share; ``stats`` are the whole batch's,
    combined from the shares' as sums and counts."""
    from stppo_agent.algorithms.metrics import combine_rollout_statistics
    from stppo_agent.rollouts.global_batch import merge_shares
    from stppo_agent.rollouts.statistics import rollout_parts

    world = check_iteration_files(folder, iteration)
    shares = [load_batch(folder, iteration, rank) for rank in range(world)]
    if world == 1:
        return shares[0]
    if any(share.episode_info is None for share in shares):  # kept only where every share recorded it
        shares = [dataclasses.replace(share, episode_info=None) for share in shares]
    stats = combine_rollout_statistics([rollout_parts(share, None) for share in shares])
    return merge_shares(shares, pad_id, stats)


def recorded_iterations(folder: Path, rank: int) -> list[int]:
    numbers = (_iteration_of(path) for path in folder.glob(f"iter-*.rank-{rank}.safetensors"))
    return sorted(number for number in numbers if number is not None)


def load_batch(folder: Path, iteration: int, rank: int):
    """The recorded batch of ``iteration`` as a :class:`~stppo_agent.rollouts.batch.RolloutBatch` on the CPU."""
    from safetensors import safe_open

    from stppo_agent.rollouts.batch import RolloutBatch

    path = batch_file(folder, iteration, rank, "safetensors")
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: iteration {iteration} was not recorded")
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
        tensors = {name: handle.get_tensor(name) for name in TENSOR_FIELDS}
    transcripts = batch_file(folder, iteration, rank, "jsonl")
    infos = None
    if transcripts.exists():
        keep = ("example_id", "benchmark", "question", "finish_reason")
        infos = [{k: v for k, v in json.loads(line).items() if k in keep}
                 for line in transcripts.read_text(encoding="utf-8").splitlines() if line.strip()]
    return RolloutBatch(prompt_width=int(metadata["prompt_width"]), stats=json.loads(metadata.get("stats", "{}")),
                        episode_info=infos, **{k: v for k, v in tensors.items()})
