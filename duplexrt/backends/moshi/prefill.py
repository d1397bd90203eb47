"""A persona's prompt run through the temporal transformer in a lane of its own, beside the
shared batch, and its state put into a row.

**Why a lane.**  A prompt is 100-300 frames.  Stepped inside the shared batch it either delays
the joining caller by seconds (one prompt frame per shared step) or stalls every other caller
(extra full-batch steps).  But all of a prompt's inputs are known before it starts (``persona``),
nothing in it is sampled, and only the temporal transformer's K/V and offsets carry it forward:
the depformer runs afresh every step, and Mimi has not heard the caller yet.  So the prompt is
run once through the temporal transformer on a batch of one (the *lane*: the transformer's
streaming state swapped for a fresh one of batch 1, then swapped back), and the lane's K/V for
the prompt's positions is copied into the joining row.  The shared batch's state objects are
never replaced, only written in place, so its CUDA graphs stay valid.

**Two ways through the lane.**  ``"batch"`` (the default) reads every prompt position in one
multi-position forward, as an LLM prefills its prompt: one pass, whatever the prompt's length.
``"frames"`` reads one position per forward, as the reference steps its prompt: the reference
mode, and the yardstick the batch mode's rounding is measured against.

**The seam** (see ``persona``): the prompt's last position is read by the prefill, and the first
text and audio tokens sampled from it with the session's own stream (``sample_seam``), so that
the caller's first frame lands where the reference puts it.  What the prompt leaves is
``PromptState``: independent of the session, so one state serves every call with that persona.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np

from duplexrt.backends.moshi import sampling
from duplexrt.backends.moshi.internals import streaming_state
from duplexrt.backends.moshi.persona import PromptFrames
from duplexrt.backends.moshi.rows import StateField, streaming_fields

MODES = ("batch", "frames")
#: The seam's draw uses this counter of the session's stream: never a step's (those count from 0).
SEAM_COUNTER = (1 << 31) - 1
#: Per-row fields of the temporal transformer's streaming state a prompt writes.
_PROMPT_FIELDS = ("offsets", "offset", "kv_cache.end_offset", "kv_cache.cache")


@contextlib.contextmanager
def lane(module: Any, batch: int = 1) -> Iterator[None]:
    """``module`` streaming on a fresh state of ``batch`` rows for the duration; its own state
    (the shared batch's) is put back after, the very same objects."""
    shared = module.get_streaming_state()
    module.set_streaming_state({name: None for name in shared})
    try:
        with module.streaming(batch):
            yield
    finally:
        module.set_streaming_state(shared)


def embed_columns(lm: Any, columns: Any) -> Any:
    """The temporal transformer's input for token ``columns`` (``(1, K, T)``): the codebooks'
    embeddings summed in the order ``LMModel.forward_text`` sums them (audio, then text), so a
    position reads exactly what a step would give it."""
    total = None
    for cb in range(lm.num_audio_codebooks):
        emb = lm.emb[cb](columns[:, cb + lm.audio_offset])
        total = emb if total is None else total + emb
    text = lm.text_emb(columns[:, 0])
    return text if total is None else total + text


@attrs.frozen(eq=False)
class PromptState:
    """What a prompt leaves: each prompt field of the temporal transformer's streaming state for
    one row (K/V for the prompt's positions only), the seam's output, and the token columns the
    conversation starts from.  Device tensors; shared by every row it is copied into."""

    #: ``StateField.name`` -> the row's value (``kv_cache.cache``: ``(2, heads, positions, dim)``).
    fields: dict[str, Any]
    positions: int
    #: The seam position's transformer output (``(1, 1, dim)``) and text logits (``(1, 1, 1, V)``).
    seam_out: Any
    seam_text_logits: Any
    #: Token columns at the seam and after it (``(K,)`` each, int64 on the host).
    seam_column: np.ndarray
    after_column: np.ndarray

    @property
    def nbytes(self) -> int:
        tensors = [*self.fields.values(), self.seam_out, self.seam_text_logits]
        return int(sum(t.numel() * t.element_size() for t in tensors))


def _prompt_fields(lm: Any) -> list[StateField]:
    return [f for f in streaming_fields({"transformer": lm.transformer})
            if f.kind == "tensor" and f.field in _PROMPT_FIELDS]


def run(lm: Any, frames: PromptFrames, mode: str = "batch") -> PromptState:
    """``frames`` through the temporal transformer in a lane (see the module docstring)."""
    import torch

    if mode not in MODES:
        raise ValueError(f"prefill mode {mode!r}: one of {', '.join(MODES)}")
    device = next(lm.parameters()).device
    columns = torch.from_numpy(np.ascontiguousarray(frames.columns))[None].to(device)
    inputs = torch.cat([frames.voice.embeddings[None].to(device=device, dtype=lm.dtype),
                        embed_columns(lm, columns)], dim=1)
    positions = int(inputs.shape[1])
    with torch.no_grad(), lane(lm.transformer):
        if mode == "batch":
            out = lm.transformer(inputs)[:, -1:]
        else:
            for i in range(positions):
                out = lm.transformer(inputs[:, i:i + 1])
        if lm.out_norm:
            out = lm.out_norm(out)
        text_logits = lm.text_linear(out)[:, None]
        fields = {}
        for item in _prompt_fields(lm):
            value = item.value()
            if item.field == "kv_cache.cache":
                fields[item.name] = value[:, 0, :, :positions].clone()
            else:
                fields[item.name] = value[0].clone()
    return PromptState(fields, positions, out, text_logits, frames.columns[:, -1].copy(), frames.after.copy())


def install(lm: Any, lm_gen: Any, row: int, state: PromptState, seam_tokens: tuple[int, int]) -> None:
    """``state`` into ``row`` of the shared batch (just reset: its K/V ring beyond the prompt is
    a fresh row's zeros), the seam's sampled text and first audio token with it, so that the
    row's next step reads the position after the seam."""
    positions = state.positions
    for item in _prompt_fields(lm):
        value = item.value()
        saved = state.fields[item.name]
        if item.field == "kv_cache.cache":
            value[:, row, :, :positions].copy_(saved)
        else:
            value[row] = saved
    gen = streaming_state(lm_gen)
    if gen is None:
        raise RuntimeError("the rows are not allocated: LMGen is not streaming")
    cache = gen.cache
    ring = cache.shape[2]
    after = state.after_column.copy()
    after[0], after[1] = seam_tokens
    import torch

    ungenerated = torch.full((cache.shape[1],), int(lm_gen.lm_model.ungenerated_token_id), dtype=cache.dtype)
    cache[row, :, (positions - 1) % ring] = torch.from_numpy(state.seam_column).to(cache.device)
    cache[row, :, positions % ring] = torch.from_numpy(after).to(cache.device)
    cache[row, :, (positions + 1) % ring] = ungenerated.to(cache.device)
    gen.offsets[row] = positions


def sample_seam(lm: Any, lm_gen: Any, state: PromptState, key: int, widths: list[int]) -> tuple[int, int]:
    """The conversation's first text token and first audio token, sampled from the seam as
    ``LMGen`` samples a step (its temperatures, its top-k, the depformer's first codebook) from
    the session's own stream (``SEAM_COUNTER``), or by argmax when sampling is off."""
    import torch

    import moshi.models.lm as lm_module

    device = state.seam_out.device
    sampler = None
    if lm_gen.use_sampling:
        sampler = sampling.RowSampler(1, device, widths)
        sampler.keys.fill_(key)
        sampler.counters.fill_(SEAM_COUNTER)
    with torch.no_grad(), sampling.active(sampler):
        text = lm_module.sample_token(state.seam_text_logits.float(), lm_gen.use_sampling, lm_gen.temp_text,
                                      lm_gen.top_k_text)[:, 0, 0]
        with lm.depformer.streaming(1):
            logits = lm.forward_depformer(0, text[:, None, None], state.seam_out)
        audio = lm_module.sample_token(logits.float(), lm_gen.use_sampling, lm_gen.temp, lm_gen.top_k)[:, 0, 0]
    return int(text[0]), int(audio[0])
