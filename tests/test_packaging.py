"""The product as a pip user gets it: the sdist and the wheel built from this checkout, the wheel
installed into a fresh virtual environment outside it, and the installed ``duplexrt serve``
serving one short session on the echo model and one on the tiny Moshi chosen by preset name.
Then the wheel alone, ``pip install duplexrt-*.whl`` into another fresh environment, as a user
trying the echo model does: no torch comes with it, echo and synthetic serve, and the moshi
backend refuses to start with one line naming what is missing and the command that installs it.

The install runs packaging/install.sh, the same commands ``make install`` and the Dockerfile
run, so what passes here is what the container image installs.  It takes about a minute: pip
runs from this environment into the new one (``--python``, no pip bootstrapped there) and skips
byte-compiling torch (PIP_COMPILE=0), which alone would cost another minute on two cores.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import pytest

#: About a minute on two cores; `pytest -m "not packaging"` leaves it out while iterating (CI,
#: `make test`, runs it).
pytestmark = pytest.mark.packaging

ROOT = Path(__file__).resolve().parent.parent
FRAME = 1920
#: Generous bounds for slow shared machines; they only stop a broken run from hanging the suite.
INSTALL_TIMEOUT_S = 900
START_TIMEOUT_S = 180
SESSION_TIMEOUT_S = 60


def _copy_checkout(dest: Path) -> None:
    """The files a commit would hold (tracked, and new ones git does not ignore): what a fresh
    clone builds from, without .venv or old build output."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked sdist)
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"))
        return
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():  # a file deleted but not yet committed is listed too
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, args))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def product(tmp_path_factory) -> dict:
    """Build both distributions from a copy of the checkout, install the wheel into a new venv."""
    work = tmp_path_factory.mktemp("packaging")
    source, dist, venv = work / "src", work / "dist", work / "venv"
    source.mkdir()
    _copy_checkout(source)
    # python -m build: the sdist first, then the wheel built from the unpacked sdist, so a file
    # the sdist forgets is missing from the wheel too.
    _run([sys.executable, "-m", "build", "--outdir", str(dist), str(source)])
    (sdist,) = dist.glob("duplexrt-*.tar.gz")
    (wheel,) = dist.glob("duplexrt-*.whl")
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    env = {**os.environ, "PIP": f"{sys.executable} -m pip --python {venv / 'bin' / 'python'}",
           "PIP_COMPILE": "0"}
    env.pop("PYTHONPATH", None)
    _run(["sh", str(ROOT / "packaging" / "install.sh"), str(wheel)], env=env, cwd=work)
    return {"work": work, "source": source, "sdist": sdist, "wheel": wheel, "bin": venv / "bin"}


def _outside_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("DUPLEXRT_")}
    return {**env, "NO_TORCH_COMPILE": "1", "PYTHONUNBUFFERED": "1"}


def test_the_wheel_carries_every_file_the_server_reads_and_the_licence(product):
    with zipfile.ZipFile(product["wheel"]) as wheel:
        names = set(wheel.namelist())
        metadata = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    presets = sorted(p.name for p in (product["source"] / "configs").glob("*.toml"))
    assert presets and {f"duplexrt/configs/{name}" for name in presets} <= names
    # Every non-Python file in the package (data the server reads at run time: the web page's
    # static files for GET / will live here once they exist) must ship in the wheel.
    package = product["source"] / "duplexrt"
    data = {f"duplexrt/{p.relative_to(package).as_posix()}" for p in package.rglob("*")
            if p.is_file() and p.suffix != ".py"}
    assert data <= names, f"missing from the wheel: {sorted(data - names)}"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in metadata
    with tarfile.open(product["sdist"]) as sdist:
        members = {m.name.split("/", 1)[1] for m in sdist.getmembers() if "/" in m.name}
    assert {"LICENSE", *(f"configs/{name}" for name in presets)} <= members


def test_the_installed_command_is_the_wheel_and_knows_its_version_and_presets(product):
    bin_, work = product["bin"], product["work"]
    found = _run([str(bin_ / "python"), "-c", "import duplexrt, duplexrt.configs, duplexrt_cli; "
                  "print(duplexrt.__file__, duplexrt.configs.__file__, duplexrt_cli.__file__)"],
                 cwd=work, env=_outside_env()).stdout.split()
    site = str(bin_.parent / "lib")
    assert all(path.startswith(site) for path in found), f"not the installed copy: {found}"
    version = product["wheel"].name.split("-")[1]
    assert _run([str(bin_ / "duplexrt"), "--version"], cwd=work, env=_outside_env()).stdout == \
        f"duplexrt {version}\n"
    listing = _run([str(bin_ / "duplexrt"), "configs"], cwd=work, env=_outside_env()).stdout
    presets = sorted(p.stem for p in (product["source"] / "configs").glob("*.toml"))
    assert [line.split()[0] for line in listing.splitlines()] == presets
    shown = _run([str(bin_ / "duplexrt"), "configs", "show", "default"], cwd=work, env=_outside_env()).stdout
    assert shown == (product["source"] / "configs" / "default.toml").read_text()


def _free_port() -> int:
    # The server is told its port rather than parsed out of its log, whose wording may change.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_ready(proc: subprocess.Popen, port: int, log: Path) -> dict:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as answer:
                return json.loads(answer.read())
        except (urllib.error.URLError, ConnectionError):  # not listening yet, or 503 while loading
            time.sleep(0.2)  # a real process starting: there is no event to wait on
    raise AssertionError(f"not ready after {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def _one_session(port: int, audio: np.ndarray) -> tuple[np.ndarray, dict]:
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{port}/v1/duplex", open_timeout=SESSION_TIMEOUT_S) as ws:
        assert json.loads(ws.recv(timeout=SESSION_TIMEOUT_S))["type"] == "session.created"
        ws.send(audio.tobytes())
        ws.send(json.dumps({"type": "input.end"}))
        received = b""
        while True:
            message = ws.recv(timeout=SESSION_TIMEOUT_S)
            if isinstance(message, bytes):
                received += message
            elif (event := json.loads(message))["type"] == "session.end":
                return np.frombuffer(received, dtype="<f4"), event


def _serve_one_session(command: list[str], work: Path, log: Path, seed: int) -> tuple[dict, np.ndarray, np.ndarray, dict]:
    """Start the installed server, talk one session, stop it with SIGTERM (exit status 0):
    its /readyz, the audio sent, the audio heard and the session's end."""
    port = _free_port()
    with log.open("w") as out:
        proc = subprocess.Popen([*command, "--port", str(port)], cwd=work, env=_outside_env(), stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        ready = _wait_ready(proc, port, log)
        audio = np.random.default_rng(seed).uniform(-0.5, 0.5, 4 * FRAME).astype("<f4")
        output, end = _one_session(port, audio)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return ready, audio, output, end


@pytest.mark.parametrize("preset", [None, "moshi-tiny"], ids=["default-echo", "moshi-tiny"])
def test_the_installed_server_serves_a_session_and_stops_on_sigterm(product, preset):
    command = [str(product["bin"] / "duplexrt"), "serve", "--log-level", "info",
               *(["--config", preset] if preset else [])]
    ready, audio, output, end = _serve_one_session(command, product["work"],
                                                   product["work"] / f"serve-{preset or 'default'}.log", seed=7)
    assert ready["backend"] == ("moshi" if preset else "echo")
    assert end["reason"] == "stop"
    assert len(output) == len(audio) and np.isfinite(output).all()
    if preset is None:  # the echo model, two frames late by default
        np.testing.assert_array_equal(output[2 * FRAME:], audio[:2 * FRAME])


@pytest.fixture(scope="module")
def bare(product) -> Path:
    """The wheel installed on its own (its declared dependencies, no extra): the bin folder."""
    venv = product["work"] / "bare-venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    env = {**os.environ, "PIP_COMPILE": "0"}
    env.pop("PYTHONPATH", None)
    _run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet",
          str(product["wheel"])], env=env, cwd=product["work"])
    return venv / "bin"


def test_the_wheel_alone_brings_no_torch_and_serves_echo_and_synthetic(product, bare):
    work = product["work"]
    probe = subprocess.run([str(bare / "python"), "-c", "import importlib.util as u; "
                            "print(u.find_spec('torch'), u.find_spec('moshi'))"],
                           capture_output=True, text=True, cwd=work, env=_outside_env(), check=True)
    assert probe.stdout.split() == ["None", "None"], probe.stdout
    ready, audio, output, end = _serve_one_session([str(bare / "duplexrt"), "serve"], work, work / "serve-bare.log",
                                                   seed=3)
    assert ready["backend"] == "echo" and end["reason"] == "stop"
    np.testing.assert_array_equal(output[2 * FRAME:], audio[:2 * FRAME])
    simulated = subprocess.run([str(bare / "duplexrt"), "simulate", "-b", "synthetic", "-o", "step_ms=1",
                                "--concurrency", "4", "--frames", "8", "--no-progress"],
                               capture_output=True, text=True, cwd=work, env=_outside_env(), timeout=120)
    assert simulated.returncode == 0, simulated.stderr[-3000:]


def test_the_moshi_backend_without_its_packages_names_them_all_and_the_command(product, bare):
    refused = subprocess.run([str(bare / "duplexrt"), "serve", "--port", "0", "--config", "moshi-tiny"],
                             capture_output=True, text=True, cwd=product["work"], env=_outside_env(),
                             timeout=120)
    assert refused.returncode == 2
    assert "Traceback" not in refused.stderr, refused.stderr
    [line] = [line for line in refused.stderr.splitlines() if line.startswith("duplexrt: error: ")]
    named = line.partition("not installed: ")[2].partition(". ")[0].split(", ")
    assert {"torch", "moshi", "einops", "sentencepiece"} <= set(named), line
    assert "torch first: on a CPU machine pip install torch==" in line and "duplexrt[moshi]" not in line, line
    assert line.endswith("pip install --no-deps moshi==0.2.13"), line


def test_the_dockerfile_installs_what_this_test_proves():
    """Images cannot be built here; the Dockerfile stays to the commands tested above."""
    text = (ROOT / "Dockerfile").read_text()
    assert "python -m build --outdir /dist /src" in text
    assert 'PIP="/opt/duplexrt/bin/python -m pip"' in text and "sh /tmp/install.sh /tmp/dist/*.whl" in text
    assert 'ENTRYPOINT ["duplexrt", "serve"]' in text and "/healthz" in text
    assert "\nUSER duplexrt\n" in text and "DUPLEXRT_PORT=8000" in text and "\nEXPOSE 8000\n" in text
