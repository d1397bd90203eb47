"""A loaded speech-to-text model: what the transcriber steps, and the two numbers that place its
text on the caller's timeline.

Kyutai's STT checkpoints say in ``config.json``'s ``stt_config`` how far their text lags the audio
(``audio_delay_seconds``: 0.5 s for ``kyutai/stt-1b-en_fr``, 2.5 s for ``kyutai/stt-2.6b-en``) and
how much silence their own inference feeds before the audio (``audio_silence_prefix_seconds``).
Both are read here; a setting may override the delay (a model trained on another shift).
"""

from __future__ import annotations

from typing import Any

import attrs

from duplexrt.config import ConfigError, TranscriberConfig
from duplexrt.transcribe.pieces import frames_for

#: What Kyutai's own inference assumes when a checkpoint's ``stt_config`` says nothing.
DEFAULT_DELAY_SECONDS = 0.5
DEFAULT_PREFIX_SECONDS = 0.0


@attrs.frozen
class SttModel:
    """Mimi, the LM, the tokenizer and the STT settings, as loaded."""

    name: str
    mimi: Any
    lm: Any
    tokenizer: Any
    delay_seconds: float
    prefix_seconds: float

    @property
    def frame_rate(self) -> float:
        return float(self.mimi.frame_rate)

    @property
    def delay_frames(self) -> int:
        """Silent frames that bring out the text of a stream's last audio (rounded up)."""
        return frames_for(self.delay_seconds, self.frame_rate)

    @property
    def prefix_frames(self) -> int:
        """Silent frames fed to a row before its caller's first frame."""
        return frames_for(self.prefix_seconds, self.frame_rate)


def load_model(config: TranscriberConfig) -> SttModel:
    """The model ``config`` names: ``stt-tiny`` (``tiny = true``, seeded) or a checkpoint (a
    directory in Kyutai's layout, or a Hugging Face repository id in the local cache)."""
    import torch

    from duplexrt.backends.moshi.env import import_moshi

    models = import_moshi(config.device)
    from duplexrt.backends.moshi.model import torch_dtype

    dtype = torch_dtype(torch, config.dtype, config.device)
    if config.tiny:
        from duplexrt.transcribe.tiny import NAME, build_tiny_stt

        mimi, lm, tokenizer, stt = build_tiny_stt(config.seed, device=config.device, dtype=dtype)
        name = NAME
    else:
        from duplexrt.backends.moshi import loading

        try:
            info = loading.resolve(config.checkpoint, models.loaders)
        except ConfigError as exc:  # its words name the backend's keys: these are the transcriber's
            message = str(exc).replace(loading.KEY, "transcriber.checkpoint")
            # Its offline hint offers the backend's tiny model: the transcriber has its own.
            raise ConfigError(message.replace("backend.options.tiny", "transcriber.tiny")) from None
        lm_config = info.lm_config or {}
        if lm_config.get("dep_q", 8) != 0:
            raise ConfigError(f"transcriber.checkpoint = {config.checkpoint!r} is not a speech-to-text model "
                              f"(its LM generates {lm_config.get('dep_q', 8)} audio codebooks; Kyutai's STT "
                              "models generate none: dep_q = 0)")
        mimi = info.get_mimi(device=config.device)
        lm = info.get_moshi(device=config.device, dtype=dtype)
        tokenizer = info.get_text_tokenizer()
        stt = dict(info.stt_config)
        name = str(config.checkpoint)
    lm.eval()
    delay = config.delay_seconds if config.delay_seconds is not None else float(
        stt.get("audio_delay_seconds", DEFAULT_DELAY_SECONDS))
    prefix = float(stt.get("audio_silence_prefix_seconds", DEFAULT_PREFIX_SECONDS))
    return SttModel(name, mimi, lm, tokenizer, delay, prefix)
