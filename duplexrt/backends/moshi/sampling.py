"""Sampling whose randomness belongs to each session, not to the batch.

``LMGen`` samples every row of the batch from the one global torch generator, so what a session
draws depends on how many steps the process has run and on which other rows share the batch: a
session joining would change everyone else's words.  Here each row draws its noise from a counter
hash of (the row's session key, the row's own step count, which sampling call in the step, token
position), computed with a few integer tensor operations over the whole batch at once.  A session
therefore samples exactly the same tokens whoever else is served beside it, its output can be
reproduced from its seed, and the whole step stays one batched computation (CUDA-graph friendly:
every tensor read lives at a fixed address and is updated in place).

The draw is the package's own: ``argmax(p / E)`` with ``E ~ Exp(1)`` over the top-k candidates,
which picks ``i`` with probability ``p_i``; only where ``E`` comes from differs.

The package calls ``moshi.models.lm.sample_token`` by module name, so the hook replaces that
name once, with a function that does what the original does unless a ``RowSampler`` is active
on the calling thread (only ever inside this backend's LM stage, on the scheduler thread).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_MASK32 = 0xFFFFFFFF
#: Odd multipliers below 2**27, so that a 32-bit value times one fits in int64 with room to spare.
_M1 = 0x045D9F3B
_M2 = 0x02C1B3C7
_M3 = 0x0119DE1F


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) on int64 tensors holding 32-bit values."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    x = x ^ (x >> 16)
    return x


def session_key(seed: int, session_id: int) -> int:
    """A row's 32-bit key for a session: the backend's seed and the session's id, hashed."""
    value = torch.tensor([(seed * 0x9E3779B1 + session_id) & _MASK32], dtype=torch.int64)
    return int(mix32(mix32(value) ^ (session_id >> 32 & _MASK32))[0])


class RowSampler:
    """Per-row noise for one fixed batch.

    ``keys[b]`` (the session's key) and ``counters[b]`` (frames the row has stepped) are device
    tensors owned here and changed only in place; ``call`` numbers the sampling calls within one
    LM step (text first, then each depformer codebook), in the order the package makes them.
    """

    def __init__(self, batch: int, device: torch.device) -> None:
        self.keys = torch.zeros(batch, dtype=torch.int64, device=device)
        self.counters = torch.zeros(batch, dtype=torch.int64, device=device)
        self.call = 0

    def uniform(self, shape: torch.Size) -> torch.Tensor:
        """Uniform noise in (0, 1) of ``shape`` (rows first), float32, a function of each row's
        key and counter, this call's number and the position in the last dimension."""
        call = self.call
        self.call += 1
        base = mix32(self.keys ^ mix32(self.counters * 0x3C6EF372 + call * 0x7F4A7C15 + 1))
        width = shape[-1]
        index = torch.arange(width, device=base.device, dtype=torch.int64)
        inner = 1
        for size in shape[1:-1]:
            inner *= size
        if inner > 1:
            index = (torch.arange(inner, device=base.device, dtype=torch.int64)[:, None] * width
                     + index[None, :]).reshape(-1)
        hashed = mix32(base[:, None] ^ mix32(index[None, :] + 0x1B873593))
        noise = ((hashed >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
        return noise.reshape(shape)

    def sample(self, logits: torch.Tensor, temp: float, top_k: int) -> torch.Tensor:
        """``logits [B, ..., V]`` -> tokens ``[B, ...]``, as ``sample_token`` with sampling on."""
        probs = torch.softmax(logits / temp, dim=-1)
        if top_k > 0:
            k = min(top_k, probs.shape[-1])
            probs, indices = torch.topk(probs, k, dim=-1)
        else:
            indices = None
        race = probs / -torch.log(self.uniform(probs.shape))
        choice = race.argmax(dim=-1, keepdim=True)
        if indices is not None:
            choice = indices.gather(-1, choice)
        return choice[..., 0]


_local = threading.local()
_original: Any = None


def install() -> None:
    """Route the package's sampling through ``_sample_token`` (idempotent)."""
    global _original
    import moshi.models.lm as lm_module

    if getattr(lm_module.sample_token, "_duplexrt_row_sampler", False):
        return
    _original = lm_module.sample_token

    def _sample_token(logits: torch.Tensor, use_sampling: bool = False, temp: float = 1.0,
                      top_k: int = 0, top_p: float = 0.0) -> torch.Tensor:
        sampler: RowSampler | None = getattr(_local, "sampler", None)
        if sampler is None or not use_sampling or temp <= 0.0 or top_p > 0.0:
            return _original(logits, use_sampling, temp, top_k, top_p)
        return sampler.sample(logits, temp, top_k)

    _sample_token._duplexrt_row_sampler = True  # type: ignore[attr-defined]
    lm_module.sample_token = _sample_token


class active:
    """``with active(sampler):`` the package's sampling on this thread uses ``sampler``."""

    __slots__ = ("_sampler", "_previous")

    def __init__(self, sampler: RowSampler | None) -> None:
        self._sampler = sampler

    def __enter__(self) -> None:
        self._previous = getattr(_local, "sampler", None)
        if self._sampler is not None:
            self._sampler.call = 0
        _local.sampler = self._sampler

    def __exit__(self, *exc: object) -> None:
        _local.sampler = self._previous
