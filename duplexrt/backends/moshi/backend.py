"""``moshi``: Moshi, Hibiki and Hibiki-Zero through Kyutai's ``moshi`` package, batched over slots.

One batch of ``slots`` rows of Mimi (streaming encoder and decoder) and ``LMGen`` is built at
load and streams for the life of the process; each call holds one row.

* **Joining** resets only the joining rows (``reset_streaming`` with a row mask), on the next step,
  so several sessions joining together cost one reset.  The package's reset rewinds offsets but
  keeps the KV caches' contents, which a NaN left by the last session would leak into the next
  (see ``rows``), so those rows' caches are restored to a fresh row's too.  Leaving needs nothing:
  the row keeps its state until its next session resets it.
* **A step** runs the first ``b`` rows of the batch (``buckets``): ``b`` the smallest bucket
  size covering the active calls, which the backend keeps in the lowest rows (a call hanging up
  below the top has the top call moved into its row, ``row_map``).  Every per-row tensor of the
  package's streaming state is viewed, not copied: each bucket has its own state objects over
  the batch's storage, put on the modules for the step.  An execution mask set to the rows given
  leaves every other row's state (KV caches, convolution buffers, offsets, delayed-token cache)
  exactly as it was; their frames are scattered into the batch buffer in place, and their
  outputs and text gathered back.  A bucket rounds a row as its batch size does, so a call's
  samples can differ by about an ulp with its neighbours; ``batch = "fixed"`` runs every row of
  the batch on every step instead, where a call's output is bit for bit its own whoever shares
  the step (``benchmarks/moshi_tiny.py --exactness`` shows the rounding).
* **Warming rows**: with ``support_out_of_sync``, a row's first ``max_delay`` steps yield -2
  ("not generated yet") tokens.  Those rows are masked out of Mimi's decoder (its state does not
  advance) and hear silence; the decoder is fed a valid token in their place.
* **The first frame** of a session is encoded and given to the LM, then the encoder's state for
  that row is reset, as Kyutai's server does: that frame is "in the past" for the model, and the
  next one should get the encoder's left padding again.
* **Sampling** draws each row's noise from its own counter stream (see ``sampling``), so a session
  samples the same tokens whoever shares the batch with it; ``greedy`` turns sampling off.
* **End of input** (``flush_frames``, on by default for Hibiki models): Hibiki learnt to hear
  its input stream end as one step whose codes are all ``cardinality`` (one past the last code),
  then silence, and to finish the translation after it.  So the flush frame ``end_input`` marks
  is replaced by those codes (the row's encoder does not advance on it, as nothing was encoded),
  and the frames after it are plain silence through Mimi.
* **The K/V ring** of each row (``ring``): ``context_seconds`` sizes the LM's rings before any
  state is allocated, so a server that caps its calls holds more slots; a call reaching the
  ring's end ends with ``length`` (``max_session_frames``) or slides on, forgetting.
* **Attention** (``attention``): on a CPU a step's attention reads only the ring positions the
  active rows have filled (whole blocks of 64), bit-identical to the package's full-ring read;
  on a GPU the full-ring read is kept (CUDA graphs).  ``description["attention"]`` says which.
* **Stages** (encode, lm, decode) are timed every step: running totals in ``stage_seconds`` /
  ``stage_steps`` and this step's durations in ``last_stages`` (CUDA events on a GPU, so timing
  costs no extra synchronisation).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import attrs
import numpy as np

from duplexrt.backends.base import (CHOSEN_AT_LOAD, Backend, BackendInfo, Persona, PersonaError, PersonaRequest,
                                    SlotChoice, SlotSession)
from duplexrt.backends.moshi import (attention, auto_slots, buckets, compiler, memory, model, presize, ring,
                                    sampling)
from duplexrt.backends.moshi.settings import (DEFAULTS, HIBIKI_FLUSH_FRAMES, MODEL_FRAME_SIZE, MODEL_SAMPLE_RATE,
                                              NAME, MoshiSettings)
from duplexrt.backends.moshi.cuda import StepClock, select_device
from duplexrt.backends.moshi.env import import_moshi
from duplexrt.backends.moshi.prompter import Prompter
from duplexrt.backends.moshi.row_map import RowMap
from duplexrt.backends.moshi.text import piece_table
from duplexrt.backends.moshi.staging import StagedRows
from duplexrt.backends.moshi.rows import RowMover, RowWiper, uncovered
from duplexrt.config import MAX_SLOTS, ConfigError

__all__ = ["DEFAULTS", "HIBIKI_FLUSH_FRAMES", "STAGES", "MoshiBackend", "MoshiSettings"]

log = logging.getLogger("duplexrt.backends.moshi")

STAGES = ("encode", "lm", "decode")


def _streaming_roots(module: Any) -> list[Any]:
    """The topmost streaming modules in ``module``'s tree (itself, if it is one)."""
    from moshi.modules.streaming import StreamingModule

    if module is None:
        return []
    if isinstance(module, StreamingModule):
        return [module]
    roots = []
    for child in module.children():
        roots.extend(_streaming_roots(child))
    return roots


class MoshiBackend(Backend):
    chooses_slots = True

    def __init__(self, info: BackendInfo, options: Mapping[str, Any], *,
                 memory_source: memory.MemorySource | None = None) -> None:
        self.settings = MoshiSettings.from_options(options)
        if info.sample_rate != MODEL_SAMPLE_RATE:
            raise ConfigError(f"audio.sample_rate must be {MODEL_SAMPLE_RATE} (Mimi's) for {NAME}, "
                              f"got {info.sample_rate}")
        if info.frame_size != MODEL_FRAME_SIZE:
            raise ConfigError(f"audio.frame_size must be {MODEL_FRAME_SIZE} (one 80 ms Mimi frame) for "
                              f"{NAME}, got {info.frame_size}")
        super().__init__(attrs.evolve(info, device=self.settings.device))
        #: Running totals per stage, in seconds, and how many steps they cover.
        self.stage_seconds: dict[str, float] = dict.fromkeys(STAGES, 0.0)
        self.stage_steps = 0
        #: What was loaded: model type, sampling settings, max delay... (set by ``load``).
        self.description: dict[str, Any] = {}
        #: What one slot holds (set by ``load``, from the model's configuration).
        self.slot_bytes: memory.SlotBytes | None = None
        #: Each row's K/V ring (set by ``load``: ``backend.options.context_seconds``).
        self.ring: ring.Ring | None = None
        #: Free memory of the device, read after the weights (None: ``memory.device_memory``;
        #: tests give their own to exercise the arithmetic's refusals on a CPU).
        self._memory_source = memory_source
        self._loaded = False
        self._loaded_rows = False
        self._model: model.BuiltModel | None = None
        self._cuda = self.settings.device.startswith("cuda")
        #: PersonaPlex's prompts (``persona``), built with the model; None for a model without.
        self._prompter: Prompter | None = None
        self.takes_persona = self.settings.persona
        #: Why torch.compile was turned off at load (no C compiler on CUDA), or None.
        self._compile_off: str | None = None

    # -- loading -----------------------------------------------------------------------------------

    def load(self) -> None:
        """Build the model (once: a backend loaded again keeps it, and only sizes its rows
        again), then size and allocate the slots and warm up."""
        import torch

        settings = self.settings
        # torch.compile needs a C compiler on CUDA: without one, eager (one WARNING), not a crash.
        self._compile_off = compiler.ensure_compiler(settings.device) or self._compile_off
        import_moshi(settings.device)
        sampling.install()
        if settings.device.startswith("cuda"):
            select_device(torch.cuda, settings.device)  # before anything is built or captured
        with torch.no_grad():
            if self._model is None:
                if self.info.slots != CHOSEN_AT_LOAD:
                    self._refuse_before_building(torch)  # seconds, not the minutes of a 7B build
                self._model = self._build(torch)
            mimi, lm, cfg_coef = self._model.mimi, self._model.lm, self._model.cfg_coef
            self._release_rows()  # sized again from the weights alone
            # The ring first: every state allocated from here on (and the arithmetic) follows it.
            self.ring = ring.choose(settings.context_seconds, settings.beyond_context,
                                    self._model.model_positions, mimi.frame_rate,
                                    max_session_seconds=self.info.max_session_seconds)
            cap = self.info.max_session_seconds
            if settings.context_seconds is not None and 0 < cap < self.ring.seconds:
                log.info("moshi backend: runtime.max_session_seconds = %g ends every call before the %g s "
                         "K/V ring is full: backend.options.context_seconds = %g would hold the same calls "
                         "in less memory", cap, self.ring.seconds, cap)
            ring.apply(lm, self.ring)
            # A CPU's step reads only the filled positions of the rings (bit-identical); a GPU keeps
            # the package's full-ring read, which its CUDA graphs capture (see ``attention``).
            if settings.device.startswith("cuda"):
                attention.uninstall(lm)
            else:
                attention.install(lm)
            self.info = attrs.evolve(self.info, max_session_frames=self._session_frames(self.ring))
            # What one slot holds, from the model's own modules, before any of it is allocated
            # (the attentions' context is what the K/V rings will hold: see ``memory``).
            self.slot_bytes = memory.slot_bytes(mimi, lm, guided=cfg_coef != 1.0)
            device_memory = (self._memory_source or memory.device_memory)(settings.device)  # after the weights
            if device_memory is not None and self._prompter is not None:
                # The prompt lane (one row of the LM's K/V) and the prompt cache come first.
                held = self.slot_bytes.lm_kv + self._prompter.cache.max_bytes
                device_memory = attrs.evolve(device_memory, free=max(0, device_memory.free - held),
                                             source=f"{device_memory.source}, less {memory.gigabytes(held)} "
                                                    "for the prompt lane and cache")
            fit = memory.slots_that_fit(self._slot_total(), device_memory) if device_memory else None
            if self.info.slots == CHOSEN_AT_LOAD:
                self.slot_choice = self._choose_slots(fit, device_memory)
            else:
                slots = self.info.slots
                if fit is not None and slots > fit:
                    raise ConfigError(self._does_not_fit(slots, fit, device_memory))
                self._allocate(slots)
                step = self._warm_up(settings.warmup_steps)
                self.slot_choice = SlotChoice(slots, "configured", "runtime.slots",
                                              self._memory_details(fit, device_memory))
                if step:  # a full batch over the frame keeps no call in real time: say so, loudly
                    self.slot_choice = self._check_clock(self.slot_choice, step * 1e3)
            self._warm_buckets()
            # The ring in the reason too: the start line shows the reason, and the ring is half of it.
            self.slot_choice = attrs.evolve(self.slot_choice,
                                            reason=f"{self.slot_choice.reason}; {self.ring.describe()}")
            self.description["ring"] = self.ring.as_dict()
            self.description["attention"] = "filled" if attention.installed(lm) else "ring"
            self.description["batch"] = "buckets" if self._views is not None else "fixed"
            self.description["buckets"] = list(self._chooser.sizes)
            flush = settings.flush_frames
            if flush is None:
                flush = HIBIKI_FLUSH_FRAMES if self._model.model_type == "hibiki" else 0
            self.info = attrs.evolve(self.info, flush_frames=flush)
            self.description["flush_frames"] = flush
        self._loaded = True
        log.info("moshi backend loaded: %s", self.description)
        log.info("moshi backend slots: %d (%s): %s", self.info.slots, self.slot_choice.source,
                 self.slot_choice.reason)

    def _session_frames(self, chosen: ring.Ring) -> int | None:
        """The frames a call may last: the ring's, less the longest persona prompt's positions
        (a prompt fills the start of the row's ring); ConfigError where no room is left."""
        frames = chosen.max_session_frames
        if self._prompter is None:
            return frames
        room = chosen.positions - self._prompter.max_positions
        if room < 1:
            raise ConfigError(f"the K/V ring of {chosen.positions} positions leaves no room for a call after the "
                              f"longest persona prompt ({self._prompter.max_positions} positions: the longest voice, "
                              "the fillers and backend.options.max_prompt_tokens): lower max_prompt_tokens or "
                              "raise backend.options.context_seconds")
        return room if frames is not None else None

    def resize(self, slots: int) -> None:
        """Size the rows for ``slots`` sessions again, keeping the model (every row's state is let
        go: between sessions only), with the same memory check and warm-up as ``load``: one model
        timed at many batch sizes (``benchmarks/gpu.py``)."""
        self.info = attrs.evolve(self.info, slots=slots)
        self.load()

    def _build(self, torch: Any) -> model.BuiltModel:
        built = model.build(self.settings, self.info, torch)
        settings = self.settings
        if settings.persona:
            self._prompter = Prompter.from_model(settings, mimi=built.mimi, lm=built.lm, tokenizer=built.tokenizer,
                                                 voices_folder=built.voices_folder, tiny=settings.tiny)
            self.persona_voices = self._prompter.rules.voices.names
        return built

    # -- sizing ------------------------------------------------------------------------------------

    def _memory_details(self, fit: int | None, device_memory: memory.DeviceMemory | None) -> dict[str, Any]:
        details: dict[str, Any] = {"bytes_per_slot": self._sized().as_dict(), "fit_memory": fit,
                                   "ring": self._ring().as_dict()}
        if self.extra_slot_bytes:
            details["transcriber_bytes_per_slot"] = self.extra_slot_bytes
        if device_memory is not None:
            details.update(free_bytes=device_memory.free, total_bytes=device_memory.total,
                           reserve_bytes=device_memory.reserve, memory_source=device_memory.source)
        return details

    def _slot_total(self) -> int:
        """What one slot needs on the device: its own state, and a transcriber's row beside it."""
        return self._sized().total + self.extra_slot_bytes

    def _sized(self) -> memory.SlotBytes:
        """What one slot holds: known from the first load on, before anything is allocated."""
        if self.slot_bytes is None:
            raise RuntimeError("the moshi backend has not sized its slots: load it first")
        return self.slot_bytes

    def _ring(self) -> ring.Ring:
        """The K/V ring chosen at load."""
        if self.ring is None:
            raise RuntimeError("the moshi backend has not chosen its K/V ring: load it first")
        return self.ring

    def _built_model(self) -> model.BuiltModel:
        """The built model (built once, at the first load; a resize reuses it)."""
        if self._model is None:
            raise RuntimeError("the moshi backend has no model: load it first")
        return self._model

    def _does_not_fit(self, slots: int, fit: int, device_memory: memory.DeviceMemory | None) -> str:
        per = self._sized()
        held = self._ring()
        gb = memory.gigabytes
        parts = (f"LM K/V {gb(per.lm_kv)}, depformer {gb(per.depformer_kv)}, Mimi K/V {gb(per.mimi_kv)}, "
                 f"Mimi convolutions {gb(per.mimi_conv)}, the rest {gb(per.bookkeeping)}")
        advice = f"set runtime.slots = {fit} (--slots {fit}) or \"auto\"" if fit else \
            "not even one slot fits: free memory on the device, or a device with more"
        advice += (f", or cap calls with a shorter K/V ring (backend.options.context_seconds; now "
                   f"{held.seconds:g} s, {held.positions} positions)")
        if device_memory is None:  # only a known free memory yields a fit to refuse by
            free = f"{self.settings.device}'s free memory is unknown"
        else:
            free = (f"{self.settings.device} has {gb(device_memory.free)} free after the weights "
                    f"({device_memory.source}), less {gb(device_memory.reserve)} kept for activations and CUDA graphs")
        if self.extra_slot_bytes:
            parts += f"; and {gb(self.extra_slot_bytes)} for the transcriber's row beside it"
        total = self._slot_total()
        return (f"runtime.slots = {slots} does not fit: each slot holds {gb(total)} of state ({parts}), "
                f"{gb(slots * total)} for {slots}, and {free}: at most {fit} slot{'s' if fit != 1 else ''} "
                f"fit; {advice}")

    def _refuse_before_building(self, torch: Any) -> None:
        """A configured slot count that cannot fit, refused from the model's configuration on the
        meta device before any weight is built (``presize``); the check after the build stays."""
        settings = self.settings
        early = presize.before_building(settings, model.torch_dtype(torch, settings.dtype, settings.device),
                                        max_session_seconds=self.info.max_session_seconds,
                                        memory_source=self._memory_source or memory.device_memory)
        if early is None or early.fit is None or self.info.slots <= early.fit:
            return
        self.slot_bytes, self.ring = early.slot_bytes, early.ring  # what the message names
        raise ConfigError(self._does_not_fit(self.info.slots, early.fit, early.after_weights)
                          + " (found from the model's configuration, before building it)")

    def _check_clock(self, choice: SlotChoice, step_ms: float) -> SlotChoice:
        """``runtime.slots`` as given, against the frame: a full batch stepping over the budget
        keeps no call in real time.  Then smaller batches are timed, as ``"auto"`` times them, to
        name the largest that keeps it, in an ERROR and in ``slot_choice`` (``/readyz``), and the
        configured rows are allocated again."""
        info, slots = self.info, choice.slots
        budget = info.frame_ms * (1.0 - info.capacity_margin)
        clock: dict[str, Any] = {"step_ms": round(step_ms, 3), "budget_ms": round(budget, 3),
                                 "within_budget": step_ms <= budget}
        if step_ms <= budget:
            return attrs.evolve(choice, details={**choice.details, "real_time": clock})
        steady = max(self.settings.warmup_steps - self._unsettled_steps, 3)

        def time_at(rows: int) -> float:
            self._allocate(rows)
            return self._warm_up(self._unsettled_steps + steady) * 1e3

        found = auto_slots.search(time_at, slots - 1, budget) if slots > 1 else None
        self._allocate(slots)
        self._warm_up(self.settings.warmup_steps)
        largest = found.slots if found is not None and found.within_budget else 0
        clock.update(largest_slots=largest,
                     timed=[{"rows": rows, "step_ms": round(ms, 3)} for rows, ms in (found.timings if found else ())])
        advice = (f"the largest batch timed within it is {largest} rows: set runtime.slots = {largest} "
                  f"(--slots {largest}) or \"auto\"" if largest else
                  "not even one row steps within it: no session keeps real time on this device")
        message = (f"runtime.slots = {slots} is too many for this device's clock: a full batch steps in "
                   f"{step_ms:.1f} ms, over the {budget:.1f} ms budget (the {info.frame_ms:g} ms frame less "
                   f"{info.capacity_margin:.0%}), so no call keeps real time; {advice}")
        log.error("moshi backend: %s", message)
        return attrs.evolve(choice, reason=f"{choice.reason}; TOO SLOW: {step_ms:.1f} ms a step over the {budget:.1f} "
                                           f"ms budget, {largest} slots keep real time",
                            details={**choice.details, "real_time": clock})

    def _choose_slots(self, fit: int | None, device_memory: memory.DeviceMemory | None) -> SlotChoice:
        """``runtime.slots = "auto"``: time full batches of a few sizes up to what fits the memory
        (``auto_slots``), keep the largest whose step leaves the margin."""
        limit = MAX_SLOTS if fit is None else min(fit, MAX_SLOTS)
        if limit < 1:
            raise ConfigError(self._does_not_fit(1, 0, device_memory))
        info = self.info
        budget = info.frame_ms * (1.0 - info.capacity_margin)
        steady = max(self.settings.warmup_steps - self._unsettled_steps, 3)
        timed: list[int] = []

        def time_at(rows: int) -> float:
            self._allocate(rows)
            # The process's very first steps also pay for what later sizes find ready (kernel
            # caches, first touches of memory): two more unmeasured steps for the first size.
            extra = 0 if timed else 2
            timed.append(rows)
            cost = self._warm_up(self._unsettled_steps + extra + steady, unsettled=self._unsettled_steps + extra)
            log.info("moshi backend: a full batch of %d rows steps in %.2f ms (budget %.2f ms)", rows,
                     cost * 1e3, budget)
            return cost * 1e3

        found = auto_slots.search(time_at, limit, budget)
        timings = dict(found.timings)
        if self.info.slots != found.slots:  # the last size timed was another: allocate the one kept
            self._allocate(found.slots)
            cost = self._warm_up(self._unsettled_steps + steady)
            timings.setdefault(found.slots, cost * 1e3)
        step = timings[found.slots]  # what the choice was made on
        memory_note = (f"{fit} fit the memory ({memory.gigabytes(self._slot_total())} a slot)"
                       if fit is not None else "the device's free memory is unknown")
        frame = f"{info.capacity_margin:.0%} of the {info.frame_ms:g} ms frame"
        if not found.within_budget:
            reason = (f"auto: not even {found.slots} row steps within {budget:.1f} ms ({step:.1f} ms): no "
                      f"session will keep real time on this device; {memory_note}")
            log.warning("moshi backend: %s", reason)
        elif found.slots == limit:
            reason = f"auto: all {limit} that fit the memory step in {step:.1f} ms, leaving {frame}" \
                if fit is not None else f"auto: {limit}, the most runtime.slots allows, step in {step:.1f} ms"
        else:
            over = f"; {found.over} took {timings[found.over]:.1f} ms" if found.over else ""
            reason = (f"auto: the largest batch timed whose step ({step:.1f} ms) leaves {frame} "
                      f"(budget {budget:.1f} ms){over}; {memory_note}")
        details = self._memory_details(fit, device_memory)
        details.update(budget_ms=round(budget, 3), step_ms=round(step, 3),
                       timed=[{"rows": rows, "step_ms": round(ms, 3)} for rows, ms in found.timings])
        return SlotChoice(found.slots, "auto", reason, details)

    @property
    def _unsettled_steps(self) -> int:
        """Warm-up steps that are not a steady step: the first (allocation, kernel selection,
        torch.compile), and on a GPU the second too, where the package captures its CUDA graphs
        (``CUDAGraphed`` runs a function plainly once, captures on its second call)."""
        return 2 if self.settings.device.startswith("cuda") else 1

    def _allocate(self, slots: int) -> None:
        """Streaming state for ``slots`` rows (whatever state there was is let go first)."""
        built = self._built_model()
        torch = built.torch
        self._release_rows()
        self.info = attrs.evolve(self.info, slots=slots)
        conditions = model.conditions(built.lm, built.model_type, built.cfg_coef, self.info.slots)
        lm_gen = built.models.LMGen(built.lm, cfg_coef=built.cfg_coef, condition_tensors=conditions,
                                    support_out_of_sync=True, **built.gen_config)
        self._rows_stack = ExitStack()
        self._loaded_rows = True  # from here on, a release closes whatever was entered
        self._rows_stack.enter_context(built.mimi.streaming(slots))
        self._rows_stack.enter_context(lm_gen.streaming(slots))
        self._setup(torch, built.mimi, built.lm, lm_gen, built.tokenizer)
        settings = self.settings
        self.description = {
            "model_type": built.model_type,
            "checkpoint": settings.checkpoint or f"{settings.random or 'tiny'}(seed={settings.seed})",
            "dtype": str(built.lm.dtype).removeprefix("torch."), "device": settings.device,
            "use_sampling": lm_gen.use_sampling, "temp": lm_gen.temp, "temp_text": lm_gen.temp_text,
            "top_k": lm_gen.top_k, "top_k_text": lm_gen.top_k_text, "cfg_coef": built.cfg_coef,
            "max_delay": lm_gen.max_delay, "text_card": built.lm.text_card, "slots": slots,
            "torch_compile": "on" if compiler.compile_enabled() else self._compile_off or "off (NO_TORCH_COMPILE)",
        }

    def _release_rows(self) -> None:
        if not self._loaded_rows:
            return
        self._loaded_rows = False
        self._rows_stack.close()  # every module's streaming state (and its CUDA graphs) goes
        for name in ("_lm_gen", "_sampler", "_pcm_dev", "_exec", "_clock", "_wiper", "_encoder_wiper", "_mover",
                     "_join", "_first", "_views", "_row_map", "_chooser", "_samplers"):
            setattr(self, name, None)
        import gc

        import torch

        gc.collect()
        if self._cuda:
            torch.cuda.empty_cache()  # the rows' memory (and their CUDA graphs' pools) back to the device

    def _setup(self, torch: Any, mimi: Any, lm: Any, lm_gen: Any, tokenizer: Any) -> None:
        slots, frame = self.info.slots, self.info.frame_size
        device = torch.device(self.settings.device)
        cuda = device.type == "cuda"
        self._torch = torch
        self._cuda = cuda
        self._mimi = mimi
        self._lm = lm
        self._lm_gen = lm_gen
        self._tokenizer = tokenizer
        widths = sampling.call_widths(lm.text_linear.out_features, lm.card, lm.dep_q, lm_gen.top_k_text,
                                      lm_gen.top_k)
        self._widths = widths
        self._sampler = sampling.RowSampler(slots, device, widths)
        # Greedy decoding draws nothing: the package's argmax, no noise to make.
        self._active_sampler = self._sampler if lm_gen.use_sampling else None
        self._encoder_side = [root for part in (mimi.encoder, mimi.encoder_transformer,
                                                getattr(mimi, "downsample", None))
                              for root in _streaming_roots(part)]
        # What the package's reset leaves in a row (KV caches, LMGen's token cache), restored
        # with it: a reused slot must be exactly a fresh one, whatever its last session sent.
        self._wiper = RowWiper([mimi, lm_gen], slots)
        self._encoder_wiper = RowWiper(self._encoder_side, slots)
        # Every field of every streaming state, walked: one the package adds is named here, not
        # silently left behind by a row move or reset.
        self._mover = RowMover({"mimi": mimi, "lm_gen": lm_gen}, slots)
        for problem in uncovered(self._mover.fields, slots):
            log.warning("moshi streaming state %s: a row moved or reset may differ from a fresh one", problem)
        # Steps sized to the active calls (``buckets``): views of the first rows of every per-row
        # tensor, calls kept in the lowest rows; the fixed batch where the state cannot be viewed so.
        self._views: buckets.ViewStates | None = None
        refused = None
        if self.settings.batch == "buckets":
            try:
                self._views = buckets.ViewStates({"mimi": mimi, "lm_gen": lm_gen}, slots, buckets.sizes(slots))
            except buckets.BucketsUnsupported as exc:
                refused = str(exc)
        if self._views is not None:
            self._row_map = RowMap(slots, dense=True)
            self._chooser = buckets.BucketChooser(buckets.sizes(slots))
            #: The sampler over each bucket's rows (views of ``_sampler``'s).
            self._samplers = {size: self._sampler.first_rows(size) for size in self._chooser.sizes}
        else:
            self._keep_fixed_batch(refused)

        def host(shape: tuple[int, ...], dtype: Any) -> Any:
            return torch.zeros(shape, dtype=dtype, pin_memory=cuda)

        # Host buffers (page-locked on a GPU) and their numpy views; on a CPU the model reads and
        # writes the host buffers themselves.
        self._mask_t = host((slots,), torch.bool)
        self._mask = self._mask_t.numpy()
        self._reset_t = host((slots,), torch.bool)
        self._reset = self._reset_t.numpy()
        self._pending_reset = False
        self._pcm_t = host((slots, 1, frame), torch.float32)
        self._pcm = self._pcm_t.numpy()[:, 0, :]
        self._out_t = host((slots, frame), torch.float32)
        self._out = self._out_t.numpy()
        self._text_t = host((slots,), torch.int64)
        self._text = self._text_t.numpy()
        # A join's rows (``_apply_resets``) and a first frame's rows (the encoder's reset), staged:
        # written into page-locked buffers and copied to the device without blocking, so the host
        # never waits there for the GPU's queued work; each group is written again only once its
        # last copy is done (its event).  On a CPU the model reads the host buffers themselves.
        self._join = StagedRows(torch, slots, device, host)
        self._first = StagedRows(torch, slots, device, host)
        #: CUDA events timing the stages (None on a CPU, timed by the host's clock).
        self._clock: StepClock | None = None
        if cuda:
            self._exec = torch.zeros(slots, dtype=torch.bool, device=device)
            self._pcm_dev = torch.zeros((slots, 1, frame), dtype=torch.float32, device=device)
            self._clock = StepClock(torch.cuda, device, len(STAGES) + 1)
        else:
            self._exec = self._mask_t
            self._pcm_dev = self._pcm_t
        self._frames = np.zeros(slots, dtype=np.int64)
        # Rows whose frame in the next step is their end-of-input mark (``end_input``).
        self._ending = np.zeros(slots, dtype=bool)
        self._pending_end = False
        self._keys = np.zeros(slots, dtype=np.int64)
        sampled = lm.text_linear.out_features
        if tokenizer.vocab_size() < sampled:
            log.warning("the text tokenizer has %d pieces for a model that samples %d: the rest "
                        "decode as nothing", tokenizer.vocab_size(), sampled)
        self._pieces = piece_table(tokenizer, sampled, (lm.text_padding_token_id, lm.end_of_text_padding_id))

    def _warm_up(self, steps: int, unsettled: int | None = None) -> float:
        """Steps on silence with every row, so that allocation, kernel selection, torch.compile and
        CUDA graph capture happen now; then every row is reset.  Returns the median of the steady
        steps (seconds; 0.0 when there were none), which seeds the capacity estimate."""
        slots = self.info.slots
        rows = np.arange(slots, dtype=np.int64)
        silence = np.zeros((slots, self.info.frame_size), dtype=np.float32)
        out = np.empty_like(silence)
        costs = []
        torch = self._torch
        for _ in range(steps):
            started = time.perf_counter()
            with torch.no_grad():
                self._step(torch, rows, slots, silence, out)
            costs.append(time.perf_counter() - started)
        # Only steady steps say what a step costs: not the first (allocation, compilation), nor on
        # a GPU the second (graph capture).  A fixed batch costs the same whatever the rows: a
        # flat line at full batch.
        settled = costs[self._unsettled_steps if unsettled is None else unsettled:]
        cost = sorted(settled)[len(settled) // 2] if settled else 0.0
        self.warmup_costs = ((1, cost), (slots, cost)) if settled else ()
        if steps and not settled:
            log.info("moshi backend: %d warm-up step(s), none steady (the first %d are not): the capacity "
                     "estimate starts from the first sessions' steps", steps, self._unsettled_steps)
        self._forget_rows()
        if self._prompter is not None:
            self._prompter.warm()
        return cost

    def _warm_buckets(self) -> None:
        """Each smaller bucket stepped full, as ``_warm_up`` steps the whole batch: its kernels
        chosen and, on a GPU, its own CUDA graphs captured now, not on a caller's frame; their
        costs join ``warmup_costs`` (what a bucket's calls pay is the bucket's step)."""
        if self._views is None or not self.settings.warmup_steps:
            return
        torch = self._torch

        def step(rows: np.ndarray, size: int, inputs: np.ndarray, outputs: np.ndarray) -> None:
            with torch.no_grad():
                self._step(torch, rows, size, inputs, outputs)

        steady = max(self.settings.warmup_steps - self._unsettled_steps, 1)
        try:
            costs = buckets.time_buckets(step, self._chooser.sizes[:-1], self.info.frame_size,
                                         unsettled=self._unsettled_steps, steady=steady)
        except torch.OutOfMemoryError:
            # Each bucket's CUDA graphs hold their own activations: where they do not fit beside
            # the rows, the fixed batch (one set of graphs) still serves every slot.
            self._forget_rows()
            self._keep_fixed_batch("the buckets' CUDA graphs do not fit the device's memory beside the rows")
            return
        if self.warmup_costs:  # the whole batch was timed too: the buckets' costs beside it
            self.warmup_costs = tuple(sorted({**dict(self.warmup_costs), **costs}.items()))
        self._forget_rows()

    def _keep_fixed_batch(self, why: str | None) -> None:
        """Every step the whole batch (``batch = "fixed"``, or buckets refused: ``why``, said)."""
        if why is not None:
            log.warning("moshi backend: every step runs the whole batch, as with batch = \"fixed\": %s", why)
        slots = self.info.slots
        self._views = None
        self._row_map = RowMap(slots, dense=False)
        self._chooser = buckets.BucketChooser((slots,))
        self._samplers = {slots: self._sampler.first_rows(slots)}
        self.stepped_rows = None
        if self._cuda and why is not None:
            import gc

            gc.collect()
            self._torch.cuda.empty_cache()

    def _forget_rows(self) -> None:
        """Every row reset, every count zeroed: the rows as a fresh load leaves them."""
        self._reset[:] = True
        self._apply_resets()
        self._frames[:] = 0
        self._ending[:] = False
        self._sampler.counters.zero_()
        self._row_map.clear()
        self._chooser.restart()
        self.stage_seconds = dict.fromkeys(STAGES, 0.0)
        self.stage_steps = 0
        self.last_stages = ()


    # -- slots -------------------------------------------------------------------------------------

    def paid_rows(self, sessions: int) -> int:
        """A bucket step pays for the bucket covering the calls; the fixed batch's flat cost is
        fitted as it is (a flat line over the sessions)."""
        return self._chooser.covering(sessions) if self._row_map.dense else sessions

    def open_slot(self, slot: int, session: SlotSession) -> None:
        # The reset itself waits for the next step, so that sessions joining together share one.
        row = self._row_map.open(slot)
        self._reset[row] = True
        self._pending_reset = True
        self._frames[row] = 0
        self._keys[row] = sampling.session_key(self.settings.seed, session.session_id)

    # -- personas (PersonaPlex: see ``prompter``) ---------------------------------------------------

    def check_persona(self, request: PersonaRequest) -> Persona:
        if self._prompter is None:
            return super().check_persona(request)
        return self._prompter.check(request)

    def set_persona(self, slot: int, persona: Persona) -> None:
        """The row's prompt: its state (cached, else prefilled in the lane) copied into the row,
        just reset, with the seam sampled from the session's stream."""
        if self._prompter is None:
            super().set_persona(slot, persona)
            return
        torch = self._torch
        row = self._row_map.row(slot)
        with torch.no_grad():
            if self._pending_reset:  # the row was opened since the last step: fresh first
                self._apply_resets()
            self._prompter.prompt(self._lm_gen, row, persona, int(self._keys[row]), self._widths)

    def persona_info(self) -> dict[str, Any] | None:
        return None if self._prompter is None else self._prompter.info()

    def close_slot(self, slot: int) -> None:
        row, top = self._row_map.close(slot)
        if row < 0:
            return
        if top is not None:  # the top call into the row let go: the calls stay in the lowest rows
            self._move_row(top, row)
            row = top
        self._frames[row] = 0
        self._ending[row] = False

    def move_row(self, src: int, dst: int) -> None:
        """The whole state of row ``src`` (streaming state, sampling stream, frame count, end mark)
        into row ``dst``: the session there goes on as it would have in ``src``, where the kernels
        round a row alike wherever it sits (see ``RowMover``).  ``src`` is left to nobody.  Only
        for the fixed batch (where row = slot): with buckets the backend moves its rows itself, on
        a hang-up below the top."""
        if self._row_map.dense:
            raise RuntimeError("with batch = \"buckets\" the backend keeps its calls in the lowest rows itself")
        self._move_row(src, dst)

    def _move_row(self, src: int, dst: int) -> None:
        torch = self._torch
        with torch.no_grad():
            if self._pending_reset:  # a row opened since the last step is reset before it moves
                self._apply_resets()
            self._mover.move(src, dst)
            for tensor in (self._sampler.keys, self._sampler.counters):
                tensor[dst] = tensor[src]
        for array in (self._frames, self._keys, self._ending):
            array[dst] = array[src]
        self._ending[src] = False

    def end_input(self, slot: int) -> None:
        try:
            row = self._row_map.row(slot)
        except KeyError:
            return  # the call has left already: nothing to end
        self._ending[row] = True
        self._pending_end = True

    def _apply_resets(self) -> None:
        # Staged copies (``staging.StagedRows``): the host mask is cleared right after, the copy is not waited for.
        mask, index, keys = self._join.put(np.flatnonzero(self._reset), self._keys)
        self._lm_gen.reset_streaming(mask)
        self._mimi.reset_streaming(mask)
        self._wiper.wipe(index)
        self._sampler.keys.index_copy_(0, index, keys)
        self._sampler.counters.index_fill_(0, index, 0)
        self._reset[:] = False
        self._pending_reset = False

    # -- stepping ----------------------------------------------------------------------------------

    def step(self, rows: np.ndarray, inputs: np.ndarray, outputs: np.ndarray) -> Sequence[str]:
        torch = self._torch
        row_map = self._row_map
        with torch.no_grad():
            if not row_map.dense:
                return self._step(torch, rows, self.info.slots, inputs, outputs)
            # The smallest bucket covering the calls (they hold the lowest rows), with hysteresis.
            size = self._chooser.choose(row_map.active)
            return self._step(torch, row_map.rows_of(rows), size, inputs, outputs)

    def _step(self, torch: Any, rows: np.ndarray, size: int, inputs: np.ndarray, outputs: np.ndarray) -> list[str]:
        """One step of ``rows`` (rows of the batch, not slots) over the first ``size`` rows."""
        cuda = self._cuda
        clock = time.perf_counter_ns
        t0 = clock()
        if self._pending_reset:
            self._apply_resets()
        mask = self._mask
        mask[:] = False
        mask[rows] = True
        self._pcm[rows] = inputs
        t_first = t0
        if cuda:
            marks: Any = self._clock  # None on a CPU, where it is never used
            t_first = clock()
            marks.mark(0)
            self._exec.copy_(self._mask_t, non_blocking=True)
            self._pcm_dev.copy_(self._pcm_t, non_blocking=True)
        views = self._views
        if views is not None:
            views.enter(size)  # this bucket's states on the modules, for this step only
            self.stepped_rows = size
        try:
            texts = self._run_model(torch, rows, size, outputs, t0, t_first)
        finally:
            if views is not None:
                views.leave()
        return texts

    def _run_model(self, torch: Any, rows: np.ndarray, size: int, outputs: np.ndarray, t0: int,
                   t_first: int) -> list[str]:
        """Mimi's encoder, the LM and Mimi's decoder over the first ``size`` rows, ``rows``'
        audio and text gathered into ``outputs`` and returned; the step began at ``t0`` and, on a
        GPU, its first device mark was queued at ``t_first``."""
        cuda = self._cuda
        clock = time.perf_counter_ns
        marks: Any = self._clock  # None on a CPU, where it is never used
        exec_mask = self._exec[:size]
        mimi = self._mimi

        # A session's first frame: its row's encoder is reset once the frame is encoded; the mask
        # goes to the device now, before the encoder is queued, so that nothing waits for it.
        first = rows[self._frames[rows] == 0]
        first_reset = self._first.put(first) if len(first) else None

        # encode: every row's frame through Mimi's encoder; only the given rows' states advance.
        ending = self._take_ending(torch)[:size] if self._pending_end else None
        mimi.set_exec_mask(exec_mask if ending is None else exec_mask & ~ending)
        codes = mimi.encode(self._pcm_dev[:size])
        if ending is not None:
            codes = torch.where(ending[:, None, None], mimi.cardinality, codes)
        if first_reset is not None:
            self._reset_encoder(first_reset[0][:size], first_reset[1])
        if cuda:
            marks.mark(1)
        t1 = clock()

        # lm: one LMGen step over the batch, sampling from each row's own stream.
        self._lm_gen.set_exec_mask(exec_mask)
        sampler = self._samplers[size]
        with sampling.active(sampler if self._active_sampler is not None else None):
            tokens = self._lm_gen.step(codes)
        sampler.counters.add_(exec_mask)
        if cuda:
            marks.mark(2)
        t2 = clock()

        # decode: rows with audio tokens (not warming up, not masked) through Mimi's decoder.
        audio = tokens[:, 1:, :]
        ready = audio[:, 0, 0] >= 0
        mimi.set_exec_mask(ready)
        pcm = mimi.decode(audio.clamp(min=0))[:, 0, :]
        pcm = torch.where(ready[:, None], pcm, 0.0)
        if cuda:
            self._out_t[:size].copy_(pcm, non_blocking=True)
            self._text_t[:size].copy_(tokens[:, 0, 0], non_blocking=True)
            marks.mark(3)
            marks.wait()  # blocking: the thread sleeps until the GPU is done (see ``cuda``)
            synced = clock()
            out, text = self._out, self._text
        else:
            out, text = pcm.numpy(), tokens[:, 0, 0].numpy()
        np.take(out, rows, axis=0, out=outputs)
        pieces = self._pieces
        limit = len(pieces)
        texts = [pieces[t] if 0 <= t < limit else "" for t in text[rows].tolist()]
        self._frames[rows] += 1
        t3 = clock()

        if cuda:
            # Device time between the events, plus the host work outside them (the scatter before
            # the first, the gather after the last).
            durations = marks.elapsed_ns()
            durations[0] += max(0, t_first - t0)
            durations[2] += t3 - synced
        else:
            durations = [t1 - t0, t2 - t1, t3 - t2]
        self.last_stages = tuple(zip(STAGES, durations))
        seconds = self.stage_seconds
        for name, ns in self.last_stages:
            seconds[name] += ns / 1e9
        self.stage_steps += 1
        return texts

    def _take_ending(self, torch: Any) -> Any:
        """The rows marked by ``end_input`` as a mask on the model's device (rare: once per
        session end, so a plain copy), and the marks cleared."""
        ending = torch.from_numpy(self._ending.copy()).to(self._exec.device)
        self._ending[:] = False
        self._pending_end = False
        return ending

    def _reset_encoder(self, reset: Any, index: Any) -> None:
        """Forget the encoder's state for the rows of ``reset`` (a mask on the model's device) and
        ``index`` (the same rows): their first frame has been encoded."""
        for module in self._encoder_side:
            module.reset_streaming(reset)
        self._encoder_wiper.wipe(index)

    def stage_means_ms(self) -> dict[str, float]:
        """Mean duration of each stage per step so far, in milliseconds."""
        steps = max(self.stage_steps, 1)
        return {name: total * 1e3 / steps for name, total in self.stage_seconds.items()}

    def close(self) -> None:
        """Let the model and its state go (also after a load that failed or was stopped)."""
        self._loaded = False
        self._release_rows()
        self._model = None
        for name in ("_mimi", "_lm"):
            setattr(self, name, None)

