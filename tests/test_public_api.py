"""``duplexrt``'s public surface is ``__all__``: every name there imports, and nothing else is public."""

from __future__ import annotations

import subprocess
import sys
from types import ModuleType

import duplexrt


def test_every_public_name_imports_from_the_package():
    for name in duplexrt.__all__:
        exec(f"from duplexrt import {name}", {})  # noqa: S102 - the import statement a user writes
        assert getattr(duplexrt, name) is not None, name
    assert set(dir(duplexrt)) >= set(duplexrt.__all__)


def test_nothing_else_is_public_by_accident():
    public = {name for name, value in vars(duplexrt).items()
              if not name.startswith("_") and not isinstance(value, ModuleType)}
    assert public <= set(duplexrt.__all__) - {"__version__"}, public - set(duplexrt.__all__)
    assert "Runtime" in duplexrt.__all__ and "open_runtime" in duplexrt.__all__
    try:
        duplexrt.Scheduler  # noqa: B018 - internal: not reachable from the package
    except AttributeError as exc:
        assert "Scheduler" in str(exc)
    else:
        raise AssertionError("duplexrt.Scheduler is public")


def test_the_public_names_are_the_modules_own():
    from duplexrt.runtime import Runtime, open_runtime
    from duplexrt.wire.transport import Transport

    assert duplexrt.Runtime is Runtime and duplexrt.open_runtime is open_runtime
    assert duplexrt.Transport is Transport


def test_importing_the_package_loads_no_runtime():
    """``import duplexrt`` (and so ``duplexrt --version``) does not pull in trio or the server."""
    code = "import sys, duplexrt; print(sorted(m for m in sys.modules if m.startswith(('duplexrt.', 'trio'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
