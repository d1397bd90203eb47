"""mypy checks ``duplexrt/`` and ``cli/`` with the configuration in pyproject.toml (``[tool.mypy]``):
no error anywhere, so that a type checker can follow what the code promises (a step's output
through ``SlotOwner``, a session's parts through what each is built with)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

def _mypy(*arguments: str, cwd: Path = ROOT) -> list[dict[str, object]]:
    """Run mypy (the configuration it finds in ``cwd``) and return its messages, one dict each."""
    if not (ROOT / "pyproject.toml").is_file():
        pytest.fail("tests/test_types.py runs from a checkout: pyproject.toml holds the mypy configuration")
    done = subprocess.run([sys.executable, "-m", "mypy", "--output", "json", *arguments],
                          cwd=cwd, capture_output=True, text=True, check=False)
    messages = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    # 0: clean; 1: errors found, each a line of JSON.  Anything else (2, or 1 with no error: mypy
    # missing, a bad configuration, a crash) is mypy failing to run, not a verdict.
    if done.returncode not in (0, 1) or (done.returncode == 1 and not messages):
        pytest.fail(f"mypy could not run ({done.returncode}; it is in the test extra):\n{done.stdout}{done.stderr}")
    return messages


def _errors_by_file(messages: list[dict[str, object]]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = defaultdict(list)
    for message in messages:
        if message["severity"] == "error":
            found[str(message["file"])].append(f"{message['file']}:{message['line']}: "
                                               f"{message['message']}  [{message['code']}]")
    return dict(found)


def test_mypy_finds_no_error():
    found = _errors_by_file(_mypy("duplexrt", "cli"))
    errors = [line for _path, lines in sorted(found.items()) for line in lines]
    assert errors == [], "mypy errors:\n" + "\n".join(errors)


def test_the_configuration_catches_what_it_promises(tmp_path):
    """The settings in pyproject.toml are the ones in force: a module breaking each of them is
    reported once per rule, under the rule's own code."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "sample.py").write_text(
        "from typing import cast\n"
        "def half(x: int, y) -> int:\n"               # a def annotated in part
        "    return x\n"
        "def implied(x: int = None) -> int:\n"          # an Optional left implicit
        "    return 0\n"
        "def untyped():\n"                             # an unannotated body is still checked
        "    return 1 + ''\n"
        "def never(x: int) -> bool:\n"
        "    return x == 'a'\n"                        # a comparison that cannot be true
        "y = cast(int, 1)\n"                           # a cast that does nothing
        "z = 1  # type: ignore[assignment]\n"          # an ignore that hides nothing
    )
    codes = sorted((int(str(m["line"])), str(m["code"])) for m in _mypy("sample.py", cwd=tmp_path)
                   if m["severity"] == "error")
    assert codes == [(2, "no-untyped-def"), (4, "assignment"), (7, "operator"), (9, "comparison-overlap"),
                     (10, "redundant-cast"), (11, "unused-ignore")]
