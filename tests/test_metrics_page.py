"""``/metrics`` may not hold the trio thread (issue 32, defect 8): a scraper in a loop gets the last
page again once renders have taken their share of the thread; one that comes now and then gets
a fresh page; no page is ever older than a second."""

from __future__ import annotations

import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from conftest import PATIENCE
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
