"""Importing the ``moshi`` package the way this backend needs it.

The package decides at import time whether to wrap its hot functions in ``torch.compile``; on a CPU
that makes the first steps take ~20 s, so ``NO_TORCH_COMPILE=1`` is set before the first import
when the model is to run on a CPU (an explicit setting in the environment is left alone).

torch and the moshi package are optional (duplexrt.backends.optional says what is missing).
"""

from __future__ import annotations

import logging
import os
import sys
from types import ModuleType

from duplexrt.backends.optional import MOSHI, check_installed, install_command
from duplexrt.config import ConfigError

log = logging.getLogger("duplexrt.backends.moshi")
_warned = False

def import_moshi(device: str = "cpu") -> ModuleType:
    """``moshi.models`` (loaders, LMGen, LMModel, MimiModel), imported for ``device``."""
    global _warned
    if not device.startswith("cuda"):
        if "moshi" not in sys.modules:
            os.environ.setdefault("NO_TORCH_COMPILE", "1")
        elif not os.environ.get("NO_TORCH_COMPILE") and not _warned:
            _warned = True
            log.warning("moshi was imported before NO_TORCH_COMPILE=1 was set: the first CPU steps "
                        "will be compiled by torch.compile (slow)")
    check_installed()
    try:
        import moshi.models as models
    except ImportError as exc:  # installed, but broken: say what failed, with the same advice
        raise ConfigError(f"backend.name = \"moshi\": the moshi package failed to import ({exc}); "
                          f"reinstall it with: {install_command([MOSHI[1]])}") from None
    return models
