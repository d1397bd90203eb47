"""Reading a running server's figures over plain HTTP: ``GET /metrics`` (Prometheus text) and
``GET /readyz`` (JSON), on the host and port of its WebSocket URL.

``simulate --url`` scrapes ``/metrics`` before and after each round and reports the differences:
what the server did for that round (and for anything else it served meanwhile).
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import attrs
import h11
import trio
from prometheus_client.parser import text_string_to_metric_families

from duplexrt.client.connection import ConnectError, host_and_port

__all__ = ["MetricsSnapshot", "http_get", "read_ready", "scrape_metrics"]

_MAX_BODY = 16 << 20


async def http_get(url: str, path: str, *, timeout: float = 10.0) -> tuple[int, bytes]:
    """``GET path`` on the host and port of ``url`` (``wss`` means TLS); returns status and body.
    Raises ConnectError when the server cannot be reached or does not answer in time."""
    host, port = host_and_port(url)
    tls = urlsplit(url).scheme == "wss"
    with trio.move_on_after(timeout) as scope:
        try:
            if tls:
                stream: trio.abc.Stream = await trio.open_ssl_over_tcp_stream(
                    host, port, ssl_context=ssl.create_default_context())
            else:
                stream = await trio.open_tcp_stream(host, port)
        except OSError as exc:
            refused = _is_refused(exc)
            raise ConnectError("refused" if refused else "connect_failed",
                               f"cannot connect to {host}:{port}: "
                               + ("connection refused (is `duplexrt serve` running there?)" if refused else str(exc))
                               ) from None
        async with stream:
            client = h11.Connection(h11.CLIENT)
            request = h11.Request(method="GET", target=path,
                                  headers=[("host", f"{host}:{port}"), ("connection", "close")])
            await stream.send_all(client.send(request) + client.send(h11.EndOfMessage()))
            status = 0
            body = bytearray()
            while True:
                try:
                    event = client.next_event()
                except h11.RemoteProtocolError as exc:
                    raise ConnectError("http", f"GET {path} on {host}:{port}: malformed response: {exc}") from None
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    client.receive_data(bytes(data))  # trio may give a bytearray; h11 is typed for bytes
                    continue
                if isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > _MAX_BODY:
                        raise ConnectError("http", f"GET {path}: the response is too large")
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    return status, bytes(body)
    assert scope.cancelled_caught
    raise ConnectError("timeout", f"GET {path} on {host}:{port} got no answer within {timeout:g} s")


def _is_refused(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, ConnectionRefusedError):
            return True
        if isinstance(exc, BaseExceptionGroup) and exc.subgroup(lambda e: isinstance(e, ConnectionRefusedError)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@attrs.frozen
class MetricsSnapshot:
    """Every sample of one scrape, by name and labels."""

    samples: Mapping[tuple[str, frozenset[tuple[str, str]]], float]

    @classmethod
    def parse(cls, text: str) -> MetricsSnapshot:
        samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
        return cls(samples)

    def value(self, name: str, **labels: str) -> float | None:
        return self.samples.get((name, frozenset(labels.items())))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``{label value: sample}`` for every sample of ``name`` that has ``label``."""
        result = {}
        for (sample_name, labels), value in self.samples.items():
            if sample_name == name:
                for key, text in labels:
                    if key == label:
                        result[text] = value
        return result

    def delta(self, earlier: MetricsSnapshot, name: str, **labels: str) -> float | None:
        """How much a counter grew since ``earlier``; None where either scrape lacks it."""
        now = self.value(name, **labels)
        then = earlier.value(name, **labels)
        if now is None or then is None:
            return None
        return now - then


async def scrape_metrics(url: str, *, timeout: float = 10.0) -> MetricsSnapshot:
    status, body = await http_get(url, "/metrics", timeout=timeout)
    if status != 200:
        raise ConnectError(f"http_{status}", f"GET /metrics answered HTTP {status}", status)
    return MetricsSnapshot.parse(body.decode("utf-8", "replace"))


async def read_ready(url: str, *, timeout: float = 10.0) -> dict[str, Any] | None:
    """The server's ``/readyz`` JSON (backend, slots, free slots), ready or not; None if it has none."""
    status, body = await http_get(url, "/readyz", timeout=timeout)
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    data["_status"] = status
    return data
