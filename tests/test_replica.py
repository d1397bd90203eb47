"""What one replica tells a load balancer: its name (/readyz, /metrics, the upgrade response,
the log) and, while it drains, /readyz 503 ``draining`` for as long as admitted sessions finish."""

from __future__ import annotations

import json
import logging
import socket

import pytest
import trio
import trio_websocket

from duplexrt.config import ConfigError, load_config
from duplexrt.server.app import serve
from conftest import http_get
from test_server import _config

PATIENCE = 10.0


async def test_the_replica_id_is_in_readyz_metrics_and_the_upgrade_response(start_server):
    running = await start_server('server.replica_id="gpu-3"')
    status, _, body = await http_get(running.port, "/readyz")
    assert status == 200 and json.loads(body)["replica_id"] == "gpu-3"
    _, _, metrics = await http_get(running.port, "/metrics")
    assert b'duplexrt_replica_info{replica_id="gpu-3"} 1.0' in metrics
    async with trio_websocket.open_websocket_url(running.url("/v1/duplex")) as ws:
        assert dict(ws.handshake_headers)[b"x-duplexrt-replica"] == b"gpu-3"


async def test_the_default_replica_id_is_the_host_name_and_the_bound_port(start_server):
    running = await start_server()
    _, _, body = await http_get(running.port, "/readyz")
    assert json.loads(body)["replica_id"] == f"{socket.gethostname()}:{running.port}"


@pytest.mark.parametrize("bad", ['"two words"', '"a/b"', '"' + "x" * 129 + '"', "3"])
def test_a_replica_id_that_cannot_be_a_label_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="server.replica_id"):
        load_config(None, [f"server.replica_id={bad}"])


async def test_drain_answers_readyz_503_while_sessions_finish_and_refuses_new_ones(start_server):
    # A long close timeout and a client that never answers the server's Close: the session
    # stays admitted through the drain, which is what a balancer sees during a rolling update.
    running = await start_server("server.close_timeout_s=30", "server.shutdown_grace_s=30")
    server = running.server
    done = trio.Event()

    async def run_client() -> None:
        # An unbuffered queue and nothing read after session.created: the client's reader blocks
        # on the next message and never answers the Close.
        async with trio_websocket.open_websocket_url(running.url("/v1/duplex"), message_queue_size=0) as ws:
            await ws.get_message()
            await done.wait()

    async with trio.open_nursery() as clients:
        clients.start_soon(run_client)
        with trio.fail_after(PATIENCE):
            while json.loads((await http_get(running.port, "/readyz"))[2])["sessions"] != 1:
                await trio.sleep(0.01)
        server.shutdown()
        for _ in range(3):  # every check during the drain, not just the first
            with trio.fail_after(PATIENCE):
                status, _, body = await http_get(running.port, "/readyz")
            assert status == 503 and json.loads(body)["reason"] == "draining"
            await trio.sleep(0.05)
        with trio.fail_after(PATIENCE):
            status, _, body = await http_get(running.port, "/v1/duplex", headers=(
                "connection: upgrade\r\nupgrade: websocket\r\nsec-websocket-version: 13\r\n"
                "sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"))
        assert status == 503 and b"shutting down" in body
        assert server.refused["shutting_down"] == 1
        done.set()
        clients.cancel_scope.cancel()


async def test_serve_tags_every_log_line_with_the_replica_id(caplog):
    handler = logging.StreamHandler()  # serve() tags the root logger's handlers
    records: list[logging.LogRecord] = []
    handler.emit = records.append  # type: ignore[method-assign]
    hello = logging.getLogger("duplexrt.hello")  # the start-up line has a handler of its own
    logging.getLogger().addHandler(handler)
    hello.addHandler(handler)
    level = hello.level
    hello.setLevel(logging.INFO)  # serve() leaves a logger that has handlers as it finds it
    try:
        config = _config('server.replica_id="gpu-7"')
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve, config)
            with trio.fail_after(PATIENCE):
                while not any("duplexrt is up" in r.getMessage() for r in records):
                    await trio.sleep(0.01)
            logging.getLogger("duplexrt.server").warning("a line while serving")
            nursery.cancel_scope.cancel()
    finally:
        logging.getLogger().removeHandler(handler)
        hello.removeHandler(handler)
        hello.setLevel(level)
    line = next(r for r in records if "a line while serving" in r.getMessage())
    assert line.getMessage().startswith("[replica gpu-7] ") and line.replica_id == "gpu-7"
    assert not handler.filters  # removed again when serve returns


def test_the_serve_command_takes_the_replica_id_from_its_variable(tmp_path):
    """The real command: DUPLEXRT_REPLICA_ID names the replica in /readyz and in its log lines."""
    import os
    import signal
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "duplexrt_cli.app", "serve", "--port", str(port)],
                                env={**os.environ, "DUPLEXRT_REPLICA_ID": "node-a"}, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as answer:
                    ready = json.loads(answer.read())
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.1)  # a real process starting: no event to wait on
        assert ready["replica_id"] == "node-a"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    signalled = [line for line in log_path.read_text().splitlines() if "received SIGTERM" in line]
    assert len(signalled) == 1 and "[replica node-a] received SIGTERM" in signalled[0]
