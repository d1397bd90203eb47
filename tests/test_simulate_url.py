"""`duplexrt simulate --url`: the in-process load, guards and report, over real WebSockets to a
server listening on a loopback port, with server-side figures from its /metrics.

The server runs in this process (so its CPU counter includes the load generator's: the figures are
checked for presence and consistency here, not for size)."""

from __future__ import annotations

import re

import socket

import pytest
import trio

from duplexrt.client.connection import ConnectError
from duplexrt.config import ConfigError, load_config
from duplexrt.server import Server
from duplexrt.simulate.report import format_table
from duplexrt.simulate.runner import SimulateOptions, run_url_simulation

PATIENCE = 30.0
ROUTES = {"/v1/duplex": "pcm_f32le", "/v1/realtime": "pcm_s16le", "/api/chat": "opus",
          "/v1/live/sessions": "pcm_s16le", "/twilio/media": "g711_ulaw"}


async def _serve(nursery: trio.Nursery, *overrides: str, echo_delay: int | None = 0) -> str:
    delay = [] if echo_delay is None else [f"backend.options.delay_frames={echo_delay}"]
    config = load_config(None, ["server.port=0", "runtime.slots=4", *delay, *overrides])
    server = Server(config)
    await nursery.start(server.run)
    return f"ws://127.0.0.1:{server.ports[0]}"


def _described(*overrides: str):
    """The server's backend as the guards are told it: echo, delay 0, unless said otherwise."""
    return load_config(None, ["backend.options.delay_frames=0", *overrides])


async def _simulate(url: str, config=None, **options):
    options = {"concurrency": 4, "frames": 10, **options}
    with trio.fail_after(PATIENCE):
        return await run_url_simulation(config or _described(), SimulateOptions(**options), url)


@pytest.mark.parametrize("mode", ["burst", "paced"])
@pytest.mark.parametrize("route", list(ROUTES))
async def test_every_route_passes_the_guards_with_server_figures(nursery, route, mode):
    base = await _serve(nursery, 'server.replica_id="gpu-7"')
    report = await _simulate(base + route, format=ROUTES[route], mode=mode,
                             message_ms=80 if mode == "paced" else 160)
    (round_,) = report.rounds
    server = round_.measured
    assert round_.failures == [] and report.ok
    assert server.sessions_connected == 4 and server.connection_errors == {}
    # Client side: every frame sent and heard.  Server side, from /metrics: the same frames.
    assert round_.frames_in == round_.frames_out == 40
    assert server.server_frames_in == server.server_frames_out == 40
    # Both CPU figures come from clock ticks (10 ms here): a 40-frame burst may fit in none.
    assert server.server_cpu_us_per_frame >= 0 and server.load_generator_cpu_us_per_frame >= 0
    # The scheduler thread's part of it (its clock is exact, the process's in ticks): there once a
    # tick was counted, and never negative.
    share = server.server_scheduler_cpu_share
    assert (share is None) == (server.server_cpu_us_per_frame == 0) and (share is None or share >= 0)
    assert round_.steps > 0 and 1 <= round_.mean_batch <= 4
    assert round_.mean_batch == pytest.approx(40 / round_.steps)
    assert server.server_step_ms_mean is not None
    if route == "/api/chat":
        assert round_.handoffs["decode_offload"] > 0  # Opus is decoded on a worker thread
    if mode == "paced":
        assert round_.frame_lag_ms is not None and round_.frame_lag_ms.count == 40
        assert round_.late_frames is not None and round_.real_time_factor is not None
    else:
        assert round_.frame_lag_ms is None
    table = format_table(report)
    assert "server CPU per frame (µs)" in table and "load-generator CPU per frame (µs)" in table
    assert "server CPU on the scheduler thread (%)" in table
    # Which replica's /metrics the server figures are (behind a balancer: one replica's).
    assert server.server_replica == "gpu-7"
    assert re.search(r"^server figures from replica +gpu-7$", table, re.M), table
    assert report.settings["route"] == {"/v1/duplex": "duplex", "/v1/realtime": "realtime",
                                        "/api/chat": "moshi", "/v1/live/sessions": "live",
                                        "/twilio/media": "twilio"}[route]


async def test_duplex_route_in_s16_at_16k_and_odd_message_sizes(nursery):
    base = await _serve(nursery)
    report = await _simulate(base + "/v1/duplex", format="pcm_s16le", sample_rate=16000, message_ms=37)
    assert report.ok, report.rounds[0].failures
    assert "format=pcm_s16le" in report.settings["url"] and "rate=16000" in report.settings["url"]


async def test_realtime_is_simulated_in_duplex_mode(nursery):
    base = await _serve(nursery)
    report = await _simulate(base + "/v1/realtime", format="pcm_s16le", concurrency=2, frames=6)
    assert report.ok and report.settings["url"].endswith("?duplex=1&continuous=1")
    assert any("duplex mode" in note for note in report.settings["notes"])


async def test_the_guards_check_content_over_the_network(nursery):
    """Told the server echoes 2 frames late when it echoes at once, every session fails."""
    base = await _serve(nursery)
    report = await _simulate(base + "/v1/duplex", config=_described("backend.options.delay_frames=2"),
                             concurrency=2, frames=6)
    failures = report.rounds[0].failures
    assert not report.ok and len(failures) == 2
    assert all("differ from the expected content" in f for f in failures)


async def test_synthetic_output_is_checked_though_the_servers_session_ids_are_its_own(nursery):
    base = await _serve(nursery, 'backend.name="synthetic"', echo_delay=None)
    for route in ("/v1/duplex", "/api/chat", "/twilio/media"):
        with trio.fail_after(PATIENCE):
            # Nothing said about the backend: the one the server's /readyz names is checked.
            report = await run_url_simulation(load_config(None, []), SimulateOptions(concurrency=3, frames=6,
                                                                             format=ROUTES[route]),
                                              base + route, adopt_server_backend=True)
        assert report.ok, report.rounds[0].failures
        assert report.settings["config"]["backend"]["name"] == "synthetic"


async def test_fewer_slots_than_sessions_are_counted_connection_errors_and_fail(nursery):
    base = await _serve(nursery, "runtime.slots=2")
    report = await _simulate(base + "/v1/duplex")
    (round_,) = report.rounds
    assert not report.ok
    assert round_.measured.connection_errors == {"http_503": 2}
    assert round_.measured.sessions_connected == 2
    assert round_.failures[0] == "connection errors: 2 http_503"
    assert sum("HTTP 503" in f and "session slots are in use" in f for f in round_.failures) == 2
    # The two sessions that got in were served and checked as usual.
    assert round_.frames_in == round_.frames_out == round_.measured.server_frames_in == 20
    assert "http_503: 2" in format_table(report)


async def test_a_server_that_is_not_there_is_a_clear_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConnectError) as failed:
        await _simulate(f"ws://127.0.0.1:{port}/v1/duplex")
    assert failed.value.kind == "refused" and "connection refused" in failed.value.message


async def test_options_that_do_not_fit_the_route_are_refused():
    for url, fmt in (("ws://127.0.0.1:9/api/chat", "pcm_f32le"), ("ws://127.0.0.1:9/v1/duplex", "opus"),
                     ("ws://127.0.0.1:9/v1/realtime", "g711_ulaw"), ("ws://127.0.0.1:9/nowhere", "opus")):
        with pytest.raises(ConfigError):
            await _simulate(url, format=fmt)


@pytest.mark.parametrize("route", [route for route in ROUTES if route != "/twilio/media"])  # it has no resume
async def test_drop_rate_cuts_connections_and_every_session_resumes_with_no_frame_lost_or_twice(nursery, route):
    base = await _serve(nursery, "runtime.slots=8")
    report = await _simulate(base + route, format=ROUTES[route], concurrency=8, frames=30, message_ms=80,
                             drop_rate=1.0)
    (round_,) = report.rounds
    assert round_.failures == [] and report.ok  # the guards: every frame heard once, in order
    assert (round_.measured.drops, round_.measured.resumes) == (8, 8)
    assert round_.frames_in == round_.frames_out == 8 * 30
    assert "connections cut / sessions resumed" in format_table(report)


def test_server_figures_from_two_replicas_are_not_subtracted():
    """Behind a balancer the scrapes before and after a round may reach two replicas: their
    counters have nothing to do with each other, so no server figure is shown, and a note says why."""
    from duplexrt.client.metrics import MetricsSnapshot
    from duplexrt.simulate.network import _server_figures

    def scrape(replica: str, frames: int) -> MetricsSnapshot:
        return MetricsSnapshot.parse(f'duplexrt_replica_info{{replica_id="{replica}"}} 1.0\n'
                                     f"duplexrt_frames_in_total {frames}\nduplexrt_steps_total {frames}\n")

    same = _server_figures(scrape("r1", 10), scrape("r1", 50))
    assert (same["replica"], same["frames_in"], same["note"]) == ("r1", 40, None)
    mixed = _server_figures(scrape("r1", 10), scrape("r2", 50))
    assert mixed["frames_in"] is None and mixed["replica"] is None
    assert "different replicas (r1 then r2)" in mixed["note"]


async def test_a_burst_against_a_model_stepping_in_real_time_answers_every_ping_and_drops_nothing(nursery):
    """``simulate --url`` in burst mode shares ``duplexrt client``'s connection code: its session
    runs seconds ahead of a real-time model, its sends waiting on a full socket, while the server
    pings every half second.  A reader that waited for the write turn to answer a ping stopped
    reading, and the server dropped the call at its ping timeout (issue 38, item 5; the pong
    waits at most the audio sent before it, under the timeout here)."""
    base = await _serve(nursery, 'backend.name="synthetic"', "backend.options.step_ms=80",
                        "server.ping_interval_s=0.5", "server.ping_timeout_s=5", echo_delay=None)
    with trio.fail_after(PATIENCE):
        report = await run_url_simulation(load_config(None, []),
                                          SimulateOptions(concurrency=1, frames=50, mode="burst", message_ms=80),
                                          base + "/v1/duplex", adopt_server_backend=True)
    (round_,) = report.rounds
    assert round_.failures == [] and report.ok
    assert round_.frames_in == round_.frames_out == 50
    assert round_.measured.resumes == 0  # no connection dropped (each drop is resumed)


async def test_drop_rate_is_refused_on_the_twilio_route_which_has_no_resume(nursery):
    base = await _serve(nursery)
    with pytest.raises(ConfigError, match="no resume"):
        await _simulate(base + "/twilio/media", format="g711_ulaw", drop_rate=0.5)
