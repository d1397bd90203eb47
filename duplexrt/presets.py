"""The model presets: the TOML files of the repository's ``configs/`` folder, shipped in the wheel.

pyproject maps ``configs/`` to the package ``duplexrt.configs``, so a wheel carries the files as
``duplexrt/configs/*.toml`` and an editable install finds them in the checkout: one copy, read
through importlib.resources either way.  ``--config`` takes a preset's name or a path.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from duplexrt.config import ConfigError

PACKAGE = "duplexrt.configs"
SUFFIX = ".toml"


def _folder() -> Path:
    folder = resources.files(PACKAGE)
    # pip installs wheels unpacked, so the presets are plain files; load_config wants a path.
    if not isinstance(folder, Path):
        raise ConfigError(f"the presets in {folder} are not plain files; pass --config a file path")
    return folder


def names() -> list[str]:
    """Every preset's name, sorted: its file name without ``.toml``."""
    return sorted(p.stem for p in _folder().glob(f"*{SUFFIX}"))


def path(name: str) -> Path:
    """The file of preset ``name``; a clear error naming the presets when there is none."""
    if name in names():
        return _folder() / f"{name}{SUFFIX}"
    raise ConfigError(f"no preset named {name!r}; the presets are {', '.join(names())} "
                      f"(`duplexrt configs` lists them)")


def read_text(name: str) -> str:
    return path(name).read_text(encoding="utf-8")


def summary(name: str) -> str:
    """The first sentence of the preset's leading comment: its one line in ``duplexrt configs``."""
    words: list[str] = []
    for line in read_text(name).splitlines():
        if not line.startswith("#") or not line.strip("# "):
            break
        words.append(line.lstrip("#").strip())
    text = " ".join(words)
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


def resolve(value: str | os.PathLike[str] | None) -> Path | None:
    """A ``--config`` value as a file: a path that exists is used as it is (a file of yours wins
    over a preset of the same name); otherwise a bare name (``moshi-tiny``, or ``moshi-tiny.toml``)
    is a preset.  Anything else is one clear error, which names the preset a stale path meant.
    None or empty (``DUPLEXRT_CONFIG=`` in a container's settings) means the defaults."""
    if value is None or not os.fspath(value):
        return None
    given = Path(value)
    if given.exists():
        return given
    text = os.fspath(value)
    stem = given.name.removesuffix(SUFFIX)
    is_name = given.name == text
    if is_name and stem in names():
        return path(stem)
    if is_name and not text.endswith(SUFFIX):
        raise ConfigError(f"--config {text!r} is neither a file nor a preset; the presets are "
                          f"{', '.join(names())} (`duplexrt configs` lists them)")
    hint = f"; the built-in preset of that name is --config {stem}" if stem in names() else ""
    raise ConfigError(f"config file {text} does not exist{hint}")
