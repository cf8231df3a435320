"""KV-cache reuse across the turns of a multi-turn rollout (transformers backend).

Without it every turn re-encodes each trajectory's whole transcript. With it, each *chunk* of trajectories
(``rollout.generation_batch_size`` of them, fixed for the whole rollout) keeps the key/value cache that ``generate``
left after its turn; the next turn feeds only the tokens that are new -- the observation, and the last generated token
-- and continues.

Layout. A chunk's cache is rectangular (one width for all its rows), so a row's tokens are not contiguous: left
padding, the padding ``generate`` writes after a row stopped, and the new tokens of shorter rows are *holes*,
positions with ``attention_mask`` 0. transformers derives position ids from the cumulative attention mask, so a
row's real tokens get the same positions (0, 1, 2, ...) as in a fresh left-padded prefill, and attention skips
the holes: the logits are those of a fresh prefill up to float rounding (|d log p| ~ 1e-7 in float32), and with the
same random state the sampled tokens are the same.

Every row must feed at least one new token (``generate`` reads each row's next-token logits at the last column),
but a row may have no observation. So the last generated token of every row is always fed again: where it is in
the cache already (the row stopped before the turn's last step) that copy is masked out.

A turn's context must extend the tokens the cache holds (``generate``'s output, as cut by the stop rules). If a
caller changed them (cut a generation to a budget, say), the chunk is re-encoded from scratch: slower, never wrong.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

import torch


@dataclasses.dataclass
class ChunkCache:
    """What one chunk's cache holds after a turn."""

    keys: list[Hashable]
    ids: torch.Tensor  # (B, W) tokens at the cached positions (holes hold padding)
    mask: torch.Tensor  # (B, W) 1 where a cached position is part of the row's context
    cache: object  # a transformers Cache with W positions
    pending: list[list[int]]  # per row: tokens of its context not (visibly) in the cache yet
    covered: list[list[int]]  # per row: the context the cache plus ``pending`` stand for

    def continuation(self, keys: Sequence[Hashable], contexts: Sequence[Sequence[int]]) -> list[list[int]] | None:
        """The new tokens of each row (None when a context does not extend what the cache holds)."""
        rows = {key: row for row, key in enumerate(self.keys)}
        new = []
        for key, context in zip(keys, contexts):
            row = rows.get(key)
            if row is None:
                return None
            covered = self.covered[row]
            if len(context) < len(covered) or list(context[:len(covered)]) != covered:
                return None
            new.append(self.pending[row] + list(context[len(covered):]))
        return new

    def select(self, keys: Sequence[Hashable]) -> None:
        """Keep the rows of ``keys``, in that order (the trajectories still playing)."""
        rows = [self.keys.index(key) for key in keys]
        if rows == list(range(len(self.keys))):
            return
        index = torch.tensor(rows, device=self.ids.device)
        self.cache.batch_select_indices(index)
        self.ids, self.mask = self.ids[index], self.mask[index]
        self.pending = [self.pending[r] for r in rows]
        self.covered = [self.covered[r] for r in rows]
        self.keys = list(keys)


def after_generate(keys: Sequence[Hashable], contexts: Sequence[Sequence[int]], input_ids: torch.Tensor,
                   attention_mask: torch.Tensor, sequences: torch.Tensor, lengths: Sequence[int],
                   cache) -> ChunkCache:
    """The chunk's state after ``generate`` produced ``sequences`` from ``input_ids`` (its rows' real generated
    lengths: ``lengths``) and left ``cache`` (every position but the last generated one)."""
    width = input_ids.shape[1]
    cached = cache.get_seq_length()
    generated_mask = torch.zeros_like(sequences[:, width:], dtype=attention_mask.dtype)
    for row, length in enumerate(lengths):
        generated_mask[row, :length] = 1
    mask = torch.cat([attention_mask, generated_mask], dim=1)[:, :cached].clone()
    pending, covered = [], []
    for row, length in enumerate(lengths):
        generated = sequences[row, width:width + length].tolist()
        covered.append(list(contexts[row]) + generated)
        if length:  # the last generated token is fed again next turn; a cached copy of it is hidden
            pending.append([generated[-1]])
            if width + length - 1 < cached:
                mask[row, width + length - 1] = 0
        else:
            pending.append([])
    return ChunkCache(list(keys), sequences[:, :cached], mask, cache, pending, covered)


def extend_inputs(state: ChunkCache, new: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids / attention_mask for ``generate`` with ``state.cache``: the cached layout, then each row's new
    tokens left-padded to a common width (so every row's last column is real)."""
    width = max(len(tokens) for tokens in new)
    device = state.ids.device
    ids = torch.full((len(new), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(new), width), dtype=state.mask.dtype, device=device)
    for row, tokens in enumerate(new):
        if tokens:
            ids[row, width - len(tokens):] = torch.tensor(tokens, dtype=torch.long, device=device)
            mask[row, width - len(tokens):] = 1
    return torch.cat([state.ids, ids], dim=1), torch.cat([state.mask, mask], dim=1)


class TurnCaches:
    """The chunks of one rollout: which trajectory is in which chunk, and each chunk's cache."""

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size
        self.chunk_of: dict[Hashable, int] = {}
        self.members: list[list[Hashable]] = []
        self.states: dict[int, ChunkCache] = {}

    def groups(self, keys: Sequence[Hashable]) -> list[tuple[int, list[int]]]:
        """(chunk, positions in ``keys``) for every chunk with an active trajectory. A trajectory seen for the first
        time joins the newest chunk with room, so the chunks are the same whether or not caches are reused."""
        for key in keys:
            if key not in self.chunk_of:
                if not self.members or len(self.members[-1]) >= self.chunk_size:
                    self.members.append([])
                self.members[-1].append(key)
                self.chunk_of[key] = len(self.members) - 1
        grouped: dict[int, list[int]] = {}
        for position, key in enumerate(keys):
            grouped.setdefault(self.chunk_of[key], []).append(position)
        return sorted(grouped.items())

    def clear(self) -> None:
        self.chunk_of.clear()
        self.members.clear()
        self.states.clear()
