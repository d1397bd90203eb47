"""Per-client limits (issue 38, item 7): how many connections one client address may hold open
(``server.max_connections_per_peer``), counted by the peer's own address, or behind a trusted
balancer by the client its ``X-Forwarded-For`` names; loopback left alone unless told.

Real sockets on loopback: 127.0.0.2 is another address on this host, so one "client" floods
from it while another connects from 127.0.0.1.
"""

from __future__ import annotations

import json
import socket

import trio
import trio_websocket

from conftest import PATIENCE
from duplexrt.server.peers import PeerCounts

UPGRADE = ("GET /v1/duplex HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
           "sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n{extra}\r\n")


def _connect(port: int, source: str) -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def _status(sock: socket.socket) -> int:
    """The status of the answer on ``sock``; 0 when the connection was closed or reset unanswered."""
    sock.settimeout(PATIENCE)
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    except ConnectionResetError:
        pass
    return int(data.split(b" ")[1]) if data else 0


async def _upgrade(port: int, source: str, extra: str = "") -> tuple[socket.socket, int]:
    sock = _connect(port, source)
    sock.sendall(UPGRADE.format(extra=extra).encode())
    return sock, await trio.to_thread.run_sync(_status, sock)


def test_peer_counts_cap_each_address_and_forget_it_when_done():
    counts = PeerCounts(2)
    a, b = "192.0.2.1", "192.0.2.2"
    assert counts.take(a) and counts.take(a) and not counts.take(a)
    assert counts.take(b)
    counts.give_back(a)
    assert counts.take(a) and not counts.take(a)
    for address in (a, a, b):
        counts.give_back(address)
    assert len(counts) == 0
    assert all(PeerCounts(0).take(a) for _ in range(100))  # 0: no cap


async def test_one_address_holds_at_most_its_cap_and_others_are_served(start_server):
    """Eight upgrades from 127.0.0.2 against a cap of 3: three sessions, five refused (429, or
    reset before the answer is read), nothing held for them; a caller from 127.0.0.1 is served
    meanwhile, and once 127.0.0.2's sessions end it may open new ones."""
    running = await start_server("server.max_connections_per_peer=3", "server.unlimited_peers=[]",
                                 "runtime.slots=8")
    server = running.server
    opened = [await _upgrade(running.port, "127.0.0.2") for _ in range(8)]
    statuses = [status for _, status in opened]
    assert statuses[:3] == [101] * 3 and all(status in (429, 0) for status in statuses[3:]), statuses
    assert server.refused["too_many_from_peer"] == 5
    assert server.admitted == 3
    with trio.fail_after(PATIENCE):
        async with trio_websocket.open_websocket_url(running.url()) as ws:
            assert json.loads(await ws.get_message())["type"] == "session.created"
    for sock, _ in opened:
        sock.close()
    with trio.fail_after(PATIENCE):
        while server.admitted or len(server._peers):
            await trio.sleep(0.01)
    sock, status = await _upgrade(running.port, "127.0.0.2")
    assert status == 101
    sock.close()


async def test_loopback_is_not_capped_unless_told(start_server):
    running = await start_server("server.max_connections_per_peer=2", "runtime.slots=8")
    opened = [await _upgrade(running.port, "127.0.0.2") for _ in range(5)]
    assert [status for _, status in opened] == [101] * 5
    for sock, _ in opened:
        sock.close()


async def test_behind_a_trusted_balancer_each_forwarded_client_is_counted(start_server):
    """The balancer (127.0.0.1, trusted) carries every client: the cap counts the client its
    X-Forwarded-For names, and a client that writes its own header from elsewhere is counted by
    its own address."""
    running = await start_server("server.max_connections_per_peer=2", "server.unlimited_peers=[]",
                                 'server.trusted_proxies=["127.0.0.1"]', "runtime.slots=8")
    server = running.server
    first = "x-forwarded-for: 198.51.100.7\r\n"
    opened = [await _upgrade(running.port, "127.0.0.1", first) for _ in range(3)]
    assert [status for _, status in opened] == [101, 101, 429]
    other, status = await _upgrade(running.port, "127.0.0.1", "x-forwarded-for: 198.51.100.8\r\n")
    assert status == 101
    # Not through the balancer: its header is not believed, its own address is counted.
    lying = [await _upgrade(running.port, "127.0.0.2", "x-forwarded-for: 203.0.113.1\r\n") for _ in range(3)]
    assert [status for _, status in lying][:2] == [101, 101] and lying[2][1] in (429, 0)
    assert server.refused["too_many_from_peer"] == 2
    for sock, _ in [*opened, (other, 0), *lying]:
        sock.close()


# -- /stats and /readyz within a budget of the thread ----------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pages_past_their_budget_are_the_last_ones_and_never_older_than_max_age():
    from duplexrt.server.page_budget import PageBudget

    clock = FakeClock()
    rendered = []
    budget: PageBudget[int] = PageBudget(share=0.0, burst_s=0.0, clock=clock)  # no credit: only age renders
    pages = [budget.page("a", lambda: rendered.append(1) or len(rendered), 1.0) for _ in range(100)]
    assert pages == [1] * 100 and budget.renders == 1
    assert budget.page("b", lambda: -1, 1.0) == -1  # another key has a page of its own
    clock.now += 0.99
    assert budget.page("a", lambda: 99, 1.0) == 1
    clock.now += 0.01
    assert budget.page("a", lambda: 99, 1.0) == 99
    # With credit (1 % of the clock), renders go on until it is spent.
    generous: PageBudget[int] = PageBudget(share=0.01, burst_s=10.0, clock=clock)
    assert [generous.page("a", lambda: n, 1.0) for n in range(5)] == list(range(5))


async def test_a_loop_on_stats_and_readyz_gets_the_last_page_and_a_drain_shows_at_once(nursery, start_server):
    """Issue 38, item 7: a client polling /stats and /readyz in a loop does not get a render per
    request once the budget is spent; /readyz still says ``draining`` the moment a drain begins."""
    from duplexrt.server.page_budget import PageBudget
    from conftest import http_get

    running = await start_server("runtime.slots=2", "server.shutdown_grace_s=600")
    server = running.server
    server.pages = PageBudget(share=0.0, burst_s=0.0, clock=FakeClock())  # spent: no page is rendered again
    call = await trio_websocket.connect_websocket_url(nursery, running.url())
    await call.get_message()  # a call keeps the drain going
    for _ in range(20):
        assert (await http_get(running.port, "/stats"))[0] == 200
        assert (await running.readyz())[0] == 200
    assert server.pages.renders == 2
    assert (await http_get(running.port, "/drain", "POST"))[0] == 202
    status, body = await running.readyz()
    assert (status, body["reason"]) == (503, "draining")
    assert server.pages.renders == 3
    await call.aclose()


def test_by_default_balancers_and_pods_on_private_addresses_are_not_capped():
    from ipaddress import ip_address

    from duplexrt.config import load_config
    from duplexrt.server.peers import in_networks

    settings = load_config(None).server
    assert settings.max_connections_per_peer == 16 and settings.trusted_proxies == ()
    for address in ("127.0.0.1", "::1", "10.4.0.7", "172.20.1.1", "192.168.1.9", "fd00::5"):
        assert in_networks(ip_address(address), settings.unlimited_peers), address
    for address in ("203.0.113.9", "198.51.100.7", "2001:db8::1", "8.8.8.8"):
        assert not in_networks(ip_address(address), settings.unlimited_peers), address
