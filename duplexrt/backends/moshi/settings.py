"""The ``moshi`` backend's options (``backend.options``), checked once, before anything loads:
every mistake is a ConfigError naming the option and what it takes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from duplexrt.backends.base import number_option, take_options
from duplexrt.backends.moshi import loading, ring
from duplexrt.config import ConfigError

NAME = "moshi"
MODEL_SAMPLE_RATE = 24000
MODEL_FRAME_SIZE = 1920
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: Full-size architectures the backend can build with seeded random weights (``random = NAME``).
RANDOM_ARCHITECTURES = ("moshi-7b",)

#: The role prompt a caller who sets none gets (NVIDIA's own example prompt's opening).
DEFAULT_INSTRUCTIONS = "You are a wise and friendly teacher. Answer questions or provide advice in a clear and engaging way."

#: How a step is sized (``backend.options.batch``; see ``buckets``).
BATCH_MODES = ("buckets", "fixed")

#: Unset sampling options (None) take the checkpoint's ``lm_gen_config``, else LMGen's defaults.
DEFAULTS: dict[str, Any] = {
    "checkpoint": "",
    "tiny": False,
    "random": "",
    "seed": 0,
    "device": "cpu",
    "dtype": "auto",
    "temp": None,
    "temp_text": None,
    "top_k": None,
    "top_k_text": None,
    "greedy": None,
    "cfg_coef": None,
    "warmup_steps": 4,
    "flush_frames": None,
    "context_seconds": None,
    "beyond_context": "end",
    "batch": "buckets",
    # PersonaPlex: a voice and a role prompt per call (see ``persona``).
    "persona": False,
    "voices": "",
    "voice": "",
    "instructions": DEFAULT_INSTRUCTIONS,
    "max_prompt_tokens": 384,
    "prompt_cache_mb": 2048,
    "prefill": "batch",
}

#: Steps fed after a caller's input ends, by default, for a Hibiki model: the translation lags
#: the speech by a few seconds, and the model is given 6 s to finish it.
HIBIKI_FLUSH_FRAMES = 75


def _bool_option(options: Mapping[str, Any], key: str) -> bool | None:
    value = options[key]
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"backend.options.{key} for {NAME} must be true or false, got {value!r}")
    return value


def _optional_number(options: Mapping[str, Any], key: str, low: float, high: float,
                     *, integer: bool = False) -> float | None:
    if options[key] is None:
        return None
    return number_option(NAME, options, key, low, high, integer=integer)


def _string_option(options: Mapping[str, Any], key: str) -> str:
    value = options[key]
    if not isinstance(value, str):
        raise ConfigError(f"backend.options.{key} for {NAME} must be a string, got {value!r}")
    return value


@attrs.frozen
class MoshiSettings:
    """The validated options."""

    checkpoint: str
    tiny: bool
    seed: int
    device: str
    dtype: str
    temp: float | None
    temp_text: float | None
    top_k: int | None
    top_k_text: int | None
    greedy: bool | None
    cfg_coef: float | None
    warmup_steps: int
    #: None: from the model's type (``HIBIKI_FLUSH_FRAMES`` for Hibiki, else 0).
    flush_frames: int | None
    #: A full-size architecture with seeded random weights built on the device (``moshi-7b``):
    #: real step costs with nothing downloaded.  Empty: a checkpoint or the tiny model.
    random: str = ""
    #: Seconds of a call each row's K/V ring holds (None: the model's own context; see ``ring``).
    context_seconds: float | None = None
    #: ``"end"``: a call ends with ``length`` at the ring's end; ``"slide"``: it forgets beyond it.
    beyond_context: str = "end"
    #: ``"buckets"``: a step runs the smallest bucket of rows covering the active calls (a call's
    #: output may differ by rounding with its neighbours); ``"fixed"``: every step runs the whole
    #: batch, masked, and a call's output is bit for bit its own (see ``buckets``).
    batch: str = "buckets"
    #: The model takes a persona (PersonaPlex): a voice and a role prompt stepped before each call.
    persona: bool = False
    #: The voices' folder ("": the checkpoint's ``voices/``, or the tiny model's made voices).
    voices: str = ""
    #: The voice and the role prompt of a caller who sets neither ("" voice: the first listed).
    voice: str = ""
    instructions: str = DEFAULT_INSTRUCTIONS
    #: The longest role prompt taken, in tokens with the system tags.
    max_prompt_tokens: int = 384
    #: Device memory for prompt states kept for the next caller with the same persona.
    prompt_cache_mb: float = 2048
    #: ``"batch"``: a prompt read in one forward; ``"frames"``: one forward per frame (reference).
    prefill: str = "batch"

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> MoshiSettings:
        opts = take_options(NAME, options, DEFAULTS)
        checkpoint = _string_option(opts, "checkpoint").strip()
        tiny = bool(_bool_option(opts, "tiny"))
        random = _string_option(opts, "random").strip()
        if random and random not in RANDOM_ARCHITECTURES:
            raise ConfigError(f"backend.options.random for {NAME} must be one of "
                              f"{', '.join(RANDOM_ARCHITECTURES)} (or empty), got {random!r}")
        if sum((bool(checkpoint), tiny, bool(random))) > 1:
            raise ConfigError(f"backend.options.checkpoint ({checkpoint!r}), tiny = {str(tiny).lower()} and "
                              f"random = {random!r} each choose a model for {NAME}: set only one")
        if not tiny and not checkpoint and not random:
            raise ConfigError(f"backend.options.checkpoint is required for {NAME}: a local checkpoint "
                              "directory or a Hugging Face repo id (or set backend.options.tiny = true)")
        device = _string_option(opts, "device").strip()
        if device != "cpu" and not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
            raise ConfigError(f"backend.options.device for {NAME} must be \"cpu\", \"cuda\" or \"cuda:N\", "
                              f"got {device!r}")
        if device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(f"backend.options.device = {device!r}, but torch sees no CUDA device here")
        dtype = _string_option(opts, "dtype")
        if dtype not in DTYPES:
            raise ConfigError(f"backend.options.dtype for {NAME} must be one of {', '.join(DTYPES)}; got {dtype!r}")
        if checkpoint and loading.looks_like_path(checkpoint):
            from pathlib import Path

            path = Path(checkpoint.removeprefix("file://")).expanduser()
            if not path.is_dir():
                raise ConfigError(f"backend.options.checkpoint: no checkpoint directory at {path.resolve()}")
        return cls(
            checkpoint=checkpoint,
            tiny=tiny,
            seed=int(number_option(NAME, opts, "seed", 0, 2**63 - 1, integer=True)),
            device=device,
            dtype=dtype,
            temp=_optional_number(opts, "temp", 0, 100),
            temp_text=_optional_number(opts, "temp_text", 0, 100),
            top_k=_none_or_int(_optional_number(opts, "top_k", 0, 1 << 20, integer=True)),
            top_k_text=_none_or_int(_optional_number(opts, "top_k_text", 0, 1 << 20, integer=True)),
            greedy=_bool_option(opts, "greedy"),
            cfg_coef=_optional_number(opts, "cfg_coef", 0, 100),
            warmup_steps=int(number_option(NAME, opts, "warmup_steps", 0, 1000, integer=True)),
            flush_frames=_none_or_int(_optional_number(opts, "flush_frames", 0, 10000, integer=True)),
            random=random,
            context_seconds=_optional_number(opts, "context_seconds", 0, 7 * 24 * 3600),
            beyond_context=ring.check_beyond_context(opts["beyond_context"]),
            batch=_batch_option(opts),
            **_persona_options(opts),
        )


def _batch_option(opts: Mapping[str, Any]) -> str:
    batch = _string_option(opts, "batch")
    if batch not in BATCH_MODES:
        raise ConfigError(f"backend.options.batch for {NAME} must be \"buckets\" (steps sized to the active calls, "
                          f"the default) or \"fixed\" (every step the whole batch: a call's output bit for bit its "
                          f"own whoever shares the step), got {batch!r}")
    return batch


def _none_or_int(value: float | None) -> int | None:
    return None if value is None else int(value)


def _persona_options(opts: Mapping[str, Any]) -> dict[str, Any]:
    persona = bool(_bool_option(opts, "persona"))
    voices = _string_option(opts, "voices").strip()
    if voices:
        from pathlib import Path

        folder = Path(voices).expanduser()
        if not folder.is_dir():
            raise ConfigError(f"backend.options.voices: no voices folder at {folder.resolve()}")
    prefill = _string_option(opts, "prefill")
    if prefill not in ("batch", "frames"):
        raise ConfigError(f"backend.options.prefill for {NAME} must be \"batch\" or \"frames\", got {prefill!r}")
    if not persona:
        touched = [key for key in ("voices", "voice") if opts[key]]
        if touched:
            raise ConfigError(f"backend.options.{touched[0]} is for a model that takes a persona: set "
                              "backend.options.persona = true (PersonaPlex)")
    return {
        "persona": persona,
        "voices": voices,
        "voice": _string_option(opts, "voice").strip().removesuffix(".pt"),
        "instructions": _string_option(opts, "instructions"),
        "max_prompt_tokens": int(number_option(NAME, opts, "max_prompt_tokens", 1, 100_000, integer=True)),
        "prompt_cache_mb": float(number_option(NAME, opts, "prompt_cache_mb", 0, 1 << 24)),
        "prefill": prefill,
    }
