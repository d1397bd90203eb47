"""SIGTERM or SIGINT while the model loads stops the process within seconds (Kubernetes sends
SIGTERM to a pod that is still loading), and a runtime cancelled during the load neither waits
for it nor leaves its thread running.

The slow load is a test-only backend, registered by the test itself (no config key for it): the
echo model whose ``load`` runs a long loop of torch operations and short sleeps, as a real
load is Python calling torch operation by operation.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import trio

from duplexrt.backends import BackendInfo
from duplexrt.backends.echo import EchoBackend
from duplexrt.config import load_config
from duplexrt.runtime import open_runtime
from tests.conftest import PATIENCE, scheduler_threads

#: Seconds the slow load would take if nothing stopped it: far longer than any bound below.
LOAD_S = 600
#: What "within a few seconds" means here, on two shared cores.
STOP_BOUND_S = 8.0

SLOW_SERVE = textwrap.dedent(f"""
    import sys, time
    import torch
    from duplexrt.backends import BACKENDS
    from duplexrt.backends.echo import EchoBackend

    class SlowLoad(EchoBackend):
        def load(self):
            print("loading the slow model", file=sys.stderr, flush=True)
            weights = torch.zeros(256, 256)
            deadline = time.monotonic() + {LOAD_S}
            while time.monotonic() < deadline:
                weights = torch.tanh(weights @ weights + 1)
                time.sleep(0.01)

    BACKENDS["slow"] = SlowLoad
    from duplexrt_cli.app import main
    sys.argv = ["duplexrt", "serve", "-b", "slow", "--port", "0", "--log-level", "info"]
    main()
""")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_the_load_stops_the_process_within_seconds(signum):
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SERVE], stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    loading = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if "loading the slow model" in line:
                loading.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert loading.wait(60), "".join(lines)
        time.sleep(0.5)  # well inside the load
        sent = time.monotonic()
        proc.send_signal(signum)
        code = proc.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(PATIENCE)
    log = "".join(lines)
    assert took < STOP_BOUND_S, f"took {took:.1f} s to stop:\n{log}"
    assert code == 0, log  # a clean exit: no thread killed inside torch at interpreter exit
    assert "the model has not finished loading" in log and "the model's load was stopped" in log
    assert "Traceback" not in log and "terminate called" not in log


class _SlowLoad(EchoBackend):
    """FAKE load (the echo model loads instantly): loops until interrupted, and says so."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.loading = threading.Event()
        self.unwound = threading.Event()

    def load(self) -> None:
        self.loading.set()
        try:
            deadline = time.monotonic() + LOAD_S
            while time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            self.unwound.set()


async def _cancel_while_loading(backend: EchoBackend, loading: threading.Event,
                                after_cancel=lambda: None) -> float:
    """Run a runtime on ``backend``, cancel it once ``loading`` is set; seconds it took to stop."""
    config = load_config(None, ["runtime.slots=2"])
    with trio.move_on_after(STOP_BOUND_S * 4) as guard:
        async with trio.open_nursery() as nursery:

            async def run() -> None:
                async with open_runtime(config, backend):
                    raise AssertionError("the runtime served after its load was stopped")

            nursery.start_soon(run)
            await trio.to_thread.run_sync(loading.wait, PATIENCE)
            started = time.monotonic()
            nursery.cancel_scope.cancel()
            after_cancel()
    assert not guard.cancelled_caught
    assert not scheduler_threads()
    return time.monotonic() - started


async def test_a_runtime_cancelled_while_loading_interrupts_the_load_and_its_thread_ends():
    backend = _SlowLoad(BackendInfo("echo", 24000, 1920, 2), {})
    assert await _cancel_while_loading(backend, backend.loading) < STOP_BOUND_S
    assert backend.unwound.is_set()  # its finally ran: it unwound, it was not abandoned


async def test_a_load_blocked_inside_a_c_call_is_stopped_when_the_call_returns():
    """The interruption lands at the next Python bytecode: a load blocked in a C call (here a
    lock's wait) goes on until that returns, then unwinds, and the runtime serves nothing."""

    class BlockedLoad(EchoBackend):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            self.loading = threading.Event()
            self.go_on = threading.Event()

        def load(self) -> None:
            self.loading.set()
            self.go_on.wait(PATIENCE)

    backend = BlockedLoad(BackendInfo("echo", 24000, 1920, 2), {})
    await _cancel_while_loading(backend, backend.loading, after_cancel=backend.go_on.set)
