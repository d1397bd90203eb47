"""Backends: the models the scheduler thread steps.  ``create_backend`` picks one by name."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from duplexrt.backends.base import CHOSEN_AT_LOAD, Backend, BackendInfo, SlotChoice, SlotSession
from duplexrt.config import Config, ConfigError


def _echo(info: BackendInfo, options: Mapping[str, Any]) -> Backend:
    from duplexrt.backends.echo import EchoBackend

    return EchoBackend(info, options)


def _synthetic(info: BackendInfo, options: Mapping[str, Any]) -> Backend:
    from duplexrt.backends.synthetic import SyntheticBackend

    return SyntheticBackend(info, options)


def _moshi(info: BackendInfo, options: Mapping[str, Any]) -> Backend:
    from duplexrt.backends.optional import check_installed

    check_installed()  # before torch is imported or the model thread starts: one clear error
    from duplexrt.backends.moshi import MoshiBackend

    return MoshiBackend(info, options)


BACKENDS: dict[str, Callable[[BackendInfo, Mapping[str, Any]], Backend]] = {
    "echo": _echo,
    "synthetic": _synthetic,
    "moshi": _moshi,
}


def create_backend(config: Config) -> Backend:
    """Build (but do not load) the configured backend; bad options raise ConfigError."""
    factory = BACKENDS.get(config.backend.name)
    if factory is None:
        raise ConfigError(
            f"backend.name must be one of {', '.join(sorted(BACKENDS))}; got {config.backend.name!r}"
        )
    slots = config.runtime.slots  # an int, or "auto" (AUTO_SLOTS): the only string the config takes
    info = BackendInfo(
        name=config.backend.name,
        sample_rate=config.audio.sample_rate,
        frame_size=config.audio.frame_size,
        slots=slots if isinstance(slots, int) else CHOSEN_AT_LOAD,
        capacity_margin=config.runtime.capacity_margin,
        max_session_seconds=config.runtime.max_session_seconds,
    )
    return factory(info, config.backend.options)


__all__ = ["Backend", "BackendInfo", "SlotChoice", "SlotSession", "create_backend", "BACKENDS", "CHOSEN_AT_LOAD"]
