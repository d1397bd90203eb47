"""How much memory one slot holds, read from the model's own configuration, and how many fit.

Every slot is one row of the fixed batch, and each row keeps its streaming state for the life of
the process: the LM temporal transformer's K/V ring (for Moshi 7B, 32 layers x 2 x 4096 x 3000
positions in bf16 = 1.573 GB, almost all of it), Mimi's encoder and decoder transformers' K/V and
its convolution buffers, and a few offsets and masks.  A model with classifier-free guidance
(Hibiki, ``cfg_coef != 1``) runs two LM rows per slot.  The depformer's K/V lives only during a
step, but a CUDA graph keeps it in its memory pool, so it is counted too.

``slot_bytes`` reads those sizes from the built model's modules (heads, head width, context,
kernel, stride, channels, dtype), before any state is allocated.  The context it reads is each
attention's ``context``: whatever changes that before allocation (the package's
``moshi.modules.transformer.set_attention_context``) changes the figure with it.  The model can
be built on PyTorch's ``meta`` device, which allocates nothing: that is how the presets are
checked against the GPUs they name without one (``tests/test_gpu_sizing.py``).

The byte counts mirror what moshi 0.2.13's ``_init_streaming_state`` methods allocate, tensor by
tensor; ``tests/test_backend_moshi_memory.py`` checks them against the tensors a real streaming
state holds, exactly, so a package version that changes them fails there first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import attrs

log = logging.getLogger("duplexrt.backends.moshi")

#: Kept free beyond the slots' state, for the step's activations, the CUDA graphs' pools, the
#: allocator's slack and cuBLAS/cuDNN workspaces: this share of the device's memory, at least
#: ``RESERVE_MIN``.  Arithmetic, not a measurement: no GPU has measured a 7B step's peak here yet.
RESERVE_SHARE = 0.06
RESERVE_MIN = 1 << 30
#: The CUDA context itself (not visible before the process has one: used only by ``fits``, the
#: arithmetic for a GPU this process is not running on).
CUDA_CONTEXT_BYTES = 600 * 10**6


@attrs.frozen
class SlotBytes:
    """State bytes one slot holds, by part."""

    #: The LM temporal transformer's K/V ring, every layer (two rows of it with guidance).
    lm_kv: int
    #: The depformer's K/V for one step (held by its CUDA graph's pool on a GPU).
    depformer_kv: int
    #: Mimi's encoder and decoder transformers' K/V rings.
    mimi_kv: int
    #: Mimi's streaming convolution buffers (SEANet encoder and decoder, down/upsampling).
    mimi_conv: int
    #: Offsets, execution masks, LMGen's token cache and condition sum: the rest.
    bookkeeping: int

    @property
    def total(self) -> int:
        return self.lm_kv + self.depformer_kv + self.mimi_kv + self.mimi_conv + self.bookkeeping

    def as_dict(self) -> dict[str, int]:
        return {**attrs.asdict(self), "total": self.total}


def _param_dtype_size(module: Any) -> int:
    import torch

    for param in module.parameters():
        if param.dtype in (torch.int8, torch.uint8):  # a quantised linear keeps its cache in float16
            return 2
        return param.element_size()
    return 4


def _attention_bytes(module: Any) -> tuple[int, int]:
    """(K/V bytes, bookkeeping bytes) per batch row of one ``StreamingMultiheadAttention``."""
    bookkeeping = 1 + 8  # exec_mask, offset
    if module.cross_attention:
        return 0, bookkeeping
    capacity = module.context if module.context is not None else module.weights_per_step
    if not capacity:
        raise ValueError("an attention with neither context nor weights_per_step has no K/V ring size")
    head_dim = module.embed_dim // module.num_heads
    kv_heads = module.num_heads // module.kv_repeat
    kv = 2 * kv_heads * capacity * head_dim * _param_dtype_size(module.in_projs[0])
    if not module.weights_per_step:  # the ring keeps an end offset per row (respect_exec_mask)
        bookkeeping += 8
    return kv, bookkeeping


def _tree_bytes(root: Any, skip: Any = None) -> tuple[int, int, int]:
    """(K/V, convolution, bookkeeping) bytes per batch row of the streaming modules under
    ``root`` (``skip``'s subtree left out: a detached module streamed on its own)."""
    from moshi.modules.conv import StreamingConv1d, StreamingConvTranspose1d
    from moshi.modules.streaming import StreamingModule
    from moshi.modules.transformer import StreamingMultiheadAttention, StreamingTransformer

    skipped = {id(m) for m in skip.modules()} if skip is not None else set()
    kv = conv = bookkeeping = 0
    for module in root.modules():
        if id(module) in skipped or not isinstance(module, StreamingModule):
            continue
        if isinstance(module, StreamingMultiheadAttention):
            k, b = _attention_bytes(module)
            kv += k
            bookkeeping += b
        elif isinstance(module, StreamingConv1d):
            inner = module.conv.conv
            effective = (inner.kernel_size[0] - 1) * inner.dilation[0] + 1
            conv += inner.in_channels * (effective - inner.stride[0]) * _param_dtype_size(module)
            bookkeeping += 1 + 1  # exec_mask, first
        elif isinstance(module, StreamingConvTranspose1d):
            transposed = module.convtr.convtr
            conv += transposed.out_channels * (transposed.kernel_size[0] - transposed.stride[0]) * _param_dtype_size(module)
            bookkeeping += 1
        elif isinstance(module, StreamingTransformer):
            bookkeeping += 1 + 8  # exec_mask, offsets
        else:
            bookkeeping += 1  # every streaming state's exec_mask
    return kv, conv, bookkeeping


def slot_bytes(mimi: Any, lm: Any, *, guided: bool) -> SlotBytes:
    """State bytes per slot of ``mimi`` and ``lm`` served by ``LMGen`` (``guided``: with
    classifier-free guidance, two LM rows per slot)."""
    lm_rows = 2 if guided else 1
    depformer = getattr(lm, "depformer", None)
    lm_kv, lm_conv, lm_book = _tree_bytes(lm, skip=depformer)
    dep_kv, _, dep_book = _tree_bytes(depformer) if depformer is not None else (0, 0, 0)
    mimi_kv, mimi_conv, mimi_book = _tree_bytes(mimi)
    # LMGen's own state: exec_mask, offsets, the (codebooks x max_delay + 2) token cache, and with
    # a fuser the summed condition (one model-width vector per LM row).
    generator = 1 + 8 + lm.num_codebooks * (max(lm.delays) + 2) * 8
    if getattr(lm, "fuser", None) is not None and lm.fuser.fuse2cond.get("sum"):
        generator += lm_rows * lm.dim * _param_dtype_size(lm)
    return SlotBytes(lm_kv=lm_rows * lm_kv, depformer_kv=lm_rows * dep_kv, mimi_kv=mimi_kv,
                     mimi_conv=mimi_conv + lm_rows * lm_conv,
                     bookkeeping=lm_rows * (lm_book + dep_book) + mimi_book + generator)


def weight_bytes(*modules: Any) -> int:
    """Bytes of the parameters and buffers of ``modules`` (on any device, ``meta`` included)."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                total += tensor.numel() * tensor.element_size()
    return total


@attrs.frozen
class DeviceMemory:
    """What the device has, now."""

    free: int
    total: int
    #: Where the figures come from, for the messages (``torch.cuda.mem_get_info(cuda:0)``).
    source: str

    @property
    def reserve(self) -> int:
        return reserve_bytes(self.total)


def reserve_bytes(total: int) -> int:
    """Memory kept free beyond the slots' state on a device of ``total`` bytes."""
    return max(RESERVE_MIN, int(RESERVE_SHARE * total))


def slots_that_fit(per_slot: int, memory: DeviceMemory) -> int:
    """The most slots whose state fits the free memory, less the reserve."""
    return max(0, (memory.free - memory.reserve) // max(per_slot, 1))


def fits(total: int, weights: int, per_slot: int) -> int:
    """The most slots that fit a GPU of ``total`` bytes holding ``weights``: the arithmetic a
    load makes from ``mem_get_info``, for a GPU this process is not on (the CUDA context is
    taken as ``CUDA_CONTEXT_BYTES``)."""
    return slots_that_fit(per_slot, DeviceMemory(total - CUDA_CONTEXT_BYTES - weights, total, "arithmetic"))


def device_memory(device: str) -> DeviceMemory | None:
    """Free and total memory of ``device`` now: the GPU's (``torch.cuda.mem_get_info``), or
    the host's (``/proc/meminfo``'s MemAvailable) for ``cpu``; None where neither is known."""
    if device.startswith("cuda"):
        import torch

        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        free, total = torch.cuda.mem_get_info(index)
        # What torch's allocator holds but no tensor uses (temporaries of the build) is free too.
        cached = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
        return DeviceMemory(int(free + cached), int(total), f"torch.cuda.mem_get_info(cuda:{index})")
    try:
        with open("/proc/meminfo") as handle:
            fields = dict(line.split(":", 1) for line in handle if ":" in line)
        free = int(fields["MemAvailable"].split()[0]) * 1024
        total = int(fields["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    return DeviceMemory(free, total, "/proc/meminfo MemAvailable (host memory)")


#: ``(device) -> DeviceMemory | None``: what a backend reads unless given its own.
MemorySource = Callable[[str], "DeviceMemory | None"]


def gigabytes(count: int) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 10**8 else f"{count / 1e6:.2f} MB" if count >= 10**5 \
        else f"{count / 1e3:.1f} kB"


__all__ = ["SlotBytes", "DeviceMemory", "slot_bytes", "weight_bytes", "slots_that_fit", "fits",
           "device_memory", "reserve_bytes", "gigabytes", "MemorySource"]
