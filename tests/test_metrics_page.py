"""``/metrics`` may not hold the trio thread (issue 32, defect 8): a scraper in a loop gets the last
page again once renders have taken their share of the thread; one that comes now and then gets
a fresh page; no page is ever older than a second."""

from __future__ import annotations

import importlib.util
import logging
from urllib.parse import urlencode

import numpy as np
import pytest
import trio
import trio_websocket
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from conftest import INPUT_END, PATIENCE, Served, backend_info, duplex_session, exported, serve_personaplex_tiny
from duplexrt.backends.echo import EchoBackend
from duplexrt.config import load_config
from duplexrt.server import Server
from duplexrt.server.metrics import MetricsPage


class CountingCollector:
    """A real collector that counts how often it is collected and exports that count."""

    def __init__(self, gauges: int = 100) -> None:
        self.collected = 0
        self._gauges = gauges  # 100: a page about as large as a server's

    def collect(self):
        self.collected += 1
        yield CounterMetricFamily("test_collections", "Times this collector was collected.", self.collected)
        for n in range(self._gauges):
            yield GaugeMetricFamily(f"test_gauge_{n}", "A gauge.", n)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_scrape_loop_gets_the_last_page_and_no_page_is_older_than_max_age():
    registry = CollectorRegistry(auto_describe=False)
    counting = CountingCollector()
    registry.register(counting)
    clock = FakeClock()
    # No credit refills (share 0): only the page's age lets a render through after the burst.
    page = MetricsPage(registry, max_age_s=1.0, share=0.0, burst_s=0.01, clock=clock)
    pages = [page.text() for _ in range(1000)]  # all at one instant
    assert 1 <= page.renders == counting.collected < 1000
    assert pages[-1] == pages[page.renders]  # the last page again
    assert b"test_collections_total %d.0" % page.renders in pages[-1]
    clock.now += 0.99
    assert page.text() == pages[-1]
    clock.now += 0.01  # a page a second old is rendered again, credit or not
    renders = page.renders
    assert b"test_collections_total %d.0" % (renders + 1) in page.text()
    assert page.renders == counting.collected == renders + 1


def test_an_occasional_scrape_is_always_fresh():
    """Scrapes half a second apart (``simulate --url`` before and after a short round) each get
    a fresh page: a small page's render costs far less than the credit half a second refills,
    however loaded the machine."""
    registry = CollectorRegistry(auto_describe=False)
    counting = CountingCollector(gauges=0)
    registry.register(counting)
    clock = FakeClock()
    page = MetricsPage(registry, clock=clock)
    for n in range(1, 20):
        clock.now += 0.5  # every half second: well within 1 % of the thread
        assert b"test_collections_total %d.0" % n in page.text()
    assert page.renders == 19


async def test_parallel_scrapers_do_not_get_a_render_each(nursery):
    server = Server(load_config(None, ["server.port=0"]))
    await nursery.start(server.run)
    counting = CountingCollector()
    server.registry.register(counting)
    port = server.ports[0]
    scrapes = 0

    async def scrape_loop(times: int) -> None:
        nonlocal scrapes
        for _ in range(times):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                data = b""
                while chunk := await stream.receive_some(65536):
                    data += chunk
            assert data.startswith(b"HTTP/1.1 200") and b"test_collections_total" in data
            scrapes += 1

    with trio.fail_after(PATIENCE * 3):
        async with trio.open_nursery() as scrapers:
            for _ in range(4):
                scrapers.start_soon(scrape_loop, 75)
    assert scrapes == 300
    assert counting.collected <= scrapes // 3, f"{counting.collected} renders for {scrapes} scrapes"


# -- the prompt cache of a model that takes a persona ------------------------------------------------

PROMPT_CACHE = {"hits": 5, "misses": 2, "entries": 2, "bytes": 273744, "max_bytes": 67108864, "evictions": 1,
                "prefills": 3}


class PersonaInfoEcho(EchoBackend):
    """FAKE: a test double, the real echo model saying through ``persona_info`` that it takes a
    persona, with a prompt cache of fixed figures (``PROMPT_CACHE``), which ``/metrics`` must export
    as they are.  It takes no persona for real: only what the page shows of one is tested here."""

    def __init__(self, config) -> None:
        super().__init__(backend_info(config, "echo"), config.backend.options)
        self.cache = dict(PROMPT_CACHE)

    def persona_info(self):
        return {"voices": ["NATF0", "NATM1"], "default_voice": "NATF0", "default_instructions": "Be kind.",
                "max_prompt_tokens": 384, "prefill": "batch", "prompt_cache": dict(self.cache)}


def _prompt_families(page: str) -> dict[str, str]:
    """The ``# TYPE`` of each ``duplexrt_prompt...`` family on a page."""
    return {parts[2]: parts[3] for line in page.splitlines()
            if (parts := line.split(" ")) and line.startswith("# TYPE duplexrt_prompt")}


async def test_the_prompt_cache_is_exported_only_for_a_model_that_takes_a_persona(start_server):
    served = await start_server(backend=PersonaInfoEcho)
    page = await served.metrics()
    assert _prompt_families(page) == {
        "duplexrt_prompt_cache_hits_total": "counter", "duplexrt_prompt_cache_misses_total": "counter",
        "duplexrt_prompt_cache_evictions_total": "counter", "duplexrt_prompt_prefills_total": "counter",
        "duplexrt_prompt_cache_entries": "gauge", "duplexrt_prompt_cache_bytes": "gauge",
        "duplexrt_prompt_cache_max_bytes": "gauge"}
    assert exported(page, "duplexrt_prompt_cache_hits_total") == 5
    assert exported(page, "duplexrt_prompt_cache_misses_total") == 2
    assert exported(page, "duplexrt_prompt_cache_evictions_total") == 1
    assert exported(page, "duplexrt_prompt_prefills_total") == 3
    assert exported(page, "duplexrt_prompt_cache_entries") == 2
    assert exported(page, "duplexrt_prompt_cache_bytes") == 273744
    assert exported(page, "duplexrt_prompt_cache_max_bytes") == 64 * 2**20

    plain = await start_server()  # the echo model: no persona, no prompt families
    page = await plain.metrics()
    assert "duplexrt_prompt" not in page and "duplexrt_sessions_opened_total" in page


@pytest.mark.skipif(importlib.util.find_spec("moshi") is None or importlib.util.find_spec("torch") is None,
                    reason="the personaplex-tiny preset needs torch and moshi")
async def test_the_prompt_cache_of_personaplex_tiny_counts_a_new_persona_and_its_reuse(nursery):
    """The real ``personaplex-tiny`` preset: the default persona is prefilled at load; a caller
    with a persona of its own is a miss and a prefill; the next with the same one, a hit."""
    served = await serve_personaplex_tiny(nursery)
    page = await served.metrics()
    assert exported(page, "duplexrt_prompt_prefills_total") == 1  # the default persona, at load
    assert exported(page, "duplexrt_prompt_cache_entries") == 1
    assert exported(page, "duplexrt_prompt_cache_max_bytes") == 64 * 2**20
    default_bytes = exported(page, "duplexrt_prompt_cache_bytes")
    assert default_bytes > 0

    query = urlencode({"instructions": "You are a patient librarian.", "voice": "NATM1"})
    audio = np.zeros(2 * served.server.config.audio.frame_size, dtype=np.float32)
    for _ in range(2):
        _, events = await duplex_session(served.url(f"/v1/duplex?{query}"), audio)
        assert events[0]["type"] == "session.created" and events[0]["persona"]["voice"] == "NATM1", events
    page = await served.metrics()
    assert exported(page, "duplexrt_prompt_cache_misses_total") == 1
    assert exported(page, "duplexrt_prompt_cache_hits_total") == 1
    assert exported(page, "duplexrt_prompt_prefills_total") == 2
    assert exported(page, "duplexrt_prompt_cache_entries") == 2
    assert exported(page, "duplexrt_prompt_cache_bytes") > default_bytes
    assert exported(page, "duplexrt_prompt_cache_evictions_total") == 0


# -- how sessions end, by route; refusals from zero; sessions by route (issue 40) ----------------


def _labels(**labels: str) -> frozenset[tuple[str, str]]:
    return frozenset(labels.items())


def _samples(page: str, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """The labelled samples of ``name`` on a page: {labels (``_labels``): value}."""
    samples = {}
    for line in page.splitlines():
        head, _, value = line.rpartition(" ")
        if not head.startswith(name + "{"):
            continue
        labels = tuple(tuple(pair.split("=", 1)) for pair in head[len(name) + 1:-1].split(","))
        samples[frozenset((key, text.strip('"')) for key, text in labels)] = float(value)
    return samples


async def test_every_refusal_reason_and_every_way_a_session_ends_is_exported_from_zero(start_server):
    from duplexrt.reasons import REFUSAL_REASONS, FinishReason
    from duplexrt.routes import ROUTE_TABLE

    served = await start_server()
    page = await served.metrics()
    refused = _samples(page, "duplexrt_connections_refused_total")
    assert refused == {_labels(reason=reason): 0.0 for reason in REFUSAL_REASONS}
    ended = _samples(page, "duplexrt_sessions_ended_total")
    assert ended == {_labels(route=route.path, reason=str(reason)): 0.0
                     for route in ROUTE_TABLE for reason in FinishReason}
    assert _samples(page, "duplexrt_route_sessions_active") == {
        _labels(route=route.path): 0.0 for route in ROUTE_TABLE}


async def test_sessions_are_counted_by_route_while_open_and_by_finish_reason_once_ended(start_server):
    served = await start_server()
    await duplex_session(served.url(), np.zeros(4 * 1920, np.float32))  # input.end: "stop"
    async with trio_websocket.open_websocket_url(served.url("/v1/realtime")) as ws:
        await ws.get_message()  # session.created
        with trio.fail_after(PATIENCE):
            while _samples(await served.metrics(), "duplexrt_route_sessions_active")[
                    _labels(route="/v1/realtime")] != 1:
                await trio.sleep(0.02)
    with trio.fail_after(PATIENCE):  # the client went away: "client_closed"
        while not _samples(await served.metrics(), "duplexrt_sessions_ended_total")[
                _labels(route="/v1/realtime", reason="client_closed")]:
            await trio.sleep(0.02)
    status, _, _ = await served.get("/v1/nowhere", headers="connection: upgrade\r\nupgrade: websocket\r\n")
    assert status == 404
    with trio.fail_after(PATIENCE):  # a scraper in a loop may get the last page again for a second
        while not _samples(page := await served.metrics(), "duplexrt_connections_refused_total")[
                _labels(reason="not_found")]:
            await trio.sleep(0.05)
    ended = {labels: value for labels, value in _samples(page, "duplexrt_sessions_ended_total").items() if value}
    assert ended == {_labels(route="/v1/duplex", reason="stop"): 1.0,
                     _labels(route="/v1/realtime", reason="client_closed"): 1.0}
    assert not any(_samples(page, "duplexrt_route_sessions_active").values())
    refused = {labels: value for labels, value in _samples(page, "duplexrt_connections_refused_total").items()
               if value}
    assert refused == {_labels(reason="not_found"): 1.0}


@pytest.mark.parametrize("trusted", [False, True])
async def test_session_log_lines_name_the_route_and_the_client(start_server, caplog, trusted):
    """The client behind a trusted proxy is the one its X-Forwarded-For names; an untrusted
    peer's header is not believed."""
    caplog.set_level(logging.INFO, logger="duplexrt.session")
    overrides = ['server.trusted_proxies=["127.0.0.1"]'] if trusted else []
    served = await start_server(*overrides)
    async with trio_websocket.open_websocket_url(served.url("/v1/duplex?format=pcm_s16le"),
                                                 extra_headers=[("x-forwarded-for", "203.0.113.7")]) as ws:
        await ws.send_message(INPUT_END)
        with pytest.raises(trio_websocket.ConnectionClosed):
            with trio.fail_after(PATIENCE):
                while True:
                    await ws.get_message()
    client = "203.0.113.7" if trusted else "127.0.0.1"
    lines = [r.getMessage() for r in caplog.records if r.name == "duplexrt.session"]
    (opened,) = [line for line in lines if " opened: " in line]
    (ended,) = [line for line in lines if " ended: " in line]
    assert opened.endswith(f"1 active, on /v1/duplex from {client}")
    assert ended.split("ended: ")[1].startswith("stop, ") and ended.endswith(f", on /v1/duplex from {client}")


def test_every_refusal_the_server_counts_is_a_known_reason():
    """``REFUSAL_REASONS`` is what is exported from zero: a refusal counted under another name
    would appear only once it happened."""
    import re
    from pathlib import Path

    from duplexrt.reasons import REFUSAL_REASONS

    source = "\n".join(path.read_text() for path in Path("duplexrt").rglob("*.py"))
    counted = set(re.findall(r'refused\["(\w+)"\]', source))
    counted |= {f"resume_{code}" for code in re.findall(r'ResumeError\(\d+, "(\w+)"', source)}
    assert 'refused[f"resume_{exc.code}"]' in source  # the resume codes are counted so
    assert counted <= set(REFUSAL_REASONS), f"add to REFUSAL_REASONS: {sorted(counted - set(REFUSAL_REASONS))}"
