"""What ``load`` builds once, before any row: the weights, the tokenizer and LMGen's settings.

A model comes from one of four places (``backend.options``): a checkpoint in Kyutai's layout (a
directory, or a repository through the hub cache), NVIDIA's PersonaPlex layout (``persona``), a
full-size architecture with seeded random weights (``random``: real step costs, nothing
downloaded), or the tiny seeded model (``tiny``: tests and a CPU demo).  Whatever its source, what
the backend will serve is checked here, before a row is allocated and minutes before a first
caller: Mimi's clock must be the audio's, the model must generate audio, and a sampling option
that a checkpoint's ``lm_gen_config`` carries but ``LMGen`` does not take is dropped with a
warning, not passed on to fail at the first step.  The model is built once: a backend that sizes
its rows again (``"auto"``, ``resize``) keeps it.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import attrs

from duplexrt.backends.base import BackendInfo
from duplexrt.backends.moshi import loading, personaplex, ring
from duplexrt.backends.moshi.env import import_moshi
from duplexrt.backends.moshi.settings import NAME, MoshiSettings
from duplexrt.config import ConfigError

log = logging.getLogger("duplexrt.backends.moshi")


@attrs.frozen
class BuiltModel:
    """What ``build`` made, kept to allocate the rows (again, while ``"auto"`` times sizes)."""

    models: Any
    torch: Any
    mimi: Any
    lm: Any
    tokenizer: Any
    model_type: str
    gen_config: dict[str, Any]
    cfg_coef: float
    #: The temporal transformer's context as built, before any ring was applied to it.
    model_positions: int
    #: PersonaPlex's voices as its checkpoint ships them (None: the tiny model's, made locally).
    voices_folder: Any = None


def torch_dtype(torch: Any, name: str, device: str) -> Any:
    """The weights' dtype ``name`` on ``device``: ``auto`` is bfloat16 on a GPU, float32 on a CPU."""
    if name == "auto":
        name = "bfloat16" if device.startswith("cuda") else "float32"
    return getattr(torch, name)


def load_weights(settings: MoshiSettings, models: Any, torch: Any) -> tuple[Any, Any, Any, str, dict[str, Any], Any]:
    """``(mimi, lm, tokenizer, model type, the checkpoint's lm_gen_config, voices folder)``."""
    dtype = torch_dtype(torch, settings.dtype, settings.device)
    device = settings.device
    if settings.persona:
        if settings.tiny:
            mimi, lm, tokenizer = personaplex.build_tiny_personaplex(settings.seed, device=device, dtype=dtype)
            return mimi, lm, tokenizer, "personaplex", {}, None
        if settings.random:
            raise ConfigError("backend.options.random builds Moshi's shape, not PersonaPlex's voices: "
                              "use tiny = true or a PersonaPlex checkpoint with persona = true")
        directory = loading.personaplex_directory(settings.checkpoint)
        mimi, lm, tokenizer, voices = personaplex.load_checkpoint(directory, device=device, dtype=dtype)
        return mimi, lm, tokenizer, "personaplex", {}, voices
    if settings.random:
        from duplexrt.backends.moshi.tiny import build_random

        mimi, lm, tokenizer = build_random(settings.random, settings.seed, device=device, dtype=dtype)
        return mimi, lm, tokenizer, "moshi", {}, None
    if settings.tiny:
        from duplexrt.backends.moshi.tiny import build_tiny

        conditioned = settings.cfg_coef is not None and settings.cfg_coef != 1.0
        mimi, lm, tokenizer = build_tiny(settings.seed, device=device, dtype=dtype, conditioned=conditioned)
        return mimi, lm, tokenizer, "hibiki" if conditioned else "moshi", {}, None
    info = loading.resolve(settings.checkpoint, models.loaders)
    mimi = info.get_mimi(device=device)
    lm = info.get_moshi(device=device, dtype=dtype)
    return mimi, lm, info.get_text_tokenizer(), info.model_type, dict(info.lm_gen_config), None


def build(settings: MoshiSettings, info: BackendInfo, torch: Any) -> BuiltModel:
    """The model ``settings`` name, checked against ``info``'s audio clock, with LMGen's settings:
    the checkpoint's, overridden by the options that are set."""
    models = import_moshi(settings.device)
    mimi, lm, tokenizer, model_type, gen_config, voices = load_weights(settings, models, torch)
    if mimi.sample_rate != info.sample_rate or mimi.frame_size != info.frame_size:
        raise ConfigError(f"audio.sample_rate / audio.frame_size ({info.sample_rate}, {info.frame_size}) differ "
                          f"from the model's ({mimi.sample_rate}, {mimi.frame_size})")
    if lm.dep_q == 0:
        raise ConfigError(f"this checkpoint generates no audio (dep_q = 0): the {NAME} backend "
                          "serves speech-to-speech models only")
    cfg_coef = settings.cfg_coef if settings.cfg_coef is not None else float(gen_config.pop("cfg_coef", 1.0))
    gen_config.pop("cfg_coef", None)
    if settings.greedy is not None:
        gen_config["use_sampling"] = not settings.greedy
    for key in ("temp", "temp_text", "top_k", "top_k_text"):
        value = getattr(settings, key)
        if value is not None:
            gen_config[key] = value
    accepted = inspect.signature(models.LMGen).parameters
    for key in [k for k in gen_config if k not in accepted or k in ("lm_model", "condition_tensors")]:
        log.warning("ignoring %r from the checkpoint's lm_gen_config: LMGen takes no such argument", key)
        del gen_config[key]
    return BuiltModel(models, torch, mimi, lm, tokenizer, model_type, gen_config, cfg_coef,
                      ring.model_context(lm), voices)


def conditions(lm: Any, model_type: str, cfg_coef: float, slots: int) -> Any:
    """Condition tensors for a conditioned model (Hibiki's "description") over ``slots`` rows,
    with the negative half CFG needs; None for an unconditioned one."""
    provider = lm.condition_provider
    if provider is None or not provider.conditioners:
        if cfg_coef != 1.0:
            raise ConfigError(f"backend.options.cfg_coef = {cfg_coef:g}, but this model has no "
                              "conditioning to guide: leave cfg_coef at 1")
        return None
    if model_type != "hibiki":
        raise ConfigError(f"this {model_type!r} checkpoint expects conditioning the {NAME} backend "
                          "only knows how to give Hibiki models")
    from moshi.conditioners import ConditionAttributes

    attributes = [ConditionAttributes(text={"description": "very_good"}, tensor={}) for _ in range(slots)]
    if cfg_coef != 1.0:
        attributes += [ConditionAttributes(text={"description": "very_bad"}, tensor={}) for _ in range(slots)]
    return provider.prepare_and_provide(attributes)


__all__ = ["BuiltModel", "build", "conditions", "load_weights", "torch_dtype"]
