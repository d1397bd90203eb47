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
which picks ``i`` with probability ``p_i``; only where ``E`` comes from differs.  The noise for
all of a step's sampling calls is made in one pass before the step, so each call costs what the
package's own sampling costs.

The package calls ``moshi.models.lm.sample_token`` by module name, so the hook replaces that
name once, with a function that does what the original does unless a ``RowSampler`` is active
on the calling thread (only ever inside this backend's LM stage, on the scheduler thread).
"""

from __future__ import annotations

import copy
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


def mix32_int(x: int) -> int:
    """``mix32`` on one Python integer."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * _M1) & _MASK32
    x ^= x >> 15
    x = (x * _M2) & _MASK32
    x ^= x >> 16
    return x


def session_key(seed: int, session_id: int) -> int:
    """A row's 32-bit key for a session: the backend's seed and the session's id, hashed."""
    key = mix32_int((seed & _MASK32) ^ _M3)
    key = mix32_int(key ^ (seed >> 32 & _MASK32))
    key = mix32_int(key ^ (session_id & _MASK32))
    return mix32_int(key ^ (session_id >> 32 & _MASK32))


class RowSampler:
    """Per-row noise for one fixed batch.

    ``keys[b]`` (the session's key) and ``counters[b]`` (frames the row has stepped) are device
    tensors owned here and changed only in place.  ``prepare`` (once per LM step, before it)
    hashes them into this step's exponential noise for every sampling call the step will make,
    in one pass: ``widths`` lists how many candidates each call samples from, in the order the
    package calls (text first, then each depformer codebook).  Each call then takes its segment.
    A call of another shape (a model this was not sized for) hashes its own noise instead.
    """

    def __init__(self, batch: int, device: torch.device, widths: list[int]) -> None:
        self.keys = torch.zeros(batch, dtype=torch.int64, device=device)
        self.counters = torch.zeros(batch, dtype=torch.int64, device=device)
        self.widths = list(widths)
        self.starts = [sum(self.widths[:i]) for i in range(len(self.widths))]
        total = sum(self.widths)
        #: Each noise position's own hash, a constant: the per-step work is one mix per element.
        self._positions = mix32(torch.arange(total, dtype=torch.int64, device=device) * 0x27D4EB2F + 0x165667B1)
        self._base = torch.zeros(batch, dtype=torch.int64, device=device)
        self.noise = torch.ones(batch, total, dtype=torch.float32, device=device)
        self.call = 0

    def first_rows(self, rows: int) -> RowSampler:
        """A sampler over this one's first ``rows`` rows, for a step sized to them (``buckets``):
        its keys, counters and noise are views of these, so a row's stream goes on whichever
        bucket steps it."""
        view = copy.copy(self)
        view.keys = self.keys[:rows]
        view.counters = self.counters[:rows]
        view._base = self._base[:rows]
        view.noise = self.noise[:rows]
        view.call = 0
        return view

    def _step_base(self) -> torch.Tensor:
        return mix32(self.keys ^ mix32(self.counters * 0x3C6EF372 + 0x7F4A7C15))

    @staticmethod
    def _exponential(hashed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # 24 random bits -> uniform in (0, 1) -> Exp(1), as -log(u).
        uniform = ((hashed >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
        return torch.neg(torch.log(uniform), out=out)

    def prepare(self) -> None:
        """This step's noise for every row, from each row's key and counter (in place)."""
        self.call = 0
        self._base.copy_(self._step_base())
        self._exponential(mix32(self._base[:, None] ^ self._positions[None, :]), out=self.noise)

    def exponential(self, shape: torch.Size) -> torch.Tensor:
        """Exp(1) noise of ``shape`` (rows first) for the next sampling call of this step."""
        call = self.call
        self.call += 1
        width = 1
        for size in shape[1:]:
            width *= size
        if call < len(self.widths) and width == self.widths[call]:
            start = self.starts[call]
            return self.noise[:, start:start + width].reshape(shape)
        index = torch.arange(width, dtype=torch.int64, device=self._base.device)
        salt = mix32(index * 0x27D4EB2F + (call + 1) * 0x61C88647)
        return self._exponential(mix32(self._base[:, None] ^ salt[None, :])).reshape(shape)

    def sample(self, logits: torch.Tensor, temp: float, top_k: int) -> torch.Tensor:
        """``logits [B, ..., V]`` -> tokens ``[B, ...]``, as ``sample_token`` with sampling on."""
        probs = torch.softmax(logits / temp, dim=-1)
        if top_k > 0:
            k = min(top_k, probs.shape[-1])
            probs, indices = torch.topk(probs, k, dim=-1)
        else:
            indices = None
        choice = (probs / self.exponential(probs.shape)).argmax(dim=-1, keepdim=True)
        if indices is not None:
            choice = indices.gather(-1, choice)
        return choice[..., 0]


def call_widths(text_card: int, card: int, dep_q: int, top_k_text: int, top_k: int) -> list[int]:
    """How many candidates each of an LM step's sampling calls draws from: text, then audio."""
    text = min(top_k_text, text_card) if top_k_text > 0 else text_card
    audio = min(top_k, card) if top_k > 0 else card
    return [text] + [audio] * dep_q


_local = threading.local()
_original: Any = None


def install() -> None:
    """Route the package's sampling through ``_sample_token`` (idempotent)."""
    global _original
    import moshi.models.lm as lm_module

    if getattr(lm_module.sample_token, "duplexrt_row_sampler", False):
        return
    _original = lm_module.sample_token

    def _sample_token(logits: torch.Tensor, use_sampling: bool = False, temp: float = 1.0,
                      top_k: int = 0, top_p: float = 0.0) -> torch.Tensor:
        sampler: RowSampler | None = getattr(_local, "sampler", None)
        if sampler is None:
            return _original(logits, use_sampling, temp, top_k, top_p)
        if not use_sampling or temp <= 0.0 or top_p > 0.0:
            sampler.call += 1  # keep the calls after this one on their own noise
            return _original(logits, use_sampling, temp, top_k, top_p)
        return sampler.sample(logits, temp, top_k)

    _sample_token.duplexrt_row_sampler = True  # type: ignore[attr-defined]
    lm_module.sample_token = _sample_token


class active:
    """``with active(sampler):`` the package's sampling on this thread uses ``sampler``."""

    __slots__ = ("_sampler", "_previous")

    def __init__(self, sampler: RowSampler | None) -> None:
        self._sampler = sampler

    def __enter__(self) -> None:
        self._previous = getattr(_local, "sampler", None)
        if self._sampler is not None:
            self._sampler.prepare()
        _local.sampler = self._sampler

    def __exit__(self, *exc: object) -> None:
        _local.sampler = self._previous
