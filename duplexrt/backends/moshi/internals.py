"""Every read or write of the ``moshi`` package's private state, in one place, on purpose.

moshi 0.2.13 offers no public way to do these, and the backend needs them:

* a row reset must restore each streaming module's state for that row only, and a row move copy
  all of it, which means walking the modules' ``_streaming_state`` and every attribute of it,
  the base ``State``'s private ``_set_exec_mask_graphed`` included (``rows``);
* a tiny random model must look like a trained one to Mimi's quantizer: its codebooks are marked
  initialised (``_initialized``) and their cached ``_embedding`` dropped so it is recomputed from
  the random centroids (``tiny``).

* the filled-only attention (``attention``) reads each temporal attention's K/V through its
  own ``_complete_kv`` (the method ``StreamingMultiheadAttention.forward`` calls to write this
  step's K/V into the ring and get back the keys, values and positions it attends over), so it
  replaces that method on the module instance, and calls the package's own from inside.

* a step sized to the active calls (``buckets``) puts its own state objects on each streaming
  module (``_streaming_state``) for the length of the step, and the batch's back after it.

* torch.compile is switched off, where the package was imported already, by its own module-level
  switch (``moshi.utils.compile._compile_disabled``, which its wrappers read at every call)
  (``compiler``).
* PersonaPlex's prompt opens each stream with the LM's initial tokens (``_get_initial_token``),
  and its checkpoint is built from the package's own Moshi 7B arguments (``loaders._lm_kwargs``)
  (``prompter``, ``personaplex``).

Nothing else in duplexrt touches a name of moshi's that starts with an underscore.  A new moshi
version is checked here first: each function says what it relies on.
"""

from __future__ import annotations

from typing import Any


def streaming_state(module: Any) -> Any | None:
    """A ``StreamingModule``'s state dataclass while it streams (``module._streaming_state``),
    or None when it is not streaming."""
    return getattr(module, "_streaming_state", None)


#: The attribute a ``StreamingModule`` keeps its state in.
STREAMING_STATE = "_streaming_state"


def streaming_state_holder(module: Any) -> dict[str, Any]:
    """The attribute dictionary holding ``module``'s streaming state (``module._streaming_state``,
    a plain attribute, so in ``vars(module)``): a bucket's state objects go on and come off every
    streaming module around each step (``buckets``), a hundred or so for Moshi, and writing the
    dictionary costs a tenth of ``nn.Module.__setattr__`` (or of the package's
    ``set_streaming_state``, which walks the tree by name)."""
    holder: dict[str, Any] = vars(module)
    if STREAMING_STATE not in holder:
        raise RuntimeError(f"{type(module).__name__} keeps no {STREAMING_STATE} attribute: not the moshi "
                           "package's StreamingModule this was written for")
    return holder


def attributes(obj: Any) -> dict[str, Any]:
    """Every attribute a state object (or an object it holds, a ``RingKVCache``) has, private
    ones included (``vars``): the walk must see what the package adds, not only its dataclass
    fields."""
    return dict(vars(obj))


def mark_codebook_initialised(codebook: Any) -> None:
    """Tell a ``EuclideanCodebook`` whose centroids were just set that it needs no k-means
    initialisation (``_initialized``), and drop its cached embedding (``_embedding``) so that the
    next use recomputes it from the new centroids."""
    codebook._initialized.fill_(1.0)
    codebook.register_buffer("_embedding", None, persistent=False)


def initial_tokens(lm: Any) -> list[int]:
    """The token each codebook's stream opens with (``LMModel._get_initial_token``), text first."""
    return [int(t) for t in lm._get_initial_token()[0, :, 0].tolist()]


def moshi_7b_lm_kwargs() -> dict[str, Any]:
    """A copy of the package's Moshi 7B LM arguments (``loaders._lm_kwargs``)."""
    from moshi.models import loaders

    return dict(loaders._lm_kwargs)


def package_complete_kv(attention: Any) -> Any:
    """The package's own ``StreamingMultiheadAttention._complete_kv`` bound to ``attention``
    (whatever the instance holds in its place): ``(k, v) -> KVCacheResult(keys, values,
    positions)``, the ring written with this step's K/V (``RingKVCache.complete``) and read whole."""
    return type(attention)._complete_kv.__get__(attention)


def replace_complete_kv(attention: Any, complete: Any | None) -> None:
    """Make ``attention.forward`` read its K/V through ``complete`` (same signature as
    ``_complete_kv``), an attribute of the instance; None puts the package's own back.  Relies on
    ``forward`` calling ``self._complete_kv(k, v)`` once per call and using only the three fields
    of what it returns (moshi 0.2.13)."""
    if complete is None:
        attention.__dict__.pop("_complete_kv", None)
    else:
        attention._complete_kv = complete


def replaced_complete_kv(attention: Any) -> Any | None:
    """What ``replace_complete_kv`` put on ``attention`` (None: the package's own is used)."""
    return attention.__dict__.get("_complete_kv")


def compile_switched_off() -> bool:
    """Whether the package's own torch.compile switch is thrown (``_compile_disabled`` of
    ``moshi.utils.compile``, if that module is imported)."""
    import sys

    module = sys.modules.get("moshi.utils.compile")
    return module is not None and bool(getattr(module, "_compile_disabled", False))


def switch_compile_off() -> None:
    """Throw the package's torch.compile switch, where ``moshi.utils.compile`` is imported (its
    wrappers look at it every call); before its import ``NO_TORCH_COMPILE`` does the same."""
    import sys

    module = sys.modules.get("moshi.utils.compile")
    if module is not None:
        module._compile_disabled = True  # type: ignore[attr-defined]
