"""No C compiler on a CUDA machine (a CUDA runtime image): the moshi backend turns torch.compile off
before the package is imported, with one WARNING, instead of dying in Triton at the first warm-up
step (``backends/moshi/compiler.py``).

FAKE: no GPU here.  ``torch.cuda.is_available`` is made to say yes so that a ``cuda`` device is
accepted, and the load is stopped where the model would be built: what is checked is what the
package was imported with.  The missing compiler is real: ``PATH`` names an empty folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from duplexrt.backends.moshi import compiler

pytest.importorskip("torch")
pytest.importorskip("moshi")


def _executable(folder, name: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)


def test_the_compiler_is_found_as_triton_finds_it(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert compiler.find_c_compiler({"PATH": str(empty)}) is None
    tools = tmp_path / "tools"
    tools.mkdir()
    _executable(tools, "clang")
    assert compiler.find_c_compiler({"PATH": str(tools)}) == str(tools / "clang")
    _executable(tools, "gcc")
    assert compiler.find_c_compiler({"PATH": str(tools)}) == str(tools / "gcc")  # gcc first, as Triton
    # CC wins, and a CC naming nothing runnable is no compiler (Triton would fail on it).
    assert compiler.find_c_compiler({"PATH": str(tools), "CC": "clang -O2"}) == str(tools / "clang")
    assert compiler.find_c_compiler({"PATH": str(tools), "CC": "/nonexistent/cc"}) is None
    assert compiler.missing_for_compile({"PATH": str(empty)})[0].startswith("a C compiler")


_PROBE = textwrap.dedent("""
    import logging, os, sys
    import torch
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    torch.cuda.is_available = lambda: True  # FAKE: the settings accept cuda:0
    from duplexrt.backends.base import BackendInfo
    from duplexrt.backends.moshi import backend as moshi_backend, model as moshi_model

    class Stop(Exception):
        pass

    def build(settings, models, torch_module):
        from moshi.modules import transformer
        print("compiled", hasattr(transformer._rms_norm, "__wrapped__"), flush=True)
        print("env", os.environ.get("NO_TORCH_COMPILE"), flush=True)
        raise Stop()

    moshi_backend.select_device = lambda cuda, device: None
    moshi_model.load_weights = build
    for _ in range(2):  # two loads, one warning
        backend = moshi_backend.MoshiBackend(BackendInfo("moshi", 24000, 1920, 2), {"tiny": True, "device": "cuda:0"})
        try:
            backend.load()
        except Stop:
            pass
""")


def _probe(path: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_TORCH_COMPILE", "CC")}
    env["PATH"] = path
    return subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_without_a_compiler_a_cuda_load_imports_moshi_eager_with_one_warning(tmp_path):
    done = _probe(str(tmp_path))  # an empty folder: no cc, gcc or clang
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled False" in done.stdout and "env 1" in done.stdout, done.stdout
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING") and "torch.compile is off" in line]
    assert len(warnings) == 1, done.stderr[-3000:]
    assert "a C compiler (CC, gcc or clang on PATH)" in warnings[0] and "apt-get install gcc" in warnings[0]


def test_with_a_compiler_a_cuda_load_compiles_as_before(tmp_path):
    if compiler.python_headers() is None:
        pytest.skip("this Python has no headers: compiling would be turned off here too")
    _executable(tmp_path, "gcc")
    done = _probe(str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled True" in done.stdout and "env None" in done.stdout, done.stdout
    assert "torch.compile is off" not in done.stderr


def test_moshi_imported_already_is_switched_off_through_its_own_flag(tmp_path, monkeypatch):
    import moshi.utils.compile as package_compile

    monkeypatch.delenv("NO_TORCH_COMPILE", raising=False)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(package_compile, "_compile_disabled", False)
    monkeypatch.setattr(compiler, "_warned", True)  # the warning is the subprocess test's
    assert compiler.ensure_compiler("cpu") is None  # a CPU never compiles here: nothing to do
    reason = compiler.ensure_compiler("cuda:1")
    assert reason is not None and "cuda:1" in reason
    assert package_compile._compile_disabled is True and os.environ["NO_TORCH_COMPILE"] == "1"
    assert compiler.ensure_compiler("cuda:1") is None  # off already
