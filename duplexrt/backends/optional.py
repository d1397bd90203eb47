"""The optional packages of the moshi backend: torch, the moshi package and its light dependencies
(the ``moshi`` extra).  ``pip install duplexrt`` alone serves echo and synthetic without them.

Outside the backend's own package on purpose: importing that package imports torch, and this is
what says, before anything is imported, that torch is missing.  The error names everything that
is missing at once with the one command that installs it, rather than failing on the first import
inside the moshi package, one package per try.
"""

from __future__ import annotations

import importlib.util
import re

from duplexrt.config import ConfigError

#: What the moshi backend imports (itself, or through the moshi package), by module name, with the
#: requirement that installs it.  The light ones are the moshi package's own dependencies that
#: serving needs (its audio-device and web-server ones are not), with the ranges it runs with.
TORCH = ("torch", "torch")
#: The torch the tested route installs first (packaging/install.sh's default), and the index of its
#: CPU build (PyPI's Linux torch is the CUDA build, ~3 GB of CUDA wheels even on a CPU machine).
TORCH_PIN = "torch==2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
MOSHI = ("moshi", "moshi==0.2.13")
LIGHT = (
    ("safetensors", "safetensors>=0.4,<0.8"),
    ("huggingface_hub", "huggingface-hub>=0.24,<1.0"),
    ("einops", "einops>=0.7,<0.9"),
    ("sentencepiece", "sentencepiece>=0.2,<0.3"),
    ("tqdm", "tqdm>=4.48"),
)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or half-removed install
        return False


def missing_packages() -> list[str]:
    """The requirements of the moshi backend that are not installed, in install order."""
    return [requirement for module, requirement in (TORCH, *LIGHT, MOSHI) if not _importable(module)]


def install_command(missing: list[str], *, cuda: bool = False) -> str:
    """The one command line that installs ``missing``, the tested way (packaging/install.sh).

    torch first, pinned (``TORCH_PIN``): from its CPU index on a CPU machine, PyPI's CUDA build
    on a CUDA one (``cuda``).  The ``moshi`` extra is not the way: it resolves to the moshi
    package's own pins (torch<2.10, numpy<2.3), ~3 GB of CUDA wheels even on a CPU and numpy
    downgraded.  Then the moshi package goes in without its pins (``--no-deps``), after its
    light dependencies: its pins would otherwise replace that torch."""
    steps = []
    if TORCH[1] in missing:
        steps.append(f"pip install {TORCH_PIN}" + ("" if cuda else f" --index-url {TORCH_CPU_INDEX}"))
    light = [requirement for requirement in missing if requirement not in (MOSHI[1], TORCH[1])]
    if light:
        steps.append(f"pip install {' '.join(repr(r) if '<' in r or '>' in r else r for r in light)}")
    if MOSHI[1] in missing:
        steps.append(f"pip install --no-deps {MOSHI[1]}")
    return " && ".join(steps)


def check_installed() -> None:
    """Raise ConfigError naming every missing package of the moshi backend, and the command."""
    missing = missing_packages()
    if missing:
        names = ", ".join(re.split("[<>=]", requirement)[0] for requirement in missing)
        advice = f"Install them with: {install_command(missing)}"
        if TORCH[1] in missing:
            advice = (f"Install them as packaging/install.sh does, torch first: on a CPU machine "
                      f"{install_command(missing)}; on a CUDA machine {install_command(missing, cuda=True)}")
        raise ConfigError(f"backend.name = \"moshi\" needs packages that are not installed: {names}. {advice}")
