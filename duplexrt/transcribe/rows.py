"""Making a reused row a fresh one: the two per-row buffers a package reset leaves behind.

``reset_streaming(mask)`` of the ``moshi`` package rewinds a row's offsets and zeroes its
convolution buffers, but leaves the keys and values in every ``RingKVCache`` (Mimi's encoder
transformer, the LM's) and ``LMGen``'s token cache as the last session left them.  Masked-out
K/V entries still enter ``softmax(...) @ V`` with weight zero, and zero times NaN is NaN: a caller
who sent NaN (or a huge value that overflowed) would poison every later caller on that row.  So a
join restores those buffers to what a fresh streaming state holds (zeros; "not generated yet"),
for the joining rows only.

The dialogue backend has its own such helper (``backends.moshi.rows``); this one is separate so
that the transcriber does not depend on that module's evolving internals, and small because an
STT model has neither a depformer nor a Mimi decoder.
"""

from __future__ import annotations

import dataclasses
from typing import Any


class FreshRows:
    """The buffers under ``roots`` (streaming modules, already streaming) a row reset must
    restore, found once; ``restore(index)`` writes a fresh row's values into those rows."""

    def __init__(self, roots: list[Any]) -> None:
        from moshi.modules.streaming import StreamingModule
        from moshi.modules.transformer import RingKVCache

        from duplexrt.backends.moshi.internals import streaming_state

        #: (tensor, batch dimension, fresh value)
        self.buffers: list[tuple[Any, int, int | float]] = []
        seen: set[int] = set()
        for root in roots:
            for module in root.modules():
                state = streaming_state(module)
                if not isinstance(module, StreamingModule) or state is None or id(state) in seen:
                    continue
                seen.add(id(state))
                for field in dataclasses.fields(state):
                    value = getattr(state, field.name)
                    if isinstance(value, RingKVCache):
                        # (keys/values, batch, heads, capacity, dim): fresh is zeros.
                        self.buffers.append((value.cache, 1, 0.0))
                    elif field.name == "cache" and hasattr(module, "lm_model"):
                        # LMGen's (batch, codebooks, delay + 2) token cache: fresh is "not generated".
                        lm_model: Any = module.lm_model
                        self.buffers.append((value, 0, int(lm_model.ungenerated_token_id)))

    @staticmethod
    def state_bytes(roots: list[Any]) -> int:
        """Bytes of every tensor in the streaming states under ``roots`` (the K/V rings, the
        convolution buffers, the token cache...): what the batch's rows hold, all together."""
        import torch
        from moshi.modules.transformer import RingKVCache

        from duplexrt.backends.moshi.internals import attributes, streaming_state

        total = 0
        seen: set[int] = set()
        for root in roots:
            for module in root.modules():
                state = streaming_state(module)
                if state is None or id(state) in seen:
                    continue
                seen.add(id(state))
                for value in attributes(state).values():
                    if isinstance(value, RingKVCache):
                        value = value.cache
                    if isinstance(value, torch.Tensor) and id(value) not in seen:
                        seen.add(id(value))
                        total += value.numel() * value.element_size()
        return total

    def restore(self, index: Any) -> None:
        """Restore the rows of ``index`` (a 1-D int64 tensor on the model's device)."""
        for tensor, dim, fill in self.buffers:
            tensor.index_fill_(dim, index, fill)
