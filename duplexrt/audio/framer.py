"""Cut a stream of variable-sized sample chunks into fixed-size model frames.

The model consumes exactly ``frame_size`` samples per step (1920 = 80 ms at
24 kHz) while clients send whatever their audio stack produces.  The framer
bridges the two with as little copying as possible: frames lying entirely
inside an incoming chunk are returned as views of it, and only the frame that
straddles a chunk boundary is assembled into a fresh array.  The leftover
tail is kept in a buffer allocated once, so steady-state operation allocates
nothing beyond the frames that genuinely need new memory.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Framer"]

# numpy's builtin dtypes are singletons: an identity test is the cheapest check.
_FLOAT32 = np.dtype(np.float32)


class Framer:
    """Stateful splitter of float32 chunks into frames of ``frame_size`` samples.

    Frames returned by :meth:`push` are either views of the pushed chunk
    (zero copy; the caller must not modify the chunk while frames are in use)
    or freshly allocated arrays, never views of the internal carry buffer,
    so consumers may keep them as long as they like.

    Not thread-safe.
    """

    __slots__ = ("_frame_size", "_carry", "_pending")

    def __init__(self, frame_size: int) -> None:
        if isinstance(frame_size, bool) or not isinstance(frame_size, int) or frame_size <= 0:
            raise ValueError(f"frame_size must be a positive integer, got {frame_size!r}")
        self._frame_size = frame_size
        # A carried remainder is always shorter than a frame.
        self._carry = np.empty(frame_size, dtype=np.float32)
        self._pending = 0

    @property
    def frame_size(self) -> int:
        return self._frame_size

    @property
    def pending(self) -> int:
        """Samples carried over, waiting for the rest of their frame."""
        return self._pending

    def push(self, samples: np.ndarray) -> list[np.ndarray]:
        """Add a chunk; return every frame it completes (possibly none)."""
        if samples.dtype is not _FLOAT32:
            samples = samples.astype(np.float32)
        if samples.ndim != 1:
            raise ValueError(f"expected 1-D samples, got shape {samples.shape}")
        size = self._frame_size
        pending = self._pending
        count = samples.shape[0]
        if count == size and not pending:  # a client that sends one frame per message
            return [samples]
        carry = self._carry

        if pending + count < size:  # still no complete frame: just stash
            if count:  # (decoders often return nothing; skip the no-op copy)
                carry[pending : pending + count] = samples
                self._pending = pending + count
            return []

        frames: list[np.ndarray] = []
        start = 0
        if pending:
            # The straddling frame is new memory: the carry buffer is reused.
            start = size - pending
            frame = np.empty(size, dtype=np.float32)
            frame[:pending] = carry[:pending]
            frame[pending:] = samples[:start]
            frames.append(frame)

        end = count - (count - start) % size
        # Plain slices: cheaper than reshaping to 2-D and iterating the rows.
        frames += [samples[i : i + size] for i in range(start, end, size)]

        rest = count - end
        if rest:  # even an empty slice assignment costs as much as a frame
            carry[:rest] = samples[end:]
        self._pending = rest
        return frames

    def flush(self) -> np.ndarray | None:
        """Return the carried partial frame zero-padded to full size, or None if empty."""
        pending = self._pending
        if not pending:
            return None
        frame = np.zeros(self._frame_size, dtype=np.float32)
        frame[:pending] = self._carry[:pending]
        self._pending = 0
        return frame

    def clear(self) -> None:
        """Discard any carried samples (e.g. when the client interrupts)."""
        self._pending = 0

    def __repr__(self) -> str:
        return f"Framer(frame_size={self._frame_size}, pending={self._pending})"
