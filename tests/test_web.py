"""The web side of the server without a browser: pages, static files, /stats, and the API key
offered as a WebSocket subprotocol."""

from __future__ import annotations

import json

import numpy as np
import pytest
import trio_websocket

from conftest import http_get


@pytest.mark.parametrize("path, content_type, marker", [
    ("/", "text/html; charset=utf-8", b"Start talking"),
    ("/dashboard", "text/html; charset=utf-8", b"/static/dashboard.js"),
    ("/static/talk.js", "text/javascript; charset=utf-8", b"openai-insecure-api-key."),
    ("/static/worklet.js", "text/javascript; charset=utf-8", b"registerProcessor"),
    ("/static/charts.js", "text/javascript; charset=utf-8", b"drawChart"),
    ("/static/dashboard.js", "text/javascript; charset=utf-8", b"/stats"),
    ("/static/style.css", "text/css; charset=utf-8", b"body"),
    # The pages' icon, and where browsers look without a link: no 404 in the console.
    ("/static/favicon.svg", "image/svg+xml", b"<svg"),
    ("/favicon.ico", "image/svg+xml", b"<svg"),
])
async def test_pages_and_static_files_are_served_with_their_types_and_no_key(path, content_type, marker, start_server):
    server = (await start_server("runtime.slots=2", 'server.api_key="s3cret"')).server
    status, headers, body = await http_get(server.ports[0], path)
    assert status == 200 and headers["content-type"] == content_type
    assert marker in body


@pytest.mark.parametrize("path", [
    "/static/../app.py", "/static/..%2fapp.py", "/static/%2e%2e/web.py", "/static/", "/static/static/style.css",
    "/static//etc/passwd", "/static/../../../../etc/passwd", "/static/__init__.py", "/index.html", "/static",
])
async def test_no_path_leaves_the_static_files(path, start_server):
    server = (await start_server("runtime.slots=2")).server
    status, _, body = await http_get(server.ports[0], path)
    assert status == 404
    assert b"import" not in body and b"root:" not in body


async def test_the_plain_route_list_is_still_there(start_server):
    server = (await start_server("runtime.slots=2")).server
    status, _, body = await http_get(server.ports[0], "/routes")
    assert status == 200 and b"/v1/duplex" in body and b"/dashboard" in body


async def test_stats_reads_the_runtime_counters(start_server):
    server = (await start_server("runtime.slots=2")).server
    status, headers, body = await http_get(server.ports[0], "/stats")
    before = json.loads(body)
    assert status == 200 and headers["content-type"] == "application/json"
    assert before["backend"] == "echo" and before["slots"] == 2 and before["free_slots"] == 2
    assert before["capacity"] == 2  # what admission lets in: the echo model fits every slot
    assert before["sessions_opened"] == 0 and before["api_key_required"] is False
    frame = server.config.audio.frame_size
    url = f"ws://127.0.0.1:{server.ports[0]}/v1/duplex"
    async with trio_websocket.open_websocket_url(url) as ws:
        await ws.get_message()  # session.created
        await ws.send_message(np.zeros(3 * frame, dtype=np.float32).tobytes())
        received = 0
        while received < 3 * frame * 4:
            received += len(await ws.get_message())
        _, _, body = await http_get(server.ports[0], "/stats")
        during = json.loads(body)
        assert during["sessions_active"] == 1 and during["admitted"] == 1 and during["free_slots"] == 1
    assert during["steps"] >= 3 and during["frames"] >= 3 and during["frames_out"] >= 3
    histogram = during["lag_histogram"]
    assert histogram["count"] >= 3 and histogram["cumulative"][-1] == histogram["count"]
    assert len(histogram["cumulative"]) == len(histogram["edges_ms"])
    assert during["handoffs"] and during["step"]["count"] >= 3
    step = during["step"]  # the step time's spread: what host work on the trio thread delays
    assert 0 <= step["p50_ms"] <= step["p99_ms"] <= step["max_ms"] + 1e-9
    assert set(during["send_jitter_ms"]) == {"p50", "p99", "max"}


async def test_stats_says_a_key_is_needed_without_needing_one(start_server):
    server = (await start_server("runtime.slots=2", 'server.api_key="s3cret"')).server
    status, _, body = await http_get(server.ports[0], "/stats")
    assert status == 200 and json.loads(body)["api_key_required"] is True
    assert b"s3cret" not in body


async def test_a_browser_sends_the_key_as_a_subprotocol_and_gets_the_other_one_back(start_server):
    server = (await start_server("runtime.slots=2", 'server.api_key="s3cret"')).server
    url = f"ws://127.0.0.1:{server.ports[0]}/v1/duplex"
    async with trio_websocket.open_websocket_url(
            url, subprotocols=["duplexrt", "openai-insecure-api-key.s3cret"]) as ws:
        assert ws.subprotocol == "duplexrt"  # never the one carrying the key
        assert json.loads(await ws.get_message())["type"] == "session.created"
    with pytest.raises(trio_websocket.ConnectionRejected) as refused:
        async with trio_websocket.open_websocket_url(url, subprotocols=["duplexrt", "openai-insecure-api-key.nope"]):
            pass
    assert refused.value.status_code == 401
    assert server.refused["unauthorized"] == 1


async def test_clients_offering_no_key_subprotocol_are_answered_as_before(start_server):
    server = (await start_server("runtime.slots=2")).server
    url = f"ws://127.0.0.1:{server.ports[0]}/v1/duplex"
    async with trio_websocket.open_websocket_url(url) as ws:
        assert ws.subprotocol is None
        await ws.get_message()


def test_serve_greets_at_the_default_log_level_with_the_talk_page_url():
    """The real command: once it listens it says so in a plain line (no log level, no logger
    name; the info lines before it are the start-up's own), naming the page to open, the routes
    and the backend, and that page is there."""
    import os
    import signal
    import subprocess
    import sys
    import urllib.request

    proc = subprocess.Popen([sys.executable, "-m", "duplexrt_cli.app", "serve", "--port", "0"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        before = []
        line = proc.stderr.readline()
        while line and not line.startswith("duplexrt is up"):
            before.append(line)
            line = proc.stderr.readline()
        assert all(" INFO " in earlier for earlier in before), before
        assert line.startswith("duplexrt is up: open http://127.0.0.1:"), (before, line)
        port = int(line.split("port(s) ")[1].split()[0])
        assert f"http://127.0.0.1:{port}/ " in line and "/dashboard" in line
        assert "/v1/duplex" in line and "backend echo" in line and "WARNING" not in line
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as page:
            assert page.headers["content-type"].startswith("text/html") and b"Start talking" in page.read()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        proc.stderr.close()
