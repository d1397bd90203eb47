"""Sizing the slots before any weight is built: a slot count that cannot fit is refused in a second.

Building a 7B model takes minutes (on a CPU, many), and only then did the load find that the
slots asked for cannot fit beside it.  Yet the weights and what one slot holds are known from the
model's configuration alone: the architecture built on PyTorch's ``meta`` device allocates nothing
(as ``tests/test_gpu_sizing.py`` checks the presets).  ``before_building`` builds it there, sizes
the K/V ring as the load will, and compares the slots asked for with what fits the device's free
memory less the weights, by the load's own arithmetic (``memory``).  It can only refuse sooner:
the free memory after a real build is no more than this, so the check after the build stays, and
decides.

Where the configuration cannot be known without the weights, nothing is checked early: the tiny
models (built in a second anyway), PersonaPlex (its prompt lane and cache come first), a hub
repository whose config.json is not in the local cache.  Any failure to build on ``meta`` leaves
the decision to the check after the build.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import attrs

from duplexrt.backends.moshi import memory, ring

log = logging.getLogger("duplexrt.backends.moshi")

#: Kyutai's Moshi 7B repositories carry no config.json: the package's own 7B configuration is theirs.
_MOSHI_7B = re.compile(r"^kyutai/moshi(ko|ka)-")
#: Keys of a checkpoint's config.json that are not the LM's arguments (as ``CheckpointInfo`` pops them).
_NOT_LM = ("moshi_name", "mimi_name", "mimi_config_name", "tokenizer_name", "lora_name", "model_type",
           "lm_gen_config", "tts_config", "stt_config", "model_id")


@attrs.frozen
class Early:
    """What the configuration says, before anything is built."""

    slot_bytes: memory.SlotBytes
    weights: int
    ring: ring.Ring
    #: The device's free memory less the weights (None: unknown, nothing to refuse by).
    after_weights: memory.DeviceMemory | None
    fit: int | None


def _config(settings: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None, Path | None] | None:
    """``(raw config.json or None for the package's 7B, mimi config or None, its folder)`` of the
    checkpoint; None where it cannot be known without fetching."""
    spec = str(settings.checkpoint or "")
    path = Path(spec.removeprefix("file://")).expanduser()
    folder: Path | None = None
    if path.is_dir():
        folder = path
    else:
        # A hub repository: its config.json from the local cache, else (small) from the hub where it
        # answers, before the weights' download.  Where neither, the load says why it cannot fetch.
        from huggingface_hub import hf_hub_download

        from duplexrt.backends.moshi import loading

        def cached(name: str) -> Path | None:
            try:
                return Path(hf_hub_download(spec, name, local_files_only=True))
            except Exception:  # noqa: BLE001 - not cached
                return None

        if _MOSHI_7B.match(spec):
            if cached("model.safetensors") is None and loading.hub_offline_reason() is not None:
                return None
            folder = None
        else:
            config = cached("config.json")
            if config is None:
                if loading.hub_offline_reason() is not None:
                    return None
                try:
                    config = Path(hf_hub_download(spec, "config.json"))
                except Exception:  # noqa: BLE001 - no such repository or file: the load says so
                    return None
            folder = config.parent
    if folder is None:
        return None, None, None  # Kyutai's Moshi 7B: the package's own configuration
    config_path = folder / "config.json"
    if not config_path.is_file():
        return None, None, folder  # a directory in the legacy layout: Moshi 7B's names and configuration
    raw = json.loads(config_path.read_text())
    mimi_name = raw.get("mimi_config_name")
    mimi = json.loads((folder / Path(str(mimi_name)).name).read_text()) if mimi_name else None
    return raw, mimi, folder


def architecture(settings: Any, dtype: Any) -> tuple[Any, Any, bool] | None:
    """``(mimi, lm, guided)`` on the ``meta`` device, from the configuration alone; None where it
    cannot be known without the weights."""
    from moshi.models import loaders

    if settings.persona or settings.tiny:
        return None
    if settings.random:
        if settings.random != "moshi-7b":
            return None
        raw: dict[str, Any] | None = None
        mimi_config = None
    elif settings.checkpoint:
        found = _config(settings)
        if found is None:
            return None
        raw, mimi_config, _ = found
    else:
        return None
    lm_config = None if raw is None else {k: v for k, v in raw.items() if k not in _NOT_LM}
    codebooks = 8 if lm_config is None else max(lm_config["dep_q"], lm_config["n_q"] - lm_config["dep_q"])
    if raw is not None and (raw.get("tts_config") or {}).get("multistream"):
        codebooks //= 2
    mimi = loaders.get_mimi(None, mimi_config, device="meta", num_codebooks=codebooks)
    lm = loaders.get_moshi_lm(None, lm_kwargs=lm_config, device="meta", dtype=dtype)
    cfg_coef = settings.cfg_coef
    if cfg_coef is None:
        cfg_coef = float(((raw or {}).get("lm_gen_config") or {}).get("cfg_coef", 1.0))
    return mimi, lm, cfg_coef != 1.0


def before_building(settings: Any, dtype: Any, *, max_session_seconds: float,
                    memory_source: memory.MemorySource) -> Early | None:
    """The slots that fit, from the configuration on the ``meta`` device and the device's free
    memory now (before the weights); None where the configuration is not known without them."""
    try:
        built = architecture(settings, dtype)
    except Exception as exc:  # noqa: BLE001 - the check after the build decides
        log.debug("moshi backend: no early sizing (%s: %s)", type(exc).__name__, exc)
        return None
    if built is None:
        return None
    mimi, lm, guided = built
    chosen = ring.choose(settings.context_seconds, settings.beyond_context, ring.model_context(lm),
                         mimi.frame_rate, max_session_seconds=max_session_seconds)
    ring.apply(lm, chosen)
    per = memory.slot_bytes(mimi, lm, guided=guided)
    weights = memory.weight_bytes(lm, mimi)
    now = memory_source(settings.device)
    if now is None:
        return Early(per, weights, chosen, None, None)
    after = memory.DeviceMemory(max(0, now.free - weights), now.total,
                                f"{now.source}, less {memory.gigabytes(weights)} of weights, from the model's "
                                "configuration before they are built")
    return Early(per, weights, chosen, after, memory.slots_that_fit(per.total, after))
