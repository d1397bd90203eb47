"""``Runtime.statistics()`` and ``Server.statistics()``: the one record every figure is read from.

The endpoints (``/readyz``, ``/stats``, ``/metrics``) read the same record, so they cannot
disagree; a connection admitted but still in its WebSocket handshake (no model row yet) is where
they used to.  Real sockets on loopback and a real scheduler thread: no autojump clock.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import textwrap
import time

import attrs
import pytest
import trio

from duplexrt.runtime import RuntimeHistograms, RuntimeStatistics, open_runtime
from duplexrt.server import Server
from duplexrt.server.statistics import ServerStatistics

from conftest import FRAME, duplex_session, exported, make_config, noise, run_sessions, spec

PATIENCE = 10.0


def _documented_fields(cls: type) -> list[str]:
    """Fields of an attrs class whose line is not preceded by a ``#:`` comment."""
    lines = inspect.getsource(cls).splitlines()
    missing = []
    for field in attrs.fields(cls):
        index = next(i for i, line in enumerate(lines) if re.match(rf"\s+{field.name}:", line))
        if not lines[index - 1].strip().startswith("#:"):
            missing.append(field.name)
    return missing


@pytest.mark.parametrize("cls", [RuntimeStatistics, RuntimeHistograms, ServerStatistics])
def test_every_statistics_field_is_documented_and_the_record_frozen(cls):
    assert _documented_fields(cls) == []
    assert attrs.has(cls) and cls.__setattr__ is not object.__setattr__  # attrs.frozen


#: The runtime's and the server's own parts, which only ``statistics()`` should read.
_PARTS = {"metrics", "step_time_snapshot", "delivery_delay", "stage_time", "estimate",
          "_draining", "_admitted"}


def _runtime_parts_read(source: str) -> set[str]:
    tree = ast.parse(textwrap.dedent(source))
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr in _PARTS}


def test_the_exporter_the_log_line_stats_and_simulate_read_only_statistics():
    import duplexrt.server.metrics as metrics
    import duplexrt.server.stats_log as stats_log
    import duplexrt.server.web as web
    from duplexrt.simulate import in_process

    for module in (metrics, web, stats_log):
        assert _runtime_parts_read(inspect.getsource(module)) == set(), module.__name__
    assert _runtime_parts_read(inspect.getsource(in_process._run_round)) == set()
    assert _runtime_parts_read(inspect.getsource(Server._plain_answer)) == set()


async def test_runtime_statistics_count_a_session_s_frames_and_copy_histograms():
    config = make_config("runtime.slots=2")
    wire = spec("pcm_f32le")
    messages = [b"\0" * (4 * 1920)] * 3
    async with open_runtime(config) as runtime:
        before = runtime.statistics()
        await run_sessions(runtime, [(messages, wire, 1)])
        after = runtime.statistics()
    assert before.frames.frames_in == 0 and after.frames.frames_in == 3
    assert after.frames.frames_out == 3
    assert after.slots == 2 and after.free_rows == 2 and after.sessions_active == 0
    assert after.histograms.latency.count == 3 and before.histograms.latency.count == 0  # a copy
    assert after.histograms.latency.minus(before.histograms.latency).count == 3
    assert after.scheduler.frames - before.scheduler.frames == 3
    assert after.handoffs.offloads == 0 and after.ready and not after.failing


async def test_the_scheduler_thread_s_cpu_is_counted_and_kept_once_it_ends():
    """Read through the thread's CPU clock from the trio thread: part of the process's CPU while it
    runs, and what it had used once the runtime has stopped."""
    config = make_config("runtime.slots=2")
    wire = spec("pcm_f32le")
    async with open_runtime(config) as runtime:
        await run_sessions(runtime, [([b"\0" * (4 * 1920)] * 4, wire, 1)])
        running = runtime.statistics().scheduler.thread_cpu_seconds
        process = time.process_time()
    ended = runtime.scheduler.statistics().thread_cpu_seconds
    assert 0 < running <= process
    assert ended >= running and ended == runtime.scheduler.statistics().thread_cpu_seconds


async def test_free_slots_agree_while_a_session_waits_for_its_first_message(start_server):
    served = await start_server("runtime.slots=2")
    server, port = served.server, served.port
    # An upgrade answered, and then nothing sent: admitted, its session open, its row taken.
    quiet = await trio.open_tcp_stream("127.0.0.1", port)
    await quiet.send_all(b"GET /v1/duplex HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: upgrade\r\n"
                         b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n")
    with trio.fail_after(PATIENCE):
        while server.admitted != 1 or server.statistics().runtime.free_rows != 1:
            await trio.sleep(0.01)
    _, ready = await served.readyz()
    stats = json.loads((await served.get("/stats"))[2])
    assert ready["free_slots"] == stats["free_slots"] == await served.metric("duplexrt_slots_free") == 1
    await quiet.aclose()


async def test_stats_and_metrics_say_where_the_hot_path_ran(start_server):
    """Batches sent from the delivery and writer wake-ups: the same figures in ``/stats`` and
    ``/metrics``, and what the session did."""
    served = await start_server("runtime.slots=2")
    audio = noise(6 * FRAME, 3).astype("float32")
    received, events = await duplex_session(served.url(), audio, chunk=FRAME)
    assert len(received) == audio.nbytes and events[-1]["code"] == 1000
    hot = json.loads((await served.get("/stats"))[2])["hot_path"]
    metrics = await served.metrics()
    assert hot["direct_batches"] + hot["writer_wakeups"] >= 1
    # The scheduler thread's CPU, read later for /metrics: it only grows.
    assert 0 < hot["scheduler_thread_cpu_s"] <= exported(metrics, "duplexrt_scheduler_thread_cpu_seconds_total")
    for key, name in [("direct_batches", "duplexrt_output_batches_direct_total"),
                      ("writer_wakeups", "duplexrt_writer_wakeups_total")]:
        assert exported(metrics, name) == hot[key], name
