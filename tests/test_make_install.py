"""The two commands install different sets: ``make run`` what ``serve`` needs for the echo model
(packaging/install.sh --no-torch: no torch, no test extras), ``make test`` the full set.  Their
stamps tell them apart, so ``make run`` then ``make test`` installs the rest and ``make test``
then ``make run`` installs nothing.  Checked with ``make -n`` (what make would run) over a fake
virtual environment: fast, nothing installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _planned(target: str, venv: Path) -> str:
    """What ``make TARGET`` would run, as a top-level make prints it (this suite runs under
    ``make test``, whose variables would make it a sub-make that names its directories)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")}
    return subprocess.run(["make", "--no-print-directory", "-n", target, f"VENV={venv}"], cwd=ROOT,
                          capture_output=True, text=True, check=True, timeout=60, env=env).stdout


def _stamp(path: Path) -> None:
    path.touch()
    later = time.time() + 60  # newer than any file the stamps depend on, even one edited just now
    os.utime(path, (later, later))


def test_run_installs_the_serve_set_and_test_the_full_set_and_the_stamps_tell_them_apart(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    _stamp(venv / "bin" / "python")

    fresh_run = _planned("run", venv)
    assert "sh packaging/install.sh --no-torch -e .\n" in fresh_run and "[test]" not in fresh_run
    assert fresh_run.rstrip().endswith(f"{venv}/bin/duplexrt serve")
    fresh_test = _planned("test", venv)
    assert "sh packaging/install.sh -e '.[test]'" in fresh_test and "--no-torch" not in fresh_test

    _stamp(venv / ".installed-serve")  # after `make run`
    assert "install.sh" not in _planned("run", venv)
    assert "sh packaging/install.sh -e '.[test]'" in _planned("test", venv)  # the rest

    _stamp(venv / ".installed-test")  # after `make test`, which stamps both
    (venv / ".installed-serve").unlink()
    assert "install.sh" not in _planned("test", venv)
    other = tmp_path / "other"
    assert f"touch {other}/.installed-test {other}/.installed-serve" in _planned("test", other)


def test_the_install_script_skips_torch_and_moshi_on_request_and_says_each_step():
    script = (ROOT / "packaging" / "install.sh").read_text()
    skip = script.index('"--no-torch" ]')
    torch, deps, moshi = (script.index(s) for s in ('$PIP install --quiet "$TORCH"', '$PIP install --quiet "$@"',
                                                     "--no-deps moshi=="))
    assert skip < torch < deps < script.index('[ "$with_torch" = 1 ] || exit 0') < moshi
    assert script.count('step "') >= 4
