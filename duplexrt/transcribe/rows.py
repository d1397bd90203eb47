"""What the transcriber's rows hold, measured from their streaming state once allocated.

The start line says it per slot, and a test holds the estimate the memory check uses (read from
the model's modules before any row exists: ``Transcriber.state_bytes_per_slot``) to it.  A reused
row is restored to a fresh one by the dialogue backend's own ``RowWiper`` (``backends.moshi.rows``),
which knows the buffers a package reset leaves behind.
"""

from __future__ import annotations

from typing import Any


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
