"""``/healthz`` is liveness: 200 while the process serves, 503 once the model has failed every step
for ``liveness.FAILING_S`` (a sticky CUDA error), so that Kubernetes restarts the Pod
(``server/liveness.py``).  A backend whose steps raise stands in for the broken GPU."""

from __future__ import annotations

import threading

import numpy as np
import trio

from conftest import backend_info, duplex_session, http_get
from duplexrt.backends.echo import EchoBackend
from duplexrt.server.liveness import FAILING_S, Liveness

FRAME = 1920


class BrokenEcho(EchoBackend):
    """FAKE: the echo model whose steps raise while ``broken`` is set, as after a sticky CUDA error."""

    def __init__(self, config) -> None:
        super().__init__(backend_info(config, "echo"), config.backend.options)
        self.broken = threading.Event()
        self.broken.set()

    def step(self, rows, inputs, outputs):
        if self.broken.is_set():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().step(rows, inputs, outputs)


def test_only_a_sustained_failure_fails_liveness():
    now = [100.0]
    liveness = Liveness(30.0, clock=lambda: now[0])
    assert liveness.answer(False)[0] == 200
    assert liveness.answer(True)[0] == 200  # the first check that sees it: the count starts
    now[0] += 29.0
    assert liveness.answer(True)[0] == 200
    now[0] += 1.0
    status, body, _ = liveness.answer(True)
    assert status == 503 and body.startswith(b"model_failing: every model step has failed for 30 s")
    assert liveness.answer(False)[0] == 200  # a step worked: alive again, and the count starts over
    now[0] += 100.0
    assert liveness.answer(True)[0] == 200
    assert FAILING_S <= 60


async def test_healthz_fails_while_the_model_fails_every_step_and_recovers_with_it(start_server):
    from duplexrt.config import load_config

    config = load_config(None, ["runtime.slots=4", "backend.options.delay_frames=0"])
    backend = BrokenEcho(config)
    running = await start_server("runtime.max_consecutive_step_failures=1", backend=backend)
    running.server.liveness.failing_s = 0.2  # the test's patience; FAILING_S in a deployment
    assert (await http_get(running.port, "/healthz"))[0] == 200
    noise = np.random.default_rng(1).standard_normal(FRAME).astype(np.float32) * 0.1
    await duplex_session(running.url("/v1/duplex"), noise)  # one failed step: the model is failing
    assert (await http_get(running.port, "/readyz"))[0] == 503
    assert (await http_get(running.port, "/healthz"))[0] == 200  # not for long enough yet
    await trio.sleep(0.3)
    status, _, body = await http_get(running.port, "/healthz")
    assert status == 503 and body.startswith(b"model_failing"), body
    backend.broken.clear()
    received, _ = await duplex_session(running.url("/v1/duplex"), noise)  # a step that works
    assert received == noise.tobytes()
    assert (await http_get(running.port, "/healthz"))[0] == 200
