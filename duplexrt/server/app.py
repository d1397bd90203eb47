"""The server: one TCP port, WebSocket sessions on the routes of routes.py, plain HTTP for the rest.

Each connection is read up to the end of its request head first (at most
``server.max_pending_handshakes`` at once; past that the oldest is let go: see ``_read_head``).
A WebSocket upgrade to a known route is checked (API key, free slot, route options) and answered
here, the session then reading and writing its frames on the socket (``duplexrt.wire.native``);
anything else is answered as plain HTTP (health, readiness, metrics).  Whatever one connection
does, the handler catches it: a misbehaving client never takes the server down.
"""

from __future__ import annotations

import hmac
import logging
import math
import socket
import ssl
from collections import Counter
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import attrs
import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector

from duplexrt.backends import Backend, SlotChoice
from duplexrt.backends.base import PersonaError
from duplexrt.config import Config
from duplexrt.wire.resume import Claim, ResumableTransport, ResumeError, new_token, split_token
from duplexrt.runtime import Runtime, open_runtime
from duplexrt.protocols.base import Translator
from duplexrt.protocols.events import ProtocolError, clip
from duplexrt.reasons import CloseCode
from duplexrt.server.budget import journal_bytes
from duplexrt.server.drain import DRAIN_PATH, Signals, drain_answer, drain_refusal, keep_cutting, wait_for_calls
from duplexrt.server.http import BadRequest, RequestHead, read_request_head, response_bytes
from duplexrt.server.listen import check_free, open_listeners
from duplexrt.server.liveness import Liveness
from duplexrt.server.metrics import RuntimeCollector, metrics_text
from duplexrt.server.origin import origin_refusal
from duplexrt.server.peers import Address, PeerCounts, client_address, forwarded, in_networks, peer_address
from duplexrt.server.routes import ROUTES
from duplexrt.server.statistics import ServerStatistics
from duplexrt.server.stats_log import log_stats
from duplexrt.server.tls import Stream, TLSWebSocket, refuse_plain_http, server_context, speaks_tls
from duplexrt.server.page_budget import PageBudget
from duplexrt.server.transcripts_http import is_transcript_path, transcript_response
from duplexrt.server.web import FULL_OK, readyz_answer, static_answer, stats_json
from duplexrt.wire.transport import Transport, TransportClosed
from duplexrt.wire.handshake import HandshakeRefused, accept_response, check_request, proposed_subprotocols
from duplexrt.wire.native import NativeWebSocket

log = logging.getLogger("duplexrt.server")
#: The start-up line: printed whatever the log level (even --log-level warning or error).
hello = logging.getLogger("duplexrt.hello")

#: Browsers cannot set Authorization on a WebSocket: like OpenAI's Realtime API, they offer the key
#: as a subprotocol, ``openai-insecure-api-key.KEY``, next to a real one that the server answers with.
KEY_SUBPROTOCOL = "openai-insecure-api-key."

#: The shortest time a request head gets under pressure (pending heads near the cap): plenty for
#: a client that sends its head with the connection, as every real one does.
_MIN_HEAD_READ_S = 0.5
#: How old a ``/readyz`` or ``/stats`` page may be when requests come faster than their budget
#: renders them (``page_budget``): a balancer checks readiness every half second or so.
_READYZ_MAX_AGE_S = 0.25
_STATS_MAX_AGE_S = 1.0
#: TCP keepalive on accepted sockets: a peer gone without a FIN is noticed after
#: idle + interval x count seconds even where no WebSocket ping runs (plain HTTP, pings off).
_TCP_KEEPALIVE = (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))


@attrs.define(eq=False)
class _PendingHead:
    """A connection still sending its request head: what the eviction cancels, the one that
    has sent nothing for longest first (``Server._read_head``)."""

    scope: trio.CancelScope
    #: When it connected, and when the whole head is due at the latest (``handshake_timeout_s``).
    started: float
    due: float
    #: Bytes of head received so far.
    received: int = 0
    evicted: bool = False


@attrs.define(eq=False)
class _Resumable:
    """A session a client may resume: its transport, translator and route; ``over``, set once the
    session has ended and let go of its slot; ``evicted``, given up for a new caller."""

    transport: ResumableTransport
    translator: Translator
    path: str
    over: trio.Event = attrs.Factory(trio.Event)
    evicted: bool = False
    #: A client is resuming it now (its token claimed, the replay going out): not evicted.
    resuming: bool = False


def head_deadline_s(timeout_s: float, pending: int, cap: int) -> float:
    """How long a new connection gets to send its request head when ``pending`` others are still
    sending theirs: the full ``timeout_s`` up to half the cap, then less and less, down to
    ``_MIN_HEAD_READ_S``: a flood of half-sent heads turns over ever faster."""
    share_left = 2 * (cap - pending) / cap
    return max(min(timeout_s, _MIN_HEAD_READ_S), timeout_s * min(1.0, share_left))


class Server:
    """Serves a runtime on ``config.server.host:port``.  ``await nursery.start(server.run)``
    returns once it listens (``server.ports`` then holds the bound ports)."""

    def __init__(self, config: Config, backend: Backend | None = None) -> None:
        self.config = config
        self._backend = backend
        self.runtime: Runtime | None = None
        self.ports: list[int] = []
        #: Connections refused before a session started, by reason (exported as a metric).
        self.refused: Counter[str] = Counter()
        self._admitted = 0
        self._open_connections = 0
        #: Connections still reading their request head, the one whose last bytes came longest
        #: ago first (see ``_read_head``).
        self._pending: dict[int, _PendingHead] = {}
        #: Connections open per client address (``server.max_connections_per_peer``).
        self._peers = PeerCounts(config.server.max_connections_per_peer)
        #: What /readyz and /stats may take of the trio thread (``duplexrt.server.page_budget``).
        self.pages: PageBudget[tuple[int, bytes, str]] = PageBudget()
        self._connection_ids = 0
        #: Detached sessions evicted for a new caller, not yet over: their admissions are the
        #: new callers' already (see ``_admit``).
        self._evicting = 0
        #: Every open socket and WebSocket, so a second signal can drop them all at once.
        self._streams: set[trio.SocketStream] = set()
        self._transports: set[NativeWebSocket] = set()
        self._all_closed = trio.lowlevel.ParkingLot()
        self._draining = False
        self._drain_requested = trio.Event()
        self._accept_scope: trio.CancelScope | None = None
        #: ``server.ssl_certfile``'s context once ``run`` has loaded it; None: plain TCP.
        self._tls: ssl.SSLContext | None = None
        #: This replica's name behind a balancer (``server.replica_id``, else host:port once bound).
        self.replica_id = config.server.replica_id
        #: Sessions a client may resume, by their token's secret.
        self._resumable: dict[str, _Resumable] = {}
        #: What /healthz answers: 503 once the model has failed every step for a while.
        self.liveness = Liveness()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RuntimeCollector(lambda: self.statistics() if self.runtime is not None else None))
        # process_cpu_seconds_total and friends: how `simulate --url` measures server CPU per frame.
        ProcessCollector(registry=self.registry)

    @property
    def pending_handshakes(self) -> int:
        """Connections still sending their request head."""
        return len(self._pending)

    @property
    def detached(self) -> int:
        """Sessions whose connection dropped, waiting for a resume (or for their client to collect
        the end): a new caller that finds no free slot takes the oldest one's."""
        return sum(entry.transport.detached for entry in self._resumable.values())

    @property
    def admitted(self) -> int:
        """WebSocket connections admitted and not yet ended: what admission compares with the limit."""
        return self._admitted

    @property
    def draining(self) -> bool:
        """``shutdown()`` has begun: no new session is admitted."""
        return self._draining

    def statistics(self) -> ServerStatistics:
        """The runtime's record and the server's connection counters, read at one moment."""
        assert self.runtime is not None, "the server has not started"
        return ServerStatistics(replica_id=self.replica_id or "", draining=self._draining,
                                admitted=self._admitted - self._evicting, pending_handshakes=self.pending_handshakes,
                                refused=dict(sorted(self.refused.items())), runtime=self.runtime.statistics(),
                                detached=self.detached)

    # -- lifecycle -------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the model, listen, serve.  Returns after ``shutdown()`` has drained."""
        settings = self.config.server
        check_free(settings.host, settings.port)  # a taken port is said now, not after a load of minutes
        # A bad certificate or key, too (duplexrt.server.tls).
        self._tls = server_context(settings.ssl_certfile, settings.ssl_keyfile) if settings.ssl_certfile else None
        async with open_runtime(self.config, self._backend) as runtime:
            self.runtime = runtime
            listeners = await open_listeners(settings.port, settings.host)
            self.ports = sorted({listener.socket.getsockname()[1] for listener in listeners})
            self.replica_id = self.replica_id or f"{socket.gethostname()}:{self.ports[0]}"
            await self._serve(runtime, listeners, task_status)

    async def _serve(self, runtime: Runtime, listeners: list[trio.SocketListener],
                     task_status: trio.TaskStatus[Server]) -> None:
        async with trio.open_nursery() as connections:
            if self.config.metrics.log_stats:
                connections.start_soon(log_stats, runtime, self.config.metrics.log_stats_interval_s)
            async with trio.open_nursery() as accepting:
                self._accept_scope = accepting.cancel_scope
                accepting.start_soon(partial(trio.serve_listeners, self._handle, listeners,
                                             handler_nursery=connections))
                task_status.started(self)
                await self._drain_requested.wait()
                # Still listening while the sessions finish: a balancer's health check gets
                # /readyz 503 "draining" (not a refused connection it might retry), and a new
                # session gets a 503 it can take elsewhere.
                await self._drain()
                accepting.cancel_scope.cancel()
            connections.cancel_scope.cancel()

    def shutdown(self) -> None:
        """Begin the drain (duplexrt.server.drain): refuse new sessions, let the calls under way
        finish within ``server.shutdown_grace_s``, then let ``run`` return."""
        if self._draining:
            return
        self._draining = True
        self._drain_requested.set()

    def _calls_left(self) -> int:
        """Calls the drain waits for: sessions (detached ones included) or admitted connections."""
        return max(self._admitted, len(self.runtime.sessions) if self.runtime is not None else 0)

    def abort(self) -> bool:
        """Drop every connection now, closing handshakes under way included: nothing is left for
        the shutdown to wait on.  False when none was open any more."""
        for entry in self._resumable.values():
            entry.transport.abandon()  # a connection dropped here must not wait for its client to resume
        for transport in list(self._transports):
            transport.abort()
        for stream in list(self._streams):
            stream.socket.close()
        return bool(self._transports or self._streams)

    async def _drain(self) -> None:
        assert self.runtime is not None
        if await wait_for_calls(self._calls_left, self.config.server.shutdown_grace_s):
            for session in list(self.runtime.sessions):
                session.shutdown()
            for entry in self._resumable.values():
                entry.transport.abandon()  # no resume is waited for once the grace is over
        # Told or not, the sessions' last frames and closing handshakes, then stop listening.
        with trio.move_on_after(self.config.server.close_timeout_s):
            while self._admitted:
                await self._all_closed.park()
            assert self._accept_scope is not None
            self._accept_scope.cancel()  # the sessions are done: now stop listening
            while self._open_connections:  # plain HTTP answers under way, handshakes being refused
                await self._all_closed.park()

    # -- connections -----------------------------------------------------------------------------

    async def _handle(self, tcp: trio.SocketStream) -> None:
        self._open_connections += 1
        self._streams.add(tcp)
        # With TLS, its handshake is done as the head is read (``_read_head``), under its limits.
        stream: Stream = tcp if self._tls is None else trio.SSLStream(tcp, self._tls, server_side=True,
                                                                       https_compatible=True)
        try:
            _enable_tcp_keepalive(tcp)
            peer = peer_address(tcp)
            # A trusted proxy carries many clients: each is counted once its head names it.
            if self._peer_is_capped(peer) and not in_networks(peer, self.config.server.trusted_proxies):
                assert peer is not None
                await self._serve_counted(stream, peer, peer)
            else:
                await self._serve_connection(stream, peer)
        except BaseException as exc:
            _reraise_cancellation_only(exc)
        finally:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)
            self._streams.discard(tcp)
            self._open_connections -= 1
            if not self._open_connections:
                self._all_closed.unpark_all()

    def _peer_is_capped(self, address: Address | None) -> bool:
        """Connections from ``address`` count against ``server.max_connections_per_peer``."""
        settings = self.config.server
        return (address is not None and settings.max_connections_per_peer > 0
                and not in_networks(address, settings.unlimited_peers))

    async def _serve_counted(self, stream: Stream, counted: Address, peer: Address | None,
                             head: tuple[RequestHead, bytes] | None = None) -> None:
        """Serve a connection that counts as one of ``counted``'s, or refuse it (429) when that
        client already holds ``server.max_connections_per_peer``: one client's connections cannot
        crowd out everyone else's, whether they send heads slowly, open sessions or poll pages.
        Refused before its head is read (unless a trusted proxy's head named the client): it
        costs a counter and one small write."""
        if not self._peers.take(counted):
            self.refused["too_many_from_peer"] += 1
            await self._respond(stream, 429, f"too many connections from {counted} (the cap is "
                                             f"{self._peers.cap} at once); try again later",
                                [("retry-after", "1")])
            return
        try:
            await self._serve_connection(stream, peer, head)
        finally:
            self._peers.give_back(counted)

    async def _serve_connection(self, stream: Stream, peer: Address | None,
                                read: tuple[RequestHead, bytes] | None = None) -> None:
        if read is None:
            head_read = await self._read_head(stream)
            if head_read[0] is None:
                return
            read = head_read[0], head_read[1]
            # Behind a trusted proxy: the client its head names is the one counted.
            if in_networks(peer, self.config.server.trusted_proxies):
                client = client_address(peer, read[0].headers, self.config.server.trusted_proxies)
                if client is not None and client != peer and self._peer_is_capped(client):
                    return await self._serve_counted(stream, client, peer, read)
        head, received = read
        route = ROUTES.get(head.path)
        if not head.wants_websocket:
            if route is not None:
                await self._respond(stream, 426, f"{head.path} is a WebSocket endpoint",
                                    [("upgrade", "websocket")])
            else:
                await self._plain_http(stream, head, peer)
            return
        if route is None:
            self.refused["not_found"] += 1
            await self._respond(stream, 404, f"no WebSocket route {head.path}; try {', '.join(ROUTES)}")
            return
        if (foreign := origin_refusal(head.headers, self.config.server)) is not None:
            self.refused["foreign_origin"] += 1
            return await self._respond(stream, 403, foreign)
        # Twilio sends no Authorization header and strips the query string: its route is upgraded
        # without a key, and the key must come in start.customParameters (checked by the
        # translator, within the first-message timeout).
        key_in_start = route.name == "twilio" and not self._authorized(head)
        if not self._authorized(head) and (not key_in_start or "resume" in head.query):
            self.refused["unauthorized"] += 1
            await self._respond(stream, 401, "a valid API key is required (Authorization: Bearer KEY, "
                                             f"?api_key=KEY, or the subprotocol {KEY_SUBPROTOCOL}KEY)",
                                [("www-authenticate", "Bearer")])
            return
        # The upgrade itself is checked before anything is done for it (admission, a detached
        # session evicted for it, a resume claimed): a malformed one costs nobody anything.
        try:
            key = check_request(head.method, head.headers)
        except HandshakeRefused as exc:
            self.refused["bad_handshake"] += 1
            await self._respond(stream, exc.status, str(exc),
                                [("sec-websocket-version", "13")] if exc.status == 426 else None)
            return
        if "resume" in head.query:  # a session that lives here already: no admission
            await self._serve_resume(stream, received, head, key)
            return
        # The client in the session's log lines: behind a trusted proxy, the one it forwards for.
        client = client_address(peer, head.headers, self.config.server.trusted_proxies)
        await self._serve_new_session(stream, received, head, key, "" if client is None else str(client))

    async def _read_head(self, stream: Stream) -> tuple[RequestHead | None, bytes]:
        """The connection's request head, or None once it has been answered (malformed, too slow,
        let go for a newer connection).

        Each connection still sending its head holds a task, buffers and a descriptor, so at
        most ``max_pending_handshakes`` are kept waiting.  A new one past that lets go (503
        ``too_many_pending``) the one that has sent nothing for longest: ``pending`` is kept in
        that order, a head that brings bytes moving to its end.  A client that sends its head
        with the connection, as real ones do, is read at once whatever the number of half-sent
        heads; a flood of idle ones only turns over faster, and a slow head that keeps coming
        (a phone on a poor link) outlives the idle ones around it.  The nearer the cap, the
        shorter the silence a head is allowed (``head_deadline_s``), never its whole time
        (``handshake_timeout_s``) while its bytes keep coming."""
        settings = self.config.server
        cap = settings.max_pending_handshakes
        pending = self._pending
        while len(pending) >= cap:
            idlest = pending.pop(next(iter(pending)))
            idlest.evicted = True
            idlest.scope.cancel()
        now = trio.current_time()
        due = now + settings.handshake_timeout_s
        quiet = head_deadline_s(settings.handshake_timeout_s, len(pending), cap)
        entry = _PendingHead(trio.CancelScope(deadline=min(due, now + quiet)), started=now, due=due)
        self._connection_ids += 1
        key = self._connection_ids
        pending[key] = entry

        def progressed(size: int) -> None:
            entry.received += size
            if pending.pop(key, None) is not None:
                pending[key] = entry  # to the end: the last to be let go
            quiet = head_deadline_s(settings.handshake_timeout_s, len(pending), cap)
            entry.scope.deadline = min(entry.due, trio.current_time() + quiet)

        head: RequestHead | None = None
        received = b""
        bad: BadRequest | None = None
        tls_failed = False
        try:
            with entry.scope:
                if isinstance(stream, trio.SSLStream):  # its TLS handshake first, within the head's time
                    tls_failed = True
                    if not await self._tls_handshake(stream):
                        return None, b""
                    tls_failed = False
                head, received = await read_request_head(stream, progressed)
        except BadRequest as exc:
            bad = exc
        finally:
            pending.pop(key, None)
        if tls_failed:  # evicted or out of time mid-handshake: nothing can be said over it
            self.refused["too_many_pending" if entry.evicted else "handshake_timeout"] += 1
            return None, b""
        if bad is not None:
            await self._respond(stream, bad.status, bad.reason)
            return None, b""
        if head is not None:
            return head, received
        if entry.evicted:
            await self._refuse_pending(stream)
        else:
            self.refused["handshake_timeout"] += 1
            await self._respond(stream, 408, "the request head did not arrive in time")
        return None, b""

    async def _tls_handshake(self, stream: trio.SSLStream[trio.SocketStream]) -> bool:
        """Do the TLS handshake; False (the connection answered or given up) where it failed,
        the client spoke plain HTTP (told so, in plain HTTP) or it hung up."""
        tls = await speaks_tls(stream.transport_stream)
        if tls is None:
            return False
        if not tls:
            self.refused["plain_http_on_tls"] += 1
            await refuse_plain_http(stream.transport_stream)
            return False
        try:
            await stream.do_handshake()
        except trio.BrokenResourceError as exc:
            self.refused["tls_handshake"] += 1
            log.debug("TLS handshake failed: %s", exc.__cause__ or exc)
            return False
        return True

    async def _serve_new_session(self, stream: Stream, received: bytes, head: RequestHead,
                                 key: str, client: str = "") -> None:
        """Admit a new session (a free slot, the capacity estimate, the route's options) and serve it."""
        route = ROUTES[head.path]
        if self._draining:
            self.refused["shutting_down"] += 1
            await self._respond(stream, 503, "the server is shutting down")
            return
        runtime = self.runtime
        assert runtime is not None
        if not runtime.scheduler.ready:
            self.refused["not_ready"] += 1
            await self._respond(stream, 503, "the model is not ready", [("retry-after", "1")])
            return
        # No await from the check to the count: admission cannot be raced.
        capacity = runtime.scheduler.capacity.estimate
        slots = runtime.scheduler.slots
        taken = self._admitted - self._evicting
        full = taken >= min(capacity.limit, slots)
        if full and not self._evictable():
            # Full, and no detached session to give way (below): refused.
            if taken < slots:
                self.refused["at_capacity"] += 1
                await self._respond(stream, 503, f"at_capacity: the model can serve {capacity.limit} sessions "
                                                 "in real time and all are in use; try again later",
                                    [("retry-after", "1")])
            else:
                self.refused["no_free_slot"] += 1
                await self._respond(stream, 503, f"all {slots} session slots are in use; try again later",
                                    [("retry-after", "1")])
            return
        try:
            translator = route.translator(head, self.config)
            if route.name == "twilio" and not self._authorized(head):  # the key comes in start
                from duplexrt.protocols.twilio import TwilioTranslator

                assert isinstance(translator, TwilioTranslator)
                translator.require_key(self.config.server.api_key)
        except BadRequest as exc:
            self.refused["bad_options"] += 1
            await self._respond(stream, exc.status, exc.reason)
            return
        transcriber = self.runtime.transcriber if self.runtime is not None else None
        if transcriber is not None and transcriber.model is not None:
            translator.offer_transcripts(transcriber.model.name, transcriber.model.delay_seconds * 1e3,
                                         query=head.query)
        if (refusal := self._check_url_persona(translator)) is not None:
            self.refused["bad_persona"] += 1
            await self._respond(stream, 400, refusal)
            return
        # Full: a detached session (its client gone, maybe for good) gives way to a caller who is
        # here now, the oldest first.  Without this, upgrades cut at once could hold every slot
        # for the resume window.
        evicted = self._evict_oldest_detached() if full else None
        self._admitted += 1
        try:
            if evicted is not None:
                # Its reader wakes, its slot is freed and it ends at once (it has no connection
                # to say goodbye on); bounded all the same.
                with trio.move_on_after(self.config.server.close_timeout_s):
                    await evicted.over.wait()
                if not evicted.over.is_set():
                    self.refused["no_free_slot"] += 1
                    await self._respond(stream, 503, "no session slot came free in time; try again later",
                                        [("retry-after", "1")])
                    return
            await self._serve_websocket(stream, head, received, route.max_message_bytes(self.config),
                                        partial(self._run_session, translator=translator, path=head.path,
                                                base64_audio=route.base64_audio, client=client), key,
                                        first_messages=translator.first_messages)
        finally:
            self._admitted -= 1
            if not self._admitted:
                self._all_closed.unpark_all()

    def _check_url_persona(self, translator: Translator) -> str | None:
        """A persona that came in the URL (``/v1/duplex``, ``/api/chat``) is checked before the
        upgrade, as the route's other options are: the reason to refuse it (400), or None.  The
        checked persona stays with the translator for its session.  A model that takes no persona
        ignores such parameters, as it always did."""
        backend = self.runtime.backend if self.runtime is not None else None
        if backend is None or not backend.takes_persona or not translator.persona_at_start:
            return None
        choice = translator.persona
        choice.check = backend.check_persona
        try:
            choice.current()
        except PersonaError as exc:
            return f"persona refused: {clip(str(exc), 500)}"
        return None

    def _evictable(self) -> list[_Resumable]:
        """The detached sessions a new caller may take the slot of: not one whose client is
        resuming it now (its replay going out), which is detached only for a moment more."""
        return [entry for entry in self._resumable.values() if entry.transport.detached and not entry.resuming]

    def _evict_oldest_detached(self) -> _Resumable | None:
        """End the detached session that dropped first, for a new caller; None when none is."""
        detached = self._evictable()
        if not detached:
            return None
        oldest = min(detached, key=lambda entry: entry.transport.resume_deadline)
        oldest.transport.evict()
        oldest.evicted = True
        self._evicting += 1
        self.refused["evicted_detached"] += 1
        log.info("a detached session gave its slot to a new caller (ends resume_expired)")
        return oldest

    async def _refuse_pending(self, stream: Stream) -> None:
        self.refused["too_many_pending"] += 1
        await self._respond(stream, 503, f"more than {self.config.server.max_pending_handshakes} connections "
                                         "are waiting to be served; try again later", [("retry-after", "1")])

    async def _serve_websocket(self, stream: Stream, head: RequestHead, received: bytes, max_message: int,
                               serve: Callable[[Transport], Awaitable[None]], key: str, *,
                               resuming: bool = False, first_messages: int = 1) -> None:
        """Answer the upgrade (checked already: ``key`` is its Sec-WebSocket-Key) here and let
        the session drive its frames (``duplexrt.wire.native``)."""
        assert self.runtime is not None
        settings = self.config.server
        subprotocol = _companion_subprotocol(proposed_subprotocols(head.headers))
        await self._send(stream, accept_response(key, subprotocol, [("x-duplexrt-replica", self.replica_id or "")]))
        # A resuming client may have nothing left to send (it waits for output): the first-message
        # limit is for new sessions only.
        first_message_timeout = math.inf if resuming else settings.first_message_timeout_s
        options: dict[str, Any] = dict(max_message=max_message, first_message_timeout=first_message_timeout,
                                       close_timeout=settings.close_timeout_s, received=head.rest,
                                       subprotocol=subprotocol, first_messages=first_messages)
        transport = (TLSWebSocket(stream, **options) if isinstance(stream, trio.SSLStream)
                     else NativeWebSocket(stream, **options))
        self._transports.add(transport)
        try:
            if self._draining and not resuming:  # shutdown began while this client's handshake was under way
                return  # (a resume goes on: its call is one the drain waits for)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(transport.watch, settings.ping_interval_s, settings.ping_timeout_s,
                                   settings.idle_timeout_s)
                try:
                    await serve(transport)
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):  # bounded by close_timeout_s
                await transport.close(CloseCode.GOING_AWAY if self._draining else CloseCode.NORMAL_CLOSURE)
            self._transports.discard(transport)

    # -- sessions and their resumes --------------------------------------------------------------

    async def _run_session(self, transport: Transport, *, translator: Translator, path: str,
                           base64_audio: bool = False, client: str = "") -> None:
        """Serve a new session; with resume on, over a transport that survives a dropped connection."""
        assert self.runtime is not None
        settings = self.config.runtime
        if settings.resume_window_s <= 0 or not ROUTES[path].resumable:  # Twilio's cannot resume
            await self.runtime.serve(transport, translator, route=path, peer=client)
            return
        token = new_token(self.replica_id or "")
        frame_seconds = self.config.audio.frame_seconds
        journal_s = settings.resume_journal_s
        resumable = ResumableTransport(
            transport, token, window_s=settings.resume_window_s, journal_s=journal_s,
            max_journal_bytes=lambda: journal_bytes(translator.output_spec, journal_s, frame_seconds,
                                                    base64=base64_audio))
        translator.resume_token = token
        entry = self._resumable[split_token(token)[1]] = _Resumable(resumable, translator, path)
        try:
            await self.runtime.serve(resumable, translator, route=path, peer=client)
        finally:
            self._resumable.pop(split_token(resumable.token)[1], None)
            if entry.evicted:
                self._evicting -= 1
            entry.over.set()

    def _claim_resumable(self, head: RequestHead) -> tuple[ResumableTransport, Translator, int, Claim]:
        """The session ``?resume=TOKEN&received=N`` names, checked and claimed for this connection
        in the step that read its head (no await): of two reconnects with one token, the second
        is refused 409 while the first is under way and 404 once it has resumed.  Raises
        ResumeError."""
        replica, secret = split_token(head.query.get("resume", ""))
        if replica != self.replica_id:
            raise ResumeError(421, "wrong_replica", f"the token belongs to replica {replica!r}, and this is "
                                                    f"{self.replica_id!r}: route it by the token's replica")
        entry = self._resumable.get(secret)
        if entry is None:
            raise ResumeError(404, "unknown_token", "unknown, used or expired resume token: a token resumes "
                                                    "once, within runtime.resume_window_s of the drop")
        resumable, translator, path = entry.transport, entry.translator, entry.path
        if ROUTES[path].name != ROUTES[head.path].name:
            raise ResumeError(400, "wrong_route", f"the session was opened on {path}, not {head.path}")
        try:
            count = int(head.query.get("received", ""))
        except ValueError:
            raise ResumeError(400, "bad_received", "a resume needs received=N: how many of the session's "
                                                   "messages the client received") from None
        claim = resumable.claim(count)
        return resumable, translator, count, claim

    async def _serve_resume(self, stream: Stream, received: bytes, head: RequestHead, key: str) -> None:
        """Resume a session on this connection, draining or not: a call the drain waits for may
        come back after a drop during the grace, as the balancers route it here."""
        try:
            resumable, translator, count, claim = self._claim_resumable(head)
        except ResumeError as exc:
            self.refused[f"resume_{exc.code}"] += 1
            await self._respond(stream, exc.status, f"{exc.code}: {exc.message}")
            return
        max_message = ROUTES[head.path].max_message_bytes(self.config)
        entry = self._resumable.get(split_token(resumable.token)[1])
        if entry is not None:
            entry.resuming = True  # not evicted while its replay goes out (``_evict_oldest_detached``)
        try:
            await self._serve_websocket(stream, head, received, max_message,
                                        partial(self._rejoin, resumable=resumable, translator=translator,
                                                count=count, claim=claim, entry=entry),
                                        key, resuming=True)
        finally:
            resumable.release(claim)  # a handshake that failed before ``attach``: the token stays good
            if entry is not None:
                entry.resuming = False

    async def _rejoin(self, transport: Transport, *, resumable: ResumableTransport,
                      translator: Translator, count: int, claim: Claim, entry: _Resumable | None = None) -> None:
        """Hand the session its new connection, then hold it until the session lets it go.  The
        notice and the replay get ``server.handshake_timeout_s``, as a request head does: a
        resumer that does not read them is given up, and other resumes are not kept waiting."""
        old_secret = split_token(resumable.token)[1]
        try:
            try:
                await resumable.attach(transport, count, new_token(self.replica_id or ""), translator.resumed,
                                       claim=claim, replay_timeout=self.config.server.handshake_timeout_s)
            finally:
                if entry is not None:
                    entry.resuming = False  # resumed, or detached again: evictable as any other
        except ResumeError as exc:  # the session ended or moved on during the handshake
            self.refused[f"resume_{exc.code}"] += 1
            with trio.move_on_after(self.config.server.close_timeout_s):
                try:
                    for message in translator.error(ProtocolError(exc.code, exc.message)):
                        await transport.send(message)
                except TransportClosed:
                    pass
                await transport.close(CloseCode.POLICY_VIOLATION, f"{exc.code}: {exc.message}"[:120])
            return
        except TransportClosed:
            return  # this connection failed too: the session stays detached, the old token good
        entry = self._resumable.pop(old_secret, None)
        if entry is not None:
            self._resumable[split_token(resumable.token)[1]] = entry
        await resumable.wait_released(transport)

    def _authorized(self, head: RequestHead) -> bool:
        expected = self.config.server.api_key
        if not expected:
            return True
        return hmac.compare_digest(_offered_key(head).encode(), expected.encode())

    # -- plain HTTP ------------------------------------------------------------------------------

    async def _plain_http(self, stream: Stream, head: RequestHead, peer: Address | None) -> None:
        if head.path == DRAIN_PATH:  # POST from the host itself, or with the admin key: a preStop hook
            settings = self.config.server
            if (foreign := origin_refusal(head.headers, settings)) is not None:
                return await self._respond(stream, 403, foreign)  # a web page's form may POST here
            client = client_address(peer, head.headers, settings.trusted_proxies)
            via_proxy = client is peer and forwarded(head.headers)  # a proxy this server does not trust
            refusal = drain_refusal(client, via_proxy, _offered_key(head), settings)
            if refusal is not None and head.method == "POST":
                self.refused["drain_refused"] += 1
                log.warning("POST /drain refused (%d) for %s", refusal[0], client or "an unknown peer")
            status, body, headers = drain_answer(head.method, refusal, self._draining,
                                                 self._calls_left(), settings.shutdown_grace_s)
            if status == 202:
                log.info("drain requested over HTTP")
                self.shutdown()
            await self._send(stream, response_bytes(status, body, "application/json", headers))
            return
        if is_transcript_path(head.path):  # caller data: the API key, when one is set
            runtime = self.runtime
            data = transcript_response(runtime.transcripts if runtime is not None else None, head.method,
                                       head.path, self._authorized(head))
            if head.method == "HEAD":
                data = data.partition(b"\r\n\r\n")[0] + b"\r\n\r\n"
            await self._send(stream, data)
            return
        if head.method not in ("GET", "HEAD"):
            await self._respond(stream, 405, "only GET is served here", [("allow", "GET")])
            return
        status, body, content_type = self._plain_answer(head.path, head.query)
        data = response_bytes(status, body, content_type)
        if head.method == "HEAD":  # the same head, no body
            data = data.partition(b"\r\n\r\n")[0] + b"\r\n\r\n"
        await self._send(stream, data)

    def _plain_answer(self, path: str, query: dict[str, str]) -> tuple[int, bytes, str]:
        runtime = self.runtime
        assert runtime is not None
        text = "text/plain; charset=utf-8"
        if path == "/healthz":  # fails once the model has failed every step for a while (liveness)
            return self.liveness.answer(runtime.scheduler.failing)
        if path == "/readyz":
            failing = runtime.scheduler.failing
            self.liveness.observe(failing)  # a balancer's checks count too
            # Within the pages' budget; a drain or a failing model shows at once all the same.
            full_ok = query.get(FULL_OK[0]) == FULL_OK[1]
            return self.pages.page(("/readyz", full_ok, self.draining, failing),
                                   lambda: readyz_answer(self.statistics(), query), _READYZ_MAX_AGE_S)
        if path == "/metrics":
            return 200, metrics_text(self.registry), CONTENT_TYPE_LATEST
        if path == "/stats":
            return self.pages.page("/stats", lambda: (200, stats_json(self.statistics(), self.config),
                                                      "application/json"), _STATS_MAX_AGE_S)
        page = static_answer(path)
        if page is not None:
            return page
        if path in ("/", "/routes"):  # the plain list, also where a build ships without the pages
            routes = "\n".join(f"  ws  {path}  ({route.name})" for path, route in ROUTES.items())
            return 200, (f"duplexrt\n{routes}\n  GET / /dashboard /stats /healthz /readyz /metrics\n"
                         f"  POST {DRAIN_PATH}\n").encode(), text
        return 404, f"nothing at {path}\n".encode(), text

    async def _respond(self, stream: Stream, status: int, text: str,
                       extra_headers: list[tuple[str, str]] | None = None) -> None:
        body = text.encode() + (b"" if text.endswith("\n") else b"\n")
        await self._send(stream, response_bytes(status, body, "text/plain; charset=utf-8", extra_headers))

    async def _send(self, stream: Stream, data: bytes) -> None:
        with trio.move_on_after(self.config.server.close_timeout_s):
            try:
                await stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass


def _offered_key(head: RequestHead) -> str:
    """The key a request offers: ``Authorization: Bearer KEY``, ``?api_key=KEY`` or the
    subprotocol ``openai-insecure-api-key.KEY`` (a browser's), the last of them it sends."""
    offered = head.query.get("api_key", "")
    authorization = head.header("authorization")
    if authorization.lower().startswith("bearer "):
        offered = authorization[7:].strip()
    for protocol in head.header("sec-websocket-protocol").split(","):
        if protocol.strip().startswith(KEY_SUBPROTOCOL):
            offered = protocol.strip()[len(KEY_SUBPROTOCOL):]
    return offered


def _companion_subprotocol(proposed: list[str]) -> str | None:
    """The subprotocol to answer a browser that sent its key as one: the first other one it
    offered (a browser fails the connection when offered subprotocols get no answer).  The key's
    own is never echoed back.  Clients that sent no key subprotocol get none, as before."""
    if not any(p.startswith(KEY_SUBPROTOCOL) for p in proposed):
        return None
    return next((p for p in proposed if not p.startswith(KEY_SUBPROTOCOL)), None)


def _enable_tcp_keepalive(stream: trio.SocketStream) -> None:
    """Let the kernel find peers that vanished without a FIN (a cable pulled, a NAT forgetting
    the flow), where nothing is being sent that would fail."""
    try:
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in _TCP_KEEPALIVE:
            option = getattr(socket, name, None)  # Linux names; other systems keep their defaults
            if option is not None:
                stream.setsockopt(socket.IPPROTO_TCP, option, value)
    except OSError:  # not a TCP socket (a test's stream), or the option is refused: no keepalive
        pass


def _reraise_cancellation_only(exc: BaseException) -> None:
    """Log what a connection raised; let only cancellation through, so one connection's failure
    never reaches the server's nursery."""
    if isinstance(exc, trio.Cancelled):
        raise exc
    if isinstance(exc, BaseExceptionGroup):
        cancelled, rest = exc.split(trio.Cancelled)
        if rest is not None:
            log.error("a connection failed", exc_info=rest)
        if cancelled is not None:
            raise cancelled
        return
    log.error("a connection failed", exc_info=exc)


async def serve(config: Config, backend: Backend | None = None) -> None:
    """Run a server until SIGINT or SIGTERM, then drain and return.  A second signal stops at
    once without waiting for the grace period."""
    import signal

    server = Server(config, backend)
    tag = _ReplicaTag(server)
    counted = Signals()

    async def watch_signals(nursery: trio.Nursery, task_status: trio.TaskStatus[None]) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            async for signum in signals:
                name = signal.Signals(signum).name
                if _stop_if_loading(server, nursery, name):
                    continue
                if counted.receive(name):
                    nursery.cancel_scope.cancel()
                    await keep_cutting(server.abort)  # closing handshakes run shielded
                    return
                server.shutdown()

    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(tag)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(watch_signals, nursery)
            async with trio.open_nursery() as inner:
                await inner.start(server.run)
                runtime = server.statistics().runtime
                _say_hello(config, server.ports, runtime.slot_choice, runtime.persona)
            nursery.cancel_scope.cancel()
        log.info("stopped")
    except BaseExceptionGroup as group:
        # A port in use or a model that cannot load is one error for the caller, not nested groups.
        leaves = _leaves(group)
        if len(leaves) == 1 and isinstance(leaves[0], Exception):
            raise leaves[0] from None
        raise
    finally:
        for handler in handlers:
            handler.removeFilter(tag)


def _stop_if_loading(server: Server, nursery: trio.Nursery, signal_name: str) -> bool:
    """A signal before the model has loaded (Kubernetes stops pods that are still loading):
    there is no session to drain, so everything stops now.  The cancellation reaches the
    scheduler, which interrupts the load (``core/interrupt.py``) and lets it unwind."""
    if server.runtime is not None:
        return False
    log.info("received %s: stopping now, the model has not finished loading", signal_name)
    nursery.cancel_scope.cancel()
    return True


class _ReplicaTag(logging.Filter):
    """Starts every log line with ``[replica ID]``: behind a balancer, many replicas' logs are
    read together.  The id is known once the port is bound (its default names the port)."""

    def __init__(self, server: Server) -> None:
        super().__init__()
        self._server = server

    def filter(self, record: logging.LogRecord) -> bool:
        replica_id = self._server.replica_id
        if replica_id and not hasattr(record, "replica_id"):  # one record may pass several handlers
            record.replica_id = replica_id
            record.msg = f"[replica {replica_id}] {record.msg}"
        return True


def _say_hello(config: Config, ports: list[int], slots: SlotChoice, persona: dict[str, Any] | None = None) -> None:
    """One plain line on stderr whatever the log level (its own handler, no timestamp):
    where to point a browser, and what is served."""
    if not hello.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        hello.addHandler(handler)
        hello.propagate = False
        hello.setLevel(logging.INFO)
    host = config.server.host
    browse = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    browse = f"[{browse}]" if ":" in browse else browse
    hello.info("duplexrt is up: open http://%s:%d/ to talk to it, or /dashboard to watch it. "
               "Listening on %s port(s) %s with WebSocket routes %s (backend %s, %d slots: %s).",
               browse, ports[0], host, ", ".join(map(str, ports)), ", ".join(ROUTES),
               config.backend.name, slots.slots, slots.reason)
    if persona is not None:
        hello.info("%s", persona_line(persona))


def persona_line(persona: dict[str, Any]) -> str:
    """What the start line says of a model that takes a persona: its voices and defaults, and
    how a caller sets one."""
    voices = persona.get("voices") or ()
    default = persona.get("default_voice")
    return (f"The model takes a persona (a role prompt and a voice) per call: voices "
            f"{', '.join(map(str, voices)) or 'none listed'}"
            f"{f' (default {default})' if default else ''}; set it with session.update instructions/voice "
            "(/v1/realtime), session.start (/v1/live/sessions), ?instructions=&voice= (/v1/duplex) or "
            "?text_prompt=&voice_prompt= (/api/chat).")


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        found.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return found
