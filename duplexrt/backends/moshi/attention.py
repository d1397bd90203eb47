"""The temporal transformer's attention reads what the active rows have filled, not the whole ring.

The package's streaming attention writes each step's K/V into every row's ring
(``RingKVCache.complete``) and then attends over all ``capacity`` positions of it, with a mask that
drops the positions not written yet: a row 10 s into a call on a 60 s ring reads six times the keys
it uses, and so does every idle row.  Here, on the CPU, a one-position step (the shared batch's)
reads only the first ``L`` positions of the ring, where ``L`` is the longest filled length among the
rows the step executes, rounded up to a multiple of ``BLOCK`` (64) positions and at most the ring;
while every active row is shorter than the ring, its positions sit at ring index = position, so
the first ``L`` indices hold all of them, and everything past ``L`` was masked out anyway.  Once a
row has filled its ring (``beyond_context = "slide"``) the step reads the whole ring, as before.
Idle rows are computed over the same ``L`` (one shape for the batch); their output is discarded, as
it always was.

**Exactness.**  The mask is the package's own, computed over the first ``L`` positions, so the
semantics are unchanged.  The rounding is too, on this CPU: with ``L`` a multiple of 64 the
masked positions past ``L`` added exact zeros to the same partial sums, and a one-position step's
output is bit-identical to the full ring's (measured: 600 random shapes, float32 and bfloat16, one
and two threads, torch 2.13; ``L`` cut at the filled length itself differs by ~1e-7).  So a call's
output is still its own, bit for bit, whoever shares the step, although ``L`` follows the longest
neighbour.  ``tests/test_backend_moshi_attention.py`` checks it on the backend.  A multi-position
forward (the prompt lane's prefill) is *not* bit-identical when cut (~1e-7), so it keeps the
package's full-ring read: it runs once per prompt, not every frame.

**Where.**  Installed by the backend on the LM's temporal transformer's self-attentions only (the
depformer's rings live one step; Mimi's are 16 positions), by replacing each module's K/V read
(``internals.replace_complete_kv``): the package's forward, projections, RoPE and mask are used
as they are.  The length is a host integer (one ``.item()`` a layer), which a CUDA graph cannot
capture: on a GPU the package's full-ring read is kept (not installed) until a graph-capturable
per-row kernel (FlexAttention's block mask, or a decode kernel with per-row cache lengths) is
measured on a device.
"""

from __future__ import annotations

from typing import Any

from duplexrt.backends.moshi.internals import (package_complete_kv, replace_complete_kv, replaced_complete_kv,
                                              streaming_state)

#: The filled length is read in whole blocks of this many positions (see "Exactness").
BLOCK = 64


def read_length(filled: int, capacity: int) -> int:
    """The ring positions a one-position step reads when the longest active row has ``filled``
    positions (this step's included) on a ring of ``capacity``: whole blocks, at least one, at most
    the ring; the whole ring once a row has wrapped."""
    if filled >= capacity:
        return capacity
    blocks = max(1, -(-filled // BLOCK))
    return min(capacity, blocks * BLOCK)


def temporal_attentions(lm: Any) -> list[Any]:
    """The LM's temporal transformer's self-attention modules."""
    return [layer.self_attn for layer in lm.transformer.layers if hasattr(layer, "self_attn")]


def _filled_reader(attention: Any) -> Any:
    package = package_complete_kv(attention)

    def complete(k: Any, v: Any) -> Any:
        result = package(k, v)
        state = streaming_state(attention)
        if state is None or k.shape[2] != 1:
            return result  # not streaming, or a prefill (several positions)
        cache = state.kv_cache
        if cache is None or not cache.respect_exec_mask:
            return result  # no ring, or one without per-row offsets
        filled = int(cache.end_offset.masked_fill(~state.exec_mask, 0).max().item())
        length = read_length(filled, cache.capacity)
        if length >= result.keys.shape[2]:
            return result
        return type(result)(result.keys[:, :, :length], result.values[:, :, :length],
                            result.positions[:, :length])

    return complete


def install(lm: Any) -> int:
    """Every temporal self-attention of ``lm`` reads only the filled positions (a CPU's step); the
    number of modules changed.  Installing again is harmless."""
    modules = temporal_attentions(lm)
    for attention in modules:
        if replaced_complete_kv(attention) is None:
            replace_complete_kv(attention, _filled_reader(attention))
    return len(modules)


def uninstall(lm: Any) -> None:
    """The package's full-ring read back on every temporal self-attention of ``lm``."""
    for attention in temporal_attentions(lm):
        replace_complete_kv(attention, None)


def installed(lm: Any) -> bool:
    """Whether ``lm``'s temporal attentions read only the filled positions."""
    modules = temporal_attentions(lm)
    return bool(modules) and all(replaced_complete_kv(a) is not None for a in modules)


__all__ = ["BLOCK", "read_length", "temporal_attentions", "install", "uninstall", "installed"]
