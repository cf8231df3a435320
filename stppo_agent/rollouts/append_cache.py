"""A key/value cache that appends in place, for rollouts.

transformers' ``DynamicCache`` grows each layer with ``torch.cat`` at every generated token: every step copies the
whole cache (keys and values of every layer), so a turn costs O(context^2) memory traffic. In a multi-turn rollout
the context is long -- prompt, earlier turns, retrieved passages -- and the copy dominated: on a 2-core CPU,
appending 2 x 120 observation tokens to a 16 x 3-turn rollout made the cache's ``cat`` 45% of the rollout (from 16%).

:class:`AppendLayer` keeps each layer's keys and values in a buffer with room to spare and writes new positions in
place; ``keys`` / ``values`` are views of the filled part, so the attention reads exactly the positions a
``DynamicLayer`` would hold and the results are bit-identical. The buffer grows by whole blocks of
``BLOCK_POSITIONS`` (one copy per block), so the memory over a ``DynamicCache`` is under one block per row.

Everything else -- row selection between turns, cropping, beam reordering -- is ``DynamicLayer``'s own code: it
replaces ``keys`` with a new tensor (or a shorter view), which the next ``update`` notices and adopts.
"""

from __future__ import annotations

import torch

try:  # transformers with per-layer caches (DynamicLayer); older versions keep their default cache
    from transformers.cache_utils import DynamicCache, DynamicLayer
except ImportError:  # pragma: no cover - depends on the installed transformers
    DynamicCache = DynamicLayer = None

BLOCK_POSITIONS = 256


if DynamicLayer is not None:

    class AppendLayer(DynamicLayer):
        """A ``DynamicLayer`` whose ``update`` writes into a preallocated buffer instead of concatenating."""

        _key_buffer: torch.Tensor | None = None
        _value_buffer: torch.Tensor | None = None

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            held = self.keys.shape[-2] if self.keys.dim() == 4 else 0
            needed = held + key_states.shape[-2]
            if not self._buffer_holds(key_states, value_states, needed):
                self._reallocate(key_states, value_states, held, needed)
            self._key_buffer[..., held:needed, :].copy_(key_states)
            self._value_buffer[..., held:needed, :].copy_(value_states)
            self.keys, self.values = self._key_buffer[..., :needed, :], self._value_buffer[..., :needed, :]
            return self.keys, self.values

        def _buffer_holds(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> bool:
            """Whether ``keys`` / ``values`` are still views of the buffers (nothing replaced them) and the buffers
            have room for ``needed`` positions of these rows."""
            keys, buffer = self.keys, self._key_buffer
            return (buffer is not None and keys.dim() == 4 and keys.data_ptr() == buffer.data_ptr()
                    and self.values.data_ptr() == self._value_buffer.data_ptr()
                    and buffer.shape[0] == key_states.shape[0] and buffer.shape[-2] >= needed
                    and buffer.dtype == key_states.dtype and buffer.device == key_states.device
                    and self._value_buffer.shape[-1] == value_states.shape[-1])

        def _reallocate(self, key_states: torch.Tensor, value_states: torch.Tensor, held: int, needed: int) -> None:
            capacity = -(-needed // BLOCK_POSITIONS) * BLOCK_POSITIONS
            keys = key_states.new_empty((*key_states.shape[:-2], capacity, key_states.shape[-1]))
            values = value_states.new_empty((*value_states.shape[:-2], capacity, value_states.shape[-1]))
            if held:
                keys[..., :held, :].copy_(self.keys)
                values[..., :held, :].copy_(self.values)
            self._key_buffer, self._value_buffer = keys, values


def new_cache(model_config):
    """A fresh cache for ``generate``: a ``DynamicCache`` for ``model_config`` whose full-attention layers append
    in place; None (``generate`` builds its own) where transformers has no per-layer caches."""
    if DynamicCache is None:
        return None
    cache = DynamicCache(config=model_config)
    cache.layers = [AppendLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:  # layers made lazily, one per update
        cache.layer_class_to_replicate = AppendLayer
    return cache
