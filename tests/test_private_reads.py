"""No module of the library reads another object's private attributes, ours or a package's.

A name with a leading underscore is its module's own business: reaching into it from elsewhere
ties two modules together behind their interfaces' backs, and breaks silently when the other
side changes.  Reading source with ``ast`` finds every ``obj._name`` and ``getattr(obj, "_name")``
where ``obj`` is not ``self`` or ``cls``.  The exceptions are few and named here, each with why.
"""

from __future__ import annotations

import ast
from pathlib import Path

import duplexrt

LIBRARY = Path(duplexrt.__file__).parent

#: Where a private read is the point.
ALLOWED = {
    # The one place that touches the moshi package's private state, and says so.
    "backends/moshi/internals.py",
    # The Realtime VAD's two private entry points (webrtcvad's C call, numpy's FFT ufunc), each
    # used only once it has answered as the public call does.
    "protocols/vad_entry_points.py",
}
#: Underscore names that are public API by their owners' convention (namedtuple's).
PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make"}


def _own_names(cls: ast.ClassDef) -> set[str]:
    """What a class defines for itself: its methods, ``self.x = ...`` and ``__slots__``."""
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id == "self":
                    names.add(target.attr)
                elif isinstance(target, ast.Name) and target.id == "__slots__" and node.value is not None:
                    names.update(e.value for e in ast.walk(node.value)
                                 if isinstance(e, ast.Constant) and isinstance(e.value, str))
    return names


def _private_reads(tree: ast.AST) -> list[tuple[int, str]]:
    own: dict[int, set[str]] = {}  # node -> the names its enclosing class defines
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            names = _own_names(node)
            for inner in ast.walk(node):
                own.setdefault(id(inner), set()).update(names)
    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute):
            name, owner = node.attr, node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            name, owner = node.args[1].value, node.args[0]
        if name is None or not name.startswith("_") or name.startswith("__") or name in PUBLIC_UNDERSCORE:
            continue
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        # Another instance of the same class (``copy._counts`` in a method of Histogram) is the
        # class's own business: allowed where the enclosing class defines that name itself.
        if name in own.get(id(node), ()):
            continue
        found.append((node.lineno, name))
    return found


def test_no_module_reads_another_object_s_private_attributes():
    offenders = []
    for path in sorted(LIBRARY.rglob("*.py")):
        relative = path.relative_to(LIBRARY).as_posix()
        if relative in ALLOWED:
            continue
        for line, name in _private_reads(ast.parse(path.read_text(), str(path))):
            offenders.append(f"duplexrt/{relative}:{line}: {name}")
    assert offenders == []


def test_the_check_finds_a_private_read():
    """The scan itself: a read of another object's private name is found, the same class's
    and self's are not."""
    source = (
        "def f(other):\n    return other._secret, getattr(other, '_hidden')\n"
        "class A:\n    def __init__(self):\n        self._same_class = 1\n"
        "    def g(self, b):\n        return self._mine, b._same_class, b.lease._elsewhere\n"
    )
    assert sorted(_private_reads(ast.parse(source))) == [(2, "_hidden"), (2, "_secret"), (7, "_elsewhere")]
