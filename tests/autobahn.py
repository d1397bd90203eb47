"""The Autobahn|Testsuite (autobahntestsuite 25.10.1, Python 2.7) for tests/test_autobahn.py.

The suite runs on Python 2.7 only.  It is installed once, with pip's ``--target``, into
``.venv-autobahn/`` at the repository's root (ignored by git; ``DUPLEXRT_AUTOBAHN_DIR`` moves it),
by the Python 2.7 that ``DUPLEXRT_PYTHON2`` names, or else the first of ``python2.7`` on the PATH
and pyenv's 2.7 versions.  setuptools 44 (the last for 2.7) goes in first: the suite's own
dependencies are built with it.

    python3 tests/autobahn.py install     # what .ci/run does before the tests

Standard library only: CI runs it before the project's virtual environment exists.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

VERSION = "25.10.1"
ROOT = Path(__file__).resolve().parents[1]
TARGET = Path(os.environ.get("DUPLEXRT_AUTOBAHN_DIR", ROOT / ".venv-autobahn"))
#: Runs ``wstest`` with the target folder as a site directory (its namespace packages' .pth files
#: are read, which PYTHONPATH alone would not do).
WSTEST = ("import site, sys; site.addsitedir(sys.argv.pop(1)); "
          "from autobahntestsuite.wstest import run; sys.argv[0] = 'wstest'; run()")


class Unavailable(Exception):
    """Why the suite cannot run here (no Python 2.7, or pip could not install it)."""


def python2() -> str:
    """A Python 2.7 interpreter, or Unavailable."""
    named = os.environ.get("DUPLEXRT_PYTHON2")
    roots = {os.environ.get("PYENV_ROOT", ""), os.path.expanduser("~/.pyenv")} - {""}
    candidates = [named] if named else [
        *(path for root in sorted(roots) for path in sorted(glob.glob(f"{root}/versions/2.7*/bin/python2.7"),
                                                            reverse=True)),
        shutil.which("python2.7"),  # last: pyenv's shim is there even where 2.7 is not selected
    ]
    for candidate in candidates:
        if candidate and _is_python27(candidate):
            return candidate
    raise Unavailable("no Python 2.7 found (autobahntestsuite runs on 2.7 only): install one "
                      "(pyenv install 2.7.18) or name it in DUPLEXRT_PYTHON2")


def _is_python27(path: str) -> bool:
    try:
        checked = subprocess.run([path, "-c", "import sys; assert sys.version_info[:2] == (2, 7)"],
                                 capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return checked.returncode == 0


def installed() -> bool:
    return (TARGET / f"autobahntestsuite-{VERSION}.dist-info").is_dir()


def install() -> Path:
    """The folder the suite is installed in, installing it first if needed; or Unavailable."""
    if installed():
        return TARGET
    interpreter = python2()
    # The machine's pip constraints are for the project's Python 3 packages, not these.
    env = {**os.environ, "PIP_CONSTRAINT": "", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONWARNINGS": "ignore"}
    partial = TARGET.with_name(TARGET.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    for requirement in ("setuptools==44.0.0", f"autobahntestsuite=={VERSION}"):
        done = subprocess.run([interpreter, "-m", "pip", "install", "--quiet", "--target", str(partial), requirement],
                              env={**env, "PYTHONPATH": str(partial)}, capture_output=True, text=True)
        if done.returncode:
            shutil.rmtree(partial, ignore_errors=True)
            raise Unavailable(f"pip on {interpreter} could not install {requirement}: "
                              f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    shutil.rmtree(TARGET, ignore_errors=True)
    partial.rename(TARGET)  # whole or not at all: an interrupted install is never taken for one
    return TARGET


def wstest_command(*args: str) -> list[str]:
    """The command line of ``wstest ARGS`` from the installed suite."""
    return [python2(), "-c", WSTEST, str(TARGET), *args]


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        raise SystemExit("usage: python3 tests/autobahn.py install")
    try:
        print(f"autobahntestsuite {VERSION} in {install()}")
    except Unavailable as exc:
        raise SystemExit(f"autobahntestsuite: {exc}") from None
