"""The batched streaming transcriber: one Mimi encoder pass and one ``LMGen`` step over a fixed
batch of rows, stepped by the scheduler thread right after the dialogue model.

It is built like the ``moshi`` backend's own streaming (see ``backends/moshi/backend.py``), and
for the same reasons: one fixed batch of ``slots`` rows streams for the life of the process (fixed
shapes, which is what CUDA graphs need), and a step runs the whole batch under an execution mask
set to the rows that have a frame, so every other row's state (convolution buffers, K/V rings,
offsets, token cache) stays exactly as it was.  A session's transcript is therefore the one the
package's own single-stream inference gives for the same audio, whoever shares the batch.

* **Joining** resets only the joining rows, on the next step (sessions joining together share one
  reset), restores the buffers a package reset leaves behind (``rows``), then feeds those rows the
  model's silence prefix (``stt_config.audio_silence_prefix_seconds``, as Kyutai's inference does
  before the audio) in steps masked to them alone.  The text of those steps is dropped: it is
  about no audio of the caller's.
* **A step** encodes the given rows' frames (their own Mimi pass: the STT model's Mimi may read a
  different number of codebooks than the dialogue model's, and the echo and synthetic backends
  have none) and steps the LM once; each row's token becomes a ``TranscriptPiece`` placed on the
  caller's timeline (``pieces``).
* **Flushing**: the text of the last ``delay`` of a caller's audio comes only after that much more
  audio.  When a row's input ends (``end_input``: the session's end-of-input mark, which is a
  silent frame), the step that carries the mark also runs ``delay_frames - 1`` more silent steps
  for the ending rows alone, so the caller's last words come out before the session ends (the
  same silence Kyutai's inference appends to a file).
* **Greedy**: text is the argmax (``use_sampling = False``), as Kyutai's STT inference runs: a
  transcript is a function of the audio alone.
* **Warm-up and failures**: ``load`` may step every row on silence first (allocation and kernel
  choice then, not in a caller's first step), then makes every row a fresh one again.  A step
  that raises is the scheduler's to report; ``missed`` then keeps the rows' frame counts on
  their callers' timeline.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack

import numpy as np

from duplexrt.config import ConfigError, TranscriberConfig
from duplexrt.transcribe.model import SttModel, load_model
from duplexrt.backends.moshi.rows import RowWiper
from duplexrt.backends.moshi.text import piece_table
from duplexrt.transcribe.pieces import TranscriptPiece
from duplexrt.transcribe.rows import state_bytes

log = logging.getLogger("duplexrt.transcribe")

#: Each row's pieces from one step (``()`` for a row that wrote nothing).
RowPieces = tuple[TranscriptPiece, ...]
NO_PIECES: RowPieces = ()


class Transcriber:
    """A streaming STT model over ``slots`` rows.  Every method runs on the scheduler thread
    (``load`` too), which is the only caller: no locking."""

    def __init__(self, model: SttModel | None = None, slots: int = 0, *,
                 config: TranscriberConfig | None = None) -> None:
        """``model`` as loaded, or None to load the one ``config`` names in ``load`` (on the
        scheduler thread, like the dialogue model); ``slots``: the batch, or 0 to take the
        count ``load`` is given (the dialogue backend may choose its own at load)."""
        if model is None and config is None:
            raise ValueError("a transcriber needs a model or the config that names one")
        self.model = model
        self.config = config
        self.slots = slots
        self.device = config.device if config is not None else "cpu"
        #: ``("transcribe", ns)``: the last step's duration (joins and flushes included).
        self.last_stage: tuple[str, int] = ("transcribe", 0)
        #: Running totals: steps, seconds (wall, and the scheduler thread's CPU inside them), and
        #: the extra masked steps joins and flushes cost.
        self.steps = 0
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.extra_steps = 0
        self._stack: ExitStack | None = None

    # -- loading -------------------------------------------------------------------------------

    @property
    def stt(self) -> SttModel:
        """The model (loaded)."""
        if self.model is None:
            raise RuntimeError("the transcriber is not loaded")
        return self.model

    @property
    def frame_size(self) -> int:
        return int(self.stt.mimi.frame_size)

    @property
    def sample_rate(self) -> int:
        return int(self.stt.mimi.sample_rate)

    def load_weights(self) -> None:
        """The model's weights on its device, before any row: the scheduler loads them ahead of
        the dialogue model, so that the free memory the dialogue model sizes its slots by is what
        is left beside them."""
        if self.model is None:
            assert self.config is not None
            self.model = load_model(self.config)

    def state_bytes_per_slot(self) -> int:
        """What one row's streaming state will hold (Mimi and the LM's K/V, from the loaded
        model's own modules, before any row is allocated): what each of the dialogue model's
        slots needs beside its own, on a shared device."""
        from duplexrt.backends.moshi import memory

        model = self.stt
        return memory.slot_bytes(model.mimi, model.lm, guided=False).total

    def load(self, slots: int | None = None, *, warmup_steps: int = 0) -> None:
        """Load the model if need be (``config``), then start the fixed batch of ``slots`` rows
        streaming (``slots`` given at construction, unless given here), allocate the host
        buffers, and step ``warmup_steps`` times on silence with every row (allocation and
        kernel choice happen then, not in a caller's first step; ``warmup_cost`` is the median
        of those steps), after which every row is a fresh one again."""
        import torch
        from moshi.models import LMGen

        if slots is not None:
            self.slots = slots
        if self.slots < 1:
            raise ValueError("a transcriber needs at least one slot")
        self.load_weights()
        model = self.stt
        slots, frame = self.slots, self.frame_size
        self._torch = torch
        self._lm_gen = LMGen(model.lm, use_sampling=False, temp=0.0, temp_text=0.0, support_out_of_sync=True)
        stack = ExitStack()
        stack.enter_context(model.mimi.streaming(slots))
        stack.enter_context(self._lm_gen.streaming(slots))
        self._stack = stack
        # What a package reset leaves in a row (K/V rings, the token cache), restored on a join:
        # a caller who sent NaN must not reach the next caller on its row.
        self._fresh = RowWiper([model.mimi, self._lm_gen], slots)
        device = torch.device(self.device)
        self._mask_t = torch.zeros(slots, dtype=torch.bool)
        self._mask = self._mask_t.numpy()
        self._pcm_t = torch.zeros((slots, 1, frame), dtype=torch.float32)
        self._pcm = self._pcm_t.numpy()[:, 0, :]
        self._on_device = device.type != "cpu"
        if self._on_device:
            self._mask_dev = torch.zeros(slots, dtype=torch.bool, device=device)
            self._pcm_dev = torch.zeros((slots, 1, frame), dtype=torch.float32, device=device)
        else:
            self._mask_dev, self._pcm_dev = self._mask_t, self._pcm_t
        #: Rows that joined since the last step (reset, then prefixed, before it).
        self._joining = np.zeros(slots, dtype=bool)
        #: Rows whose frame in the next step is their end-of-input mark.
        self._ending = np.zeros(slots, dtype=bool)
        #: Per row: caller frames stepped (the end-of-input mark included), and where its next
        #: audio starts after a flush (ms): text written about a flush's silence goes there.
        self._frames = np.zeros(slots, dtype=np.int64)
        self._floor_ms = np.zeros(slots, dtype=np.float64)
        lm = model.lm
        self._pieces = piece_table(model.tokenizer, lm.text_linear.out_features,
                                   (lm.text_padding_token_id, lm.end_of_text_padding_id))
        self._frame_ms = frame / self.sample_rate * 1e3
        self._delay_ms = model.delay_seconds * 1e3
        #: What one slot's streaming state holds (bytes), the batch's divided by its rows.
        self.slot_bytes = state_bytes([model.mimi, self._lm_gen]) // slots
        if warmup_steps:
            self._warm_up(warmup_steps)
        log.info("transcriber: %s on %s, text %g s behind the audio (%d frames of flush), %g s of silence "
                 "before each call, %d slots, %.2f MB of state a slot, a warm-up step %.1f ms",
                 model.name, self.device, model.delay_seconds, model.delay_frames, model.prefix_seconds, slots,
                 self.slot_bytes / 1e6, self.warmup_cost * 1e3)

    #: Seconds one warm-up step took (median), 0.0 before any: what the scheduler adds to the
    #: backend's own warm-up cost when it seeds the capacity estimate.
    warmup_cost = 0.0

    def _warm_up(self, steps: int) -> None:
        rows = np.arange(self.slots, dtype=np.int64)
        silence = np.zeros((self.slots, self.frame_size), dtype=np.float32)
        costs = []
        for _ in range(steps):
            started = time.perf_counter()
            self.step(rows, silence)
            costs.append(time.perf_counter() - started)
        steady = costs[1:] or costs  # the first step allocates: not what a step costs
        self.warmup_cost = sorted(steady)[len(steady) // 2]
        with self._torch.no_grad():
            everyone = self._torch.ones(self.slots, dtype=self._torch.bool, device=self._mask_dev.device)
            self.stt.mimi.reset_streaming(everyone)
            self._lm_gen.reset_streaming(everyone)
            self._fresh.wipe(self._torch.arange(self.slots, device=self._mask_dev.device))
        self._frames[:] = 0
        self._floor_ms[:] = 0.0
        self._joining[:] = False
        self._ending[:] = False
        self.steps, self.seconds, self.cpu_seconds, self.extra_steps = 0, 0.0, 0.0, 0

    def check_audio(self, sample_rate: int, frame_size: int) -> None:
        """ConfigError unless the dialogue model's frames are the STT model's (the transcriber
        reads the very frames the scheduler steps)."""
        if (sample_rate, frame_size) != (self.sample_rate, self.frame_size):
            raise ConfigError(f"the transcriber's model reads {self.frame_size}-sample frames at {self.sample_rate} Hz; "
                              f"the server steps {frame_size} at {sample_rate} Hz: set audio.sample_rate = "
                              f"{self.sample_rate} and audio.frame_size = {self.frame_size}")

    def close(self) -> None:
        """Stop streaming (the state's memory goes)."""
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    # -- slots ---------------------------------------------------------------------------------

    def open_slot(self, slot: int) -> None:
        """A session takes ``slot``: its row is reset before its first frame."""
        self._joining[slot] = True
        self._ending[slot] = False
        self._frames[slot] = 0
        self._floor_ms[slot] = 0.0

    def close_slot(self, slot: int) -> None:
        """The session left: nothing to do until the next one joins (and resets the row)."""
        self._ending[slot] = False

    def end_input(self, slot: int) -> None:
        """``slot``'s frame in the next step is its end-of-input mark: flush its last words."""
        self._ending[slot] = True

    def missed(self, rows: np.ndarray) -> None:
        """The step of ``rows`` failed: their frames were not transcribed.  Their frame counts
        move on all the same, so that later pieces stay on their callers' timeline, and an
        end-of-input mark in that step is forgotten (its flush is lost with the step)."""
        self._frames[rows] += 1
        self._ending[rows] = False

    # -- stepping ------------------------------------------------------------------------------

    def step(self, rows: np.ndarray, inputs: np.ndarray) -> list[RowPieces]:
        """One frame for each slot in ``rows`` (ascending; ``inputs[i]`` is row ``rows[i]``'s
        frame): the pieces each row's text became, in row order."""
        started = time.perf_counter_ns()
        cpu = time.thread_time_ns()
        with self._torch.no_grad():
            if self._joining.any():
                self._join()
            out: list[RowPieces] = [NO_PIECES] * len(rows)
            self._mask[:] = False
            self._mask[rows] = True
            self._pcm[rows] = inputs
            tokens = self._advance()
            self._collect(rows, tokens, out)
            self._frames[rows] += 1
            if self._ending.any():
                self._flush(rows, out)
        ns = time.perf_counter_ns() - started
        self.last_stage = ("transcribe", ns)
        self.steps += 1
        self.seconds += ns / 1e9
        self.cpu_seconds += (time.thread_time_ns() - cpu) / 1e9
        return out

    def _advance(self) -> np.ndarray:
        """Encode the masked rows' frames in ``_pcm`` and step the LM once: every slot's text
        token (meaningful for the masked rows only)."""
        if self._on_device:
            self._mask_dev.copy_(self._mask_t)
            self._pcm_dev.copy_(self._pcm_t)
        mask = self._mask_dev
        mimi = self.stt.mimi
        mimi.set_exec_mask(mask)
        codes = mimi.encode(self._pcm_dev)
        self._lm_gen.set_exec_mask(mask)
        tokens = self._lm_gen.step(codes)
        assert tokens is not None  # support_out_of_sync: a step always answers
        return tokens[:, 0, 0].cpu().numpy()

    def _collect(self, rows: np.ndarray, tokens: np.ndarray, out: list[RowPieces]) -> None:
        """Each row's token as a piece (silent tokens as nothing), appended to ``out``."""
        table = self._pieces
        limit = len(table)
        ending = self._ending
        for i, (row, token) in enumerate(zip(rows.tolist(), tokens[rows].tolist())):
            text = table[token] if 0 <= token < limit else ""
            if text:
                out[i] = out[i] + (self._piece(row, text, bool(ending[row])),)

    def _piece(self, row: int, text: str, flushed: bool = False) -> TranscriptPiece:
        """``text`` from row ``row``'s step now, placed on its caller's timeline: the step's
        caller frame less the delay.  A flush's silent steps are not caller frames: the text
        written during one is placed at the mark that started it, less the delay; the text the
        next steps write about the flush's silence goes to the frame after the mark, where the
        caller's next audio starts."""
        frame = int(self._frames[row])
        frame_ms = self._frame_ms
        audio_ms = max(0.0, frame * frame_ms - self._delay_ms, float(self._floor_ms[row]))
        return TranscriptPiece(text, frame, int(audio_ms // frame_ms), round(audio_ms, 3), flushed)

    def _join(self) -> None:
        """Reset the joining rows to fresh ones, then feed them the silence prefix."""
        torch = self._torch
        joining = self._joining
        index = np.flatnonzero(joining)
        mask = torch.from_numpy(joining.copy()).to(self._mask_dev.device)
        self.stt.mimi.reset_streaming(mask)
        self._lm_gen.reset_streaming(mask)
        self._fresh.wipe(torch.from_numpy(index).to(self._mask_dev.device))
        joining[:] = False
        prefix = self.stt.prefix_frames
        if prefix:
            self._mask[:] = False
            self._mask[index] = True
            self._pcm[index] = 0.0
            for _ in range(prefix):
                self._advance()  # text about no audio of the caller's: dropped
            self.extra_steps += prefix

    def _flush(self, rows: np.ndarray, out: list[RowPieces]) -> None:
        """The rows whose end-of-input mark was just stepped (a silent frame): the rest of their
        delay in silent steps masked to them, their text added to their pieces of this step."""
        ending = self._ending
        index = np.flatnonzero(ending)
        ending[:] = False
        positions = {int(row): i for i, row in enumerate(rows.tolist())}
        index = np.array([row for row in index.tolist() if row in positions], dtype=np.int64)
        if not len(index):
            return
        # The mark's own step counted as a caller frame; the flush's text is placed at it.
        self._frames[index] -= 1
        more = self.stt.delay_frames - 1
        if more > 0:
            self._mask[:] = False
            self._mask[index] = True
            self._pcm[index] = 0.0
            table = self._pieces
            for _ in range(more):
                tokens = self._advance()
                for row in index.tolist():
                    token = int(tokens[row])
                    text = table[token] if 0 <= token < len(table) else ""
                    if text:
                        i = positions[row]
                        out[i] = out[i] + (self._piece(row, text, True),)
            self.extra_steps += more
        for row in index.tolist():
            i = positions[row]
            if not out[i] or not out[i][-1].flushed:  # nothing written: say the flush is done
                out[i] = out[i] + (self._piece(row, "", True),)
        self._frames[index] += 1
        self._floor_ms[index] = self._frames[index] * self._frame_ms
