"""The drain: how a server stops without hanging up on the calls it carries.

A call cannot move to another replica (its state lives in the model's rows on this GPU), so ending
it early loses the conversation.  The first SIGTERM or SIGINT, or ``POST /drain`` (what a
Kubernetes preStop hook can call), therefore only *begins* a drain: ``/readyz`` answers 503
``draining`` at once, so balancers send new calls elsewhere, new sessions are refused with 503,
and the calls under way go on until they end or ``server.shutdown_grace_s`` passes.  Only then
are the ones left told ``shutdown`` (they answer the frames they already took, then close with
1001).  A second signal cuts everything at once.

Who may ask for a drain is ``drain_refusal``'s to say: the host itself (a loopback peer, reached
directly), or whoever holds ``server.admin_key``; never a client merely because it may use the
model.

This module holds the parts of that with no sockets in them: the wait with its progress lines,
the answer to ``POST /drain`` and the count of signals.  ``duplexrt.server.app`` wires them in.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from duplexrt.server.peers import Address, in_networks

if TYPE_CHECKING:
    from duplexrt.config import ServerConfig

log = logging.getLogger("duplexrt.server")

#: The endpoint a preStop hook (or an operator's script) calls to begin the drain.
DRAIN_PATH = "/drain"
#: How often the wait looks at the calls left: the drain ends at most this long after the last one.
POLL_S = 0.25
#: How often a progress line is logged while calls are left.
REPORT_EVERY_S = 10.0


def progress_line(calls: int, seconds_left: float) -> str:
    """``draining: 12 calls left, 240 s to go``."""
    return f"draining: {calls} call{'' if calls == 1 else 's'} left, {max(0, math.ceil(seconds_left))} s to go"


async def wait_for_calls(calls_left: Callable[[], int], grace_s: float, *,
                         report_every_s: float = REPORT_EVERY_S, poll_s: float = POLL_S) -> int:
    """Wait until ``calls_left()`` is 0 or ``grace_s`` has passed, logging progress; return the
    calls still left (0: every call ended on its own).

    Polled rather than woken: a call ends in many ways (its client closes, it expires, a detached
    one's resume window runs out), and a quarter of a second more of draining costs nothing."""
    started = trio.current_time()
    deadline = started + grace_s
    left = calls_left()
    log.info(progress_line(left, grace_s))
    next_report = started + report_every_s
    while left and trio.current_time() < deadline:
        await trio.sleep(min(poll_s, deadline - trio.current_time()))
        left = calls_left()
        now = trio.current_time()
        if left and now >= next_report and now < deadline:
            log.info(progress_line(left, deadline - now))
            next_report = now + report_every_s
    waited = trio.current_time() - started
    if left:
        log.info("draining: grace period over (server.shutdown_grace_s = %g) with %d call%s left: "
                 "telling %s shutdown", grace_s, left, "" if left == 1 else "s", "it" if left == 1 else "them")
    else:
        log.info("drained: every call ended, after %.1f s", waited)
    return left


def drain_refusal(client: Address | None, via_proxy: bool, offered_key: str,
                  settings: ServerConfig) -> tuple[int, str] | None:
    """Why this ``POST /drain`` may not stop the server (status and reason), or None when it may.

    Stopping the server is not using the model: a key that opens sessions does not stop one.  A
    drain is served to a request that sends ``server.admin_key`` (from anywhere), and otherwise
    only to a client in ``server.drain_from`` (loopback: a Kubernetes preStop hook runs inside
    the Pod, an operator's script on the host) that came through no proxy it was not told to
    trust (``via_proxy``: a balancer on the same host connects from loopback too) and sends the
    API key when there is one.  ``client``: the peer's address, or the client a trusted proxy
    named (``duplexrt.server.peers``)."""
    if settings.admin_key and hmac.compare_digest(offered_key.encode(), settings.admin_key.encode()):
        return None
    if via_proxy or not in_networks(client, settings.drain_from):
        return 403, ("POST /drain stops the server: it is served to the host itself (a peer in "
                     "server.drain_from, loopback unless set, reached directly, not through a balancer) "
                     "or to a request with the admin key (server.admin_key)")
    if settings.api_key and not hmac.compare_digest(offered_key.encode(), settings.api_key.encode()):
        return 401, "a valid API key is required (Authorization: Bearer KEY)"
    return None


def drain_answer(method: str, refusal: tuple[int, str] | None, already: bool, calls: int,
                 grace_s: float) -> tuple[int, bytes, list[tuple[str, str]]]:
    """The answer to a request for ``/drain``: status, JSON body and extra headers; ``refusal``:
    what ``drain_refusal`` said.  The caller begins the drain when the status is 202 (asking
    twice is harmless: the drain is one)."""
    if method != "POST":
        return 405, b'{"error": "POST /drain begins the drain"}\n', [("allow", "POST")]
    if refusal is not None:
        status, reason = refusal
        return (status, (json.dumps({"error": reason}) + "\n").encode(),
                [("www-authenticate", "Bearer")] if status == 401 else [])
    body = {"draining": True, "already_draining": already, "calls": calls, "shutdown_grace_s": grace_s}
    return 202, (json.dumps(body) + "\n").encode(), []


async def keep_cutting(abort: Callable[[], bool], every_s: float = 0.05) -> None:
    """After a second signal: drop every connection, again and again, until none is left.

    Once cancelled, each session says goodbye in a shielded scope (its end event, its closing
    handshake, bounded by ``server.close_timeout_s``): a connection dropped before that goodbye
    began would wait its whole close timeout in it.  Dropping whatever is still open every few
    milliseconds ends those too, so the process stops at once whatever the timeouts."""
    with trio.CancelScope(shield=True):
        while abort():
            await trio.sleep(every_s)


class Signals:
    """Counts SIGINT/SIGTERM: the first begins the drain, the second cuts at once.  A drain begun
    over HTTP is not a signal: the SIGTERM Kubernetes sends after its preStop hook is still the
    first, and lets the calls finish."""

    def __init__(self) -> None:
        self.received = 0

    def receive(self, name: str) -> bool:
        """Log the signal; True when it is a second one (stop now)."""
        self.received += 1
        if self.received == 1:
            log.info("received %s: draining (calls under way go on; a second signal stops at once)", name)
            return False
        log.info("received %s again: stopping now, cutting every call", name)
        return True
