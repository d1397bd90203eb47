"""``duplexrt``'s public surface is ``__all__``: every name there imports, and nothing else is public."""

from __future__ import annotations

import subprocess
import typing
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


def test_a_translator_s_events_are_public_beside_it():
    """Writing a protocol needs ``Translator`` and what its ``parse`` returns, from one place."""
    from duplexrt.protocols import base, events

    for name in ("AudioIn", "InputEnd", "ProtocolError", "Ignored", "Reply", "EndTurn", "Reconfigure",
                 "ClearInput", "ClearOutput", "SessionEnd"):
        assert name in duplexrt.__all__ and getattr(duplexrt, name) is getattr(events, name), name
    assert duplexrt.Translator is base.Translator and duplexrt.SessionProgress is base.SessionProgress
    # Every member of the Event union a parse may return is among them.
    assert {kind.__name__ for kind in typing.get_args(events.Event)} <= set(duplexrt.__all__)


def test_the_protocols_package_names_each_route_s_translator():
    import duplexrt.protocols as protocols
    from duplexrt.protocols.base import Translator

    for name in protocols.__all__:
        assert getattr(protocols, name) is not None, name
    translators = {name for name in protocols.__all__ if name.endswith("Translator") and name != "Translator"}
    assert translators == {"RawTranslator", "RealtimeTranslator", "LiveTranslator", "MoshiTranslator"}
    for name in translators:
        assert issubclass(getattr(protocols, name), Translator), name

