"""``duplexrt`` from a bare checkout: the CLI with nothing installed (a GPU machine lent bare).

An install maps the repository's ``cli/`` package to the name ``duplexrt_cli`` (pyproject.toml);
here that mapping is made for this process only, so nothing named ``cli`` is put anywhere
importable beyond this run.  ``duplexrt`` itself comes from the checkout (its root is put first on
``sys.path``) and the third-party packages from ``PYTHONPATH`` (a ``pip install --target`` folder).

    python3 benchmarks/bare_cli.py simulate --url ws://127.0.0.1:8000/v1/duplex --mode paced
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def import_cli():
    """The checkout's ``cli/`` package, imported as ``duplexrt_cli`` (once)."""
    if "duplexrt_cli" in sys.modules:
        return sys.modules["duplexrt_cli"]
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("duplexrt_cli", ROOT / "cli" / "__init__.py",
                                                  submodule_search_locations=[str(ROOT / "cli")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["duplexrt_cli"] = module
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    import_cli()
    from duplexrt_cli.app import main

    sys.argv[0] = "duplexrt"
    main()
