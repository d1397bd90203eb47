"""The docs stay true to the tests: every test that docs/promises.md names exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name for node in tree.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")}


def test_every_test_named_in_the_promise_table_exists():
    table = (ROOT / "docs" / "promises.md").read_text(encoding="utf-8")
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", table)
    assert len(named) >= 40, "the table lost its rows"
    missing = [f"{file}::{name}" for file, name in named
               if not (ROOT / file).exists() or name not in _test_names(ROOT / file)]
    assert missing == [], f"docs/promises.md names tests that do not exist: {missing}"
