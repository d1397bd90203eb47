"""Three real `duplexrt serve` replicas behind a real HAProxy running deploy/haproxy/haproxy.cfg
unchanged, all on loopback: what each replica tells the balancer (/readyz) decides where
sessions go, and a SIGTERM drains one replica without cutting anything new.

CI installs HAProxy (.ci/run); elsewhere this one module is skipped, with the reason.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import trio
import trio_websocket

from test_resume import FRAME, DuplexPeer, frames

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
#: Slots per replica: replica 1 is smaller, so it fills first while the others still have room.
#: The names are the config's server names: resume tokens name their replica, which routes a resume.
SLOTS = {"replica1": 16, "replica2": 32, "replica3": 32}
START_TIMEOUT_S = 60.0
PATIENCE_S = 10.0
#: The config's check interval (`inter 500ms`) and one check's own time, on a loaded CI machine.
CHECK_INTERVAL_S = 0.5
CHECK_SLACK_S = 1.0

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None,
                                reason="HAProxy is not installed (CI installs it: .ci/run)")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _get(port: int, path: str) -> tuple[int, bytes]:
    """One plain HTTP GET (blocking, short): the status and body, 503 included."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ports = {name: _free_port() for name in SLOTS}
        self.lb_port = _free_port()
        self.stats_port = _free_port()
        self.replicas: dict[str, subprocess.Popen] = {}
        self.haproxy: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "NO_TORCH_COMPILE": "1"}
        for name, slots in SLOTS.items():
            with (self.tmp / f"{name}.log").open("w") as log:
                self.replicas[name] = subprocess.Popen(
                    [sys.executable, "-m", "duplexrt_cli.app", "serve", "--port", str(self.ports[name]),
                     "--replica-id", name, "--slots", str(slots), "--log-level", "info",
                     "--set", "server.first_message_timeout_s=120", "--set", "server.shutdown_grace_s=60"],
                    env=env, stdout=log, stderr=subprocess.STDOUT)
        lb_env = {**os.environ, "DUPLEXRT_LB_BIND": f"127.0.0.1:{self.lb_port}",
                  "DUPLEXRT_LB_STATS": f"127.0.0.1:{self.stats_port}",
                  **{f"DUPLEXRT_REPLICA_{i}": f"127.0.0.1:{self.ports[name]}" for i, name in enumerate(SLOTS, 1)}}
        with (self.tmp / "haproxy.log").open("w") as log:
            self.haproxy = subprocess.Popen(["haproxy", "-db", "-f", str(CONFIG)], env=lb_env, stdout=log,
                                            stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for name, proc in self.replicas.items():
                assert proc.poll() is None, f"{name} exited:\n{self.log(name)}"
            assert self.haproxy.poll() is None, f"haproxy exited:\n{self.log('haproxy')}"
            try:
                if all(status == "UP" for status in self.balancer_status().values()):
                    return
            except (OSError, urllib.error.URLError):  # HAProxy not listening yet
                pass
            time.sleep(0.2)  # real processes starting: no event to wait on
        raise AssertionError(f"not all replicas UP: {self.balancer_status()}\n{self.log('haproxy')}")

    def stop(self) -> None:
        for proc in [*self.replicas.values(), self.haproxy]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()[-3000:]

    def balancer_status(self) -> dict[str, str]:
        """HAProxy's own view: UP, DOWN... per replica, from its stats CSV."""
        status, body = _get(self.stats_port, "/stats;csv")
        assert status == 200
        rows = csv.DictReader(io.StringIO(body.decode().lstrip("# ")))
        return {row["svname"]: row["status"] for row in rows if row["pxname"] == "replicas"
                and row["svname"].startswith("replica")}

    def ready(self, name: str) -> tuple[int, dict]:
        status, body = _get(self.ports[name], "/readyz")
        return status, json.loads(body)

    def refused(self, name: str, reason: str) -> float:
        _, body = _get(self.ports[name], "/metrics")
        for line in body.decode().splitlines():
            if line.startswith(f'duplexrt_connections_refused_total{{reason="{reason}"}}'):
                return float(line.split()[-1])
        return 0.0


@pytest.fixture
def cluster(tmp_path):
    running = Cluster(tmp_path)
    try:
        running.start()
        yield running
    finally:
        running.stop()


async def _open(nursery: trio.Nursery, port: int) -> tuple[trio_websocket.WebSocketConnection, str]:
    """A session through the balancer: its connection and the replica that took it."""
    with trio.fail_after(PATIENCE_S):
        ws = await trio_websocket.connect_websocket_url(nursery, f"ws://127.0.0.1:{port}/v1/duplex")
        created = json.loads(await ws.get_message())
    assert created["type"] == "session.created", created
    headers = dict(ws.handshake_headers)
    return ws, headers[b"x-duplexrt-replica"].decode()


async def _end_of(ws: trio_websocket.WebSocketConnection) -> dict:
    """Read to the session's end: its session.end event."""
    with trio.fail_after(PATIENCE_S):
        while True:
            message = await ws.get_message()
            if isinstance(message, str) and (event := json.loads(message))["type"] == "session.end":
                return event


def _count(sessions) -> dict[str, int]:
    counts = {name: 0 for name in SLOTS}
    for _, replica in sessions:
        counts[replica] += 1
    return counts


async def test_replicas_behind_haproxy_spread_fill_and_drain(cluster):
    async with trio.open_nursery() as nursery:
        # Least connections, one session at a time: an even spread (3 x 16), which fills r1.
        sessions = [await _open(nursery, cluster.lb_port) for _ in range(48)]
        counts = _count(sessions)
        assert all(abs(n - 16) <= 1 for n in counts.values()), counts
        for name in SLOTS:
            assert cluster.ready(name)[1]["sessions"] == counts[name]
        status, body = cluster.ready("replica1")
        assert (status, body["reason"], body["replica_id"]) == (503, "no_free_slot", "replica1")

        # A full replica gets nothing new: once its check has failed, HAProxy sends it no
        # upgrade at all (its refusal count stays put), and every client still gets a session.
        with trio.fail_after(CHECK_INTERVAL_S + CHECK_SLACK_S):
            while cluster.balancer_status()["replica1"] != "DOWN":
                await trio.sleep(0.05)
        refused_before = cluster.refused("replica1", "no_free_slot")
        sessions += [await _open(nursery, cluster.lb_port) for _ in range(8)]
        counts = _count(sessions)
        assert counts["replica1"] == 16 and abs(counts["replica2"] - counts["replica3"]) <= 1, counts
        assert cluster.refused("replica1", "no_free_slot") == refused_before

        # SIGTERM drains r2: /readyz is 503 "draining" at once, HAProxy takes it out within a
        # check interval and new sessions go elsewhere, while r2's calls go on through the
        # balancer, every frame answered, until they end; then r2 exits.
        on_r2 = [ws for ws, replica in sessions if replica == "replica2"]
        sent = time.monotonic()
        cluster.replicas["replica2"].send_signal(signal.SIGTERM)
        while True:
            status, body = cluster.ready("replica2")
            if status == 503:
                break
        answered = time.monotonic() - sent
        assert body["reason"] == "draining" and answered < 0.1, (body, answered)
        with trio.fail_after(CHECK_INTERVAL_S + CHECK_SLACK_S):
            while cluster.balancer_status()["replica2"] == "UP":
                await trio.sleep(0.02)
        later = [await _open(nursery, cluster.lb_port) for _ in range(4)]
        assert {replica for _, replica in later} == {"replica3"}
        audio = frames(4, seed=3)
        for ws in on_r2:
            with trio.fail_after(PATIENCE_S):
                for message in audio:
                    await ws.send_message(message)
                heard = b""
                while len(heard) < 4 * FRAME * 4:
                    message = await ws.get_message()
                    assert isinstance(message, bytes), message
                    heard += message
            # Echo, two frames late: the call is still the same conversation.
            assert heard == bytes(2 * FRAME * 4) + b"".join(audio[:2])
        assert cluster.replicas["replica2"].poll() is None, "draining, not gone"
        for ws in on_r2:
            await ws.send_message(json.dumps({"type": "input.end"}))
            assert (await _end_of(ws))["reason"] == "stop"
        assert await trio.to_thread.run_sync(cluster.replicas["replica2"].wait, PATIENCE_S) == 0
        assert "drained: every call ended" in cluster.log("replica2")

        for ws, _ in sessions + later:
            await ws.aclose()

    # A whole load run through the balancer passes its guards (every frame, in order, echoed).
    simulate = await trio.run_process(
        [sys.executable, "-m", "duplexrt_cli.app", "simulate", "--url", f"ws://127.0.0.1:{cluster.lb_port}/v1/duplex",
         "--concurrency", "12", "--frames", "10", "--no-progress"],
        capture_stdout=True, capture_stderr=True, check=False)
    assert simulate.returncode == 0, simulate.stderr.decode()[-3000:]


async def _cut_at_the_proxy(peer: DuplexPeer, lb_port: int) -> None:
    """Kill HAProxy's socket for ``peer``'s connection; wait until the client sees it gone."""
    client_port = peer.stream.socket.getsockname()[1]
    if shutil.which("ss") and os.geteuid() == 0:
        await trio.run_process(["ss", "-K", "src", "127.0.0.1", "sport", "=", f":{lb_port}",
                                "dst", "127.0.0.1", "dport", "=", f":{client_port}"], capture_stdout=True)
    else:
        peer.cut()
    with trio.fail_after(PATIENCE_S):
        try:
            while True:
                await peer.next()  # what arrived before the cut is the session's: counted
        except trio_websocket.ConnectionClosed:
            pass


async def test_a_session_cut_mid_call_resumes_through_haproxy_on_its_replica_with_every_frame_once(cluster):
    # HAProxy's own socket for this client is killed (`ss -K`, as root: CI; elsewhere the client's
    # socket is closed instead).  No Close frame goes either way: HAProxy drops its socket to the
    # replica, which sees the connection lost mid-session (not a hang-up) and keeps the session.
    audio = frames(60, seed=7)
    peer = DuplexPeer(cluster.lb_port)
    async with trio.open_nursery() as connections:
        with trio.fail_after(PATIENCE_S):
            await peer.start(connections)
        replica = dict(peer.ws.handshake_headers)[b"x-duplexrt-replica"].decode()
        assert peer.token.startswith(f"{replica}.")
        # More sessions, so that least-connections alone would send the resume elsewhere.
        others = [await _open(connections, cluster.lb_port) for _ in range(4)]
        with trio.fail_after(PATIENCE_S):
            for message in audio[:30]:
                await peer.send(message)
            while len(peer.heard) < 10 * FRAME * 4:
                await peer.next_audio()
        await _cut_at_the_proxy(peer, cluster.lb_port)
        with trio.fail_after(PATIENCE_S):
            notice = await peer.resume(connections)
        assert dict(peer.ws.handshake_headers)[b"x-duplexrt-replica"].decode() == replica
        assert notice["received"] <= 30
        with trio.fail_after(PATIENCE_S):
            for message in audio[30:]:
                await peer.send(message)
            await peer.send(json.dumps({"type": "input.end"}))
            end = await peer.until_end()
            await peer.ws.aclose()
        for ws, _ in others:
            await ws.aclose()
        connections.cancel_scope.cancel()
    assert end["reason"] == "stop" and end["usage"]["frames_out"] == 60
    # The replicas run echo's default delay of two frames: two frames of silence first.
    assert bytes(peer.heard) == bytes(2 * FRAME * 4) + b"".join(audio[:-2])
    _, metrics = _get(cluster.ports[replica], "/metrics")
    assert b"duplexrt_sessions_resumed_total 1.0" in metrics


def _post(port: int, path: str, headers: dict[str, str] | None = None) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_no_client_can_drain_a_replica_through_haproxy(cluster):
    """Issue 38, item 1: POST /drain from the public side is answered 403 by HAProxy itself,
    however it is spelt, and no replica drains; the replica's own host still can."""
    for path in ("/drain", "/DRAIN", "/%64rain", "/drain?resume=replica1.x", "/drain/"):
        assert _post(cluster.lb_port, path) == 403, path
    assert all(cluster.ready(name)[0] == 200 for name in SLOTS)
    assert all(status == "UP" for status in cluster.balancer_status().values())
    assert _post(cluster.ports["replica3"], "/drain") == 202  # on the host: loopback, directly
    assert cluster.replicas["replica3"].wait(timeout=PATIENCE_S) == 0  # no call to wait for: it stops
    assert all(cluster.ready(name)[0] == 200 for name in ("replica1", "replica2"))
