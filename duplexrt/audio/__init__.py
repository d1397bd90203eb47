"""Audio I/O for duplexrt: wire formats in and out, resampling, model framing.

Inside the runtime all audio is float32 mono at the model's sample rate; this
package is the boundary where client formats (raw PCM, G.711, Ogg Opus, at
various rates) are converted to and from that representation, and where
the resulting sample stream is cut into the fixed-size frames the model steps
on.  Everything here runs per message on the serving hot path, so the cheap
formats are single vectorised numpy passes with no per-call dispatch.
"""

from .errors import AudioFormatError, AudioTooLongError
from .formats import Decoder, Encoder, make_decoder, make_encoder
from .framer import Framer
from .resample import StreamResampler
from .spec import OPUS_RATES, SUPPORTED_INPUT_RATES, AudioFormat, AudioSpec

__all__ = [
    "OPUS_RATES",
    "SUPPORTED_INPUT_RATES",
    "AudioFormat",
    "AudioFormatError",
    "AudioTooLongError",
    "AudioSpec",
    "Decoder",
    "Encoder",
    "Framer",
    "StreamResampler",
    "make_decoder",
    "make_encoder",
]
