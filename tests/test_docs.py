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


def test_the_architecture_map_names_every_module_and_only_modules_that_exist():
    """docs/architecture.md is the reader's map of the folders: each module of the library is
    named there (by path, or by name inside its folder's row), and each path it names exists."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    library = ROOT / "duplexrt"
    named_paths = set(re.findall(r"`(duplexrt/[\w/]+(?:\.py|/))`", text))
    missing_paths = [p for p in sorted(named_paths) if not (ROOT / p).exists()]
    assert missing_paths == [], f"docs/architecture.md names paths that do not exist: {missing_paths}"
    unnamed = []
    for path in sorted(library.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py" or relative in named_paths:
            continue
        if f"`{path.stem}`" not in text and f"`{path.name}`" not in text:
            unnamed.append(relative)
    assert unnamed == [], f"modules docs/architecture.md does not name: {unnamed}"
