"""What a ``simulate`` run is asked to do, and the process's own resource usage, read the same
way on both paths.
"""

from __future__ import annotations

import math
import resource

import attrs

from duplexrt.config import Config, ConfigError
from duplexrt.routes import SIMULATE_FORMATS

MODES = ("burst", "paced")

#: The wire format each route takes when ``--format`` is not given.
ROUTE_FORMATS = SIMULATE_FORMATS


@attrs.frozen(kw_only=True)
class SimulateOptions:
    concurrency: int = 96
    frames: int = 512
    message_ms: float = 160.0
    mode: str = "burst"
    format: str = "pcm_f32le"
    #: Wire sample rate; None means the format's default (the model rate; 8 kHz for G.711).
    sample_rate: int | None = None
    warmup_frames: int = 0
    repeat: int = 1
    #: A frame whose output arrives later than this after its input was sent is late (paced).
    late_ms: float = 80.0
    #: Keep every frame's (arrival time, lag) for a plot: memory grows with the run, so only
    #: when asked for.
    keep_samples: bool = False
    #: With ``--url``: the share of sessions whose connection is cut once, mid-stream, without a
    #: Close frame; each resumes on its own (``runtime.resume_window_s``) and the guards check
    #: that no frame was lost or heard twice.
    drop_rate: float = 0.0

    def check(self, config: Config, *, slots: bool = True) -> None:
        """Raise ConfigError for an impossible run.  ``slots=False`` against a server, whose own
        slot count applies (more sessions than slots are refused there, and counted)."""
        if self.mode not in MODES:
            raise ConfigError(f"--mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        for name, value, low in (("--concurrency", self.concurrency, 1), ("--frames", self.frames, 1),
                                 ("--repeat", self.repeat, 1), ("--warmup-frames", self.warmup_frames, 0)):
            if value < low:
                raise ConfigError(f"{name} must be at least {low}, got {value}")
        if slots and isinstance(config.runtime.slots, int) and self.concurrency > config.runtime.slots:
            raise ConfigError(
                f"--concurrency {self.concurrency} exceeds runtime.slots = {config.runtime.slots}; "
                f"raise it with --slots {self.concurrency}"
            )
        if not 0.0 <= self.drop_rate <= 1.0:
            raise ConfigError(f"--drop-rate must be from 0 to 1, got {self.drop_rate}")
        if not 1 <= self.message_ms <= 60_000:
            raise ConfigError(f"--message-ms must be from 1 to 60000, got {self.message_ms}")


@attrs.define
class Usage:
    """This process's CPU seconds and context switches so far (scheduler thread included)."""

    cpu: float
    voluntary: int
    involuntary: int

    @classmethod
    def now(cls) -> Usage:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return cls(ru.ru_utime + ru.ru_stime, ru.ru_nvcsw, ru.ru_nivcsw)


def search_options(options: SimulateOptions, frame_seconds: float, min_seconds: float) -> SimulateOptions:
    """Paced, per-frame lags kept, and ``min_seconds`` of audio per session (``--frames`` does
    not apply: the criterion sets the length)."""
    frames = math.ceil(min_seconds / frame_seconds)
    return attrs.evolve(options, mode="paced", keep_samples=True, frames=frames, repeat=1)
