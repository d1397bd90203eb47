"""A private PulseAudio daemon with one null sink: a sound card for a headless browser.

Firefox plays an AudioContext through a real audio server or not at all: with none to reach,
the context stays "suspended" and its resume() never settles (the talk page then reports that it
could not start audio).  Debian's firefox-esr has no mock audio backend to stand in, and its
null one (``media.cubeb.force_null_context``) keeps the context from ever resuming, even with a
server there.  A null sink consumes what is played at the real-time pace, as a sound card would,
and plays it nowhere.

The daemon is the test's own: its socket, runtime, state and home directories lie in a temporary
directory, so it neither finds nor disturbs a desktop's sound server, and it works as root (CI)
as well as for a user.  The browser reaches it through ``PULSE_SERVER``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

PULSEAUDIO = shutil.which("pulseaudio")


@asynccontextmanager
async def audio_server(running: bool = True) -> AsyncIterator[dict[str, str]]:
    """The environment a browser needs to play into a null sink, the daemon up until the end.

    With ``running`` False no daemon starts and the environment points at a socket nothing
    listens on: a browser with no audio output at all, whatever sound server the machine has
    (and with ``PULSE_SERVER`` set, the client library does not spawn one of its own).
    """
    with tempfile.TemporaryDirectory(prefix="duplexrt-pulse-", ignore_cleanup_errors=True) as directory:
        root = Path(directory)
        socket = root / "native"
        browser_env = {"PULSE_SERVER": f"unix:{socket}"}
        if not running:
            yield browser_env
            return
        assert PULSEAUDIO is not None
        for name in ("home", "runtime", "state"):
            (root / name).mkdir()
        daemon_env = os.environ | {"HOME": str(root / "home"), "XDG_RUNTIME_DIR": str(root / "runtime"),
                                   "PULSE_RUNTIME_PATH": str(root / "runtime"),
                                   "PULSE_STATE_PATH": str(root / "state")}
        args = [PULSEAUDIO, "--daemonize=no", "--use-pid-file=no", "--log-target=stderr",
                # No default.pa (it would look for sound cards, D-Bus, X11): only what is loaded here.
                "-n", "--load=module-null-sink",
                f"--load=module-native-protocol-unix socket={socket} auth-anonymous=1",
                # Up for the whole test: not stopped when idle between pages nor by a client, and
                # not killed by its CPU-time guard when a loaded machine makes it run late.
                "--exit-idle-time=-1", "--disallow-exit", "--no-cpu-limit"]
        log = root / "pulseaudio.log"
        with log.open("wb") as stderr:
            process = await trio.lowlevel.open_process(args, env=daemon_env, stdin=subprocess.DEVNULL,
                                                       stdout=subprocess.DEVNULL, stderr=stderr,
                                                       start_new_session=True)
        try:
            # The socket appears once the protocol module listens on it, after the sink exists.
            with trio.move_on_after(15):
                while process.poll() is None and not socket.exists():
                    await trio.sleep(0.02)
            if not socket.exists():
                raise RuntimeError(f"pulseaudio did not open {socket}:\n{log.read_text(errors='replace')[-2000:]}")
            yield browser_env
        finally:
            with trio.CancelScope(shield=True):
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
                    with trio.move_on_after(5):
                        await process.wait()
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
