"""torch.compile on a GPU needs a C compiler at run time: without one, serve eagerly and say so.

The ``moshi`` package wraps a few small kernels in ``torch.compile`` (``_rms_norm``, ``apply_rope``,
the gating kernel) unless ``NO_TORCH_COMPILE`` is set when it is imported.  On CUDA, Inductor
hands them to Triton, which builds a small C launcher at run time: it takes the compiler named by
``CC``, else ``gcc``, else ``clang`` from ``PATH``, and includes Python's ``Python.h``.  A CUDA
*runtime* container image has neither (pytorch/pytorch#170235), and the first warm-up step then
dies inside Triton ("Failed to find C compiler"): every pod in a crash loop.

``ensure_compiler(device)`` runs before the package is imported.  On a CUDA device, with
compilation still on, and no compiler or no ``Python.h`` to be found, it turns compilation off
(``NO_TORCH_COMPILE=1`` before the import; the package's own switch if it was imported already)
and logs one WARNING saying what is missing and what it costs.  The model then runs eagerly, with
its CUDA graphs: a few percent slower a step, never a crash.  The project's image installs
``gcc`` and the Python headers, so it compiles.
"""

from __future__ import annotations

import logging
import os
import shutil
import sysconfig
from collections.abc import Mapping
from pathlib import Path

from duplexrt.backends.moshi import internals

log = logging.getLogger("duplexrt.backends.moshi")

_warned = False


def find_c_compiler(environ: Mapping[str, str] | None = None) -> str | None:
    """The C compiler Triton would use, as it looks for one (``CC``, else ``gcc``, else
    ``clang`` on ``PATH``); None when there is none.  A ``CC`` naming nothing runnable is none."""
    environ = os.environ if environ is None else environ
    path = environ.get("PATH", os.defpath)
    named = environ.get("CC")
    if named:
        return shutil.which(named.split()[0], path=path)
    return shutil.which("gcc", path=path) or shutil.which("clang", path=path)


def python_headers() -> Path | None:
    """``Python.h`` of this interpreter (Triton's launcher includes it); None when absent."""
    include = sysconfig.get_paths().get("include")
    header = Path(include) / "Python.h" if include else None
    return header if header is not None and header.is_file() else None


def compile_enabled() -> bool:
    """Whether the moshi package would compile: ``NO_TORCH_COMPILE`` unset at its import, and
    its own switch not thrown since."""
    if os.environ.get("NO_TORCH_COMPILE"):
        return False
    return not internals.compile_switched_off()


def missing_for_compile(environ: Mapping[str, str] | None = None) -> list[str]:
    """What torch.compile on CUDA lacks here (empty: nothing)."""
    missing = []
    if find_c_compiler(environ) is None:
        missing.append("a C compiler (CC, gcc or clang on PATH)")
    if python_headers() is None:
        missing.append(f"Python's headers (Python.h under {sysconfig.get_paths().get('include')})")
    return missing


def ensure_compiler(device: str) -> str | None:
    """Before the moshi package is imported for ``device``: where torch.compile would need what is
    missing, turn it off (one WARNING per process).  Returns why it is off, or None."""
    global _warned
    if not device.startswith("cuda") or not compile_enabled():
        return None
    missing = missing_for_compile()
    if not missing:
        return None
    os.environ["NO_TORCH_COMPILE"] = "1"  # read by the package at its import
    internals.switch_compile_off()  # imported already: its wrappers still look at this switch every call
    reason = f"torch.compile is off: Triton needs {' and '.join(missing)} to compile on {device}"
    if not _warned:
        _warned = True
        log.warning("moshi backend: %s, and none is here; the model runs eagerly (with its CUDA graphs), a "
                    "little slower a step.  Install one (Debian/Ubuntu: apt-get install gcc libc6-dev "
                    "python3-dev) to compile; NO_TORCH_COMPILE=1 says the same without this warning", reason)
    return reason
