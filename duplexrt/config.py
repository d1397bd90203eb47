"""Runtime configuration: attrs classes, loaded from TOML, overridable key by key.

A serving process that starts with a nonsensical setting (zero slots, a gather window longer than a
frame) fails later in ways that are hard to trace back, so every value is checked at load time and
an invalid one stops start-up with a message naming the key, the allowed range and the value given.
"""

from __future__ import annotations

import ipaddress
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

#: What attrs calls to check a field: each ``_...`` factory below builds one for a key.
Validator = Callable[[object, "attrs.Attribute[Any]", object], None]

OFFLOAD_POLICIES = ("counted", "always")
LATE_INPUT_POLICIES = ("wait", "fill")
#: ``runtime.slots = "auto"``: the backend chooses at load, from its memory and its measured step.
AUTO_SLOTS = "auto"
MAX_SLOTS = 4096


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range.  The message names the key."""


def _int_range(key: str, low: int, high: int) -> Validator:
    def check(_instance: object, _attribute: attrs.Attribute, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ConfigError(f"{key} must be an integer from {low} to {high}, got {value!r}")

    return check


def _float_range(key: str, low: float, high: float) -> Validator:
    def check(_instance: object, _attribute: attrs.Attribute, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
            raise ConfigError(f"{key} must be a number from {low:g} to {high:g}, got {value!r}")

    return check


def _one_of(key: str, allowed: Iterable[str]) -> Validator:
    allowed = tuple(allowed)

    def check(_instance: object, _attribute: attrs.Attribute, value: object) -> None:
        if value not in allowed:
            raise ConfigError(f"{key} must be one of {', '.join(allowed)}; got {value!r}")

    return check


def _is_bool(key: str) -> Validator:
    def check(_instance: object, _attribute: attrs.Attribute, value: object) -> None:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")

    return check


def _pin_mode(_instance: object, _attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, bool) and value != "auto":
        raise ConfigError(f'runtime.pin_host_threads must be true, false or "auto", got {value!r}')


def _slots_value(_instance: object, _attribute: attrs.Attribute, value: object) -> None:
    if value == AUTO_SLOTS:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SLOTS:
        raise ConfigError(f'runtime.slots must be an integer from 1 to {MAX_SLOTS} or "auto", got {value!r}')


#: The largest CPU number ``runtime.cpus`` may name (Linux builds for at most 8192 CPUs): a
#: range is checked against it before it is expanded, so "0-99999999" is refused at once.
MAX_CPU = 8191


def _cpu_list(value: object) -> tuple[int, ...]:
    """``runtime.cpus``: a list of CPU numbers, or a string of them and ranges ("4-7,12")."""
    if isinstance(value, str):
        cpus: list[int] = []
        for part in filter(None, (p.strip() for p in value.split(","))):
            low, sep, high = part.partition("-")
            try:
                first, last = int(low), int(high if sep else low)
            except ValueError:
                raise ConfigError(f"runtime.cpus must list CPU numbers or ranges like \"4-7,12\", got {value!r}") from None
            if not 0 <= first <= MAX_CPU or not 0 <= last <= MAX_CPU:
                raise ConfigError(f"runtime.cpus: CPU numbers go from 0 to {MAX_CPU}, got {_clipped(part)!r}")
            cpus.extend(range(first, last + 1))
        return tuple(cpus)
    if isinstance(value, list | tuple) and all(isinstance(c, int) and not isinstance(c, bool) for c in value):
        return tuple(value)
    raise ConfigError(f"runtime.cpus must be a list of CPU numbers or a string like \"4-7,12\", got {_clipped(value)!r}")


def _clipped(value: object, limit: int = 100) -> object:
    """A value as an error message shows it: a long one cut short."""
    text = repr(value)
    return value if len(text) <= limit else text[:limit] + "..."


def _cpus_valid(_instance: object, _attribute: attrs.Attribute, value: tuple[int, ...]) -> None:
    if any(not 0 <= cpu <= MAX_CPU for cpu in value) or len(set(value)) != len(value):
        shown = list(value) if len(value) <= 32 else f"{list(value[:32])} and {len(value) - 32} more"
        raise ConfigError(f"runtime.cpus must be distinct CPU numbers from 0 to {MAX_CPU}, got {shown}")


@attrs.frozen(kw_only=True)
class AudioConfig:
    """The model's audio clock: every session is cut into frames of this size at this rate."""

    sample_rate: int = attrs.field(default=24000, validator=_int_range("audio.sample_rate", 8000, 192000))
    frame_size: int = attrs.field(default=1920, validator=_int_range("audio.frame_size", 1, 192000))
    #: Audio one client message may carry.  A larger one is refused with an ``audio_too_long``
    #: error, checked from its size before decoding (PCM, G.711, realtime base64), or as soon as
    #: decoding passes it (Opus): one client cannot make the server decode minutes of audio at once.
    max_message_seconds: float = attrs.field(
        default=10.0, validator=_float_range("audio.max_message_seconds", 0.01, 3600.0))

    @property
    def frame_seconds(self) -> float:
        return self.frame_size / self.sample_rate


@attrs.frozen(kw_only=True)
class RuntimeConfig:
    """How sessions, queues and the scheduler thread are sized."""

    #: Sessions served at once: the backend's batch rows.  The default (128) suits the echo and
    #: synthetic backends, whose rows cost next to nothing; a GPU model's rows each hold gigabytes
    #: of state, so its presets say ``"auto"``: the moshi backend then chooses at load the largest
    #: count that fits the device's memory and whose measured step keeps ``capacity_margin``.
    slots: int | str = attrs.field(default=128, validator=_slots_value)
    #: Frames a session may have waiting for the scheduler before a submit has to wait.
    inbox_depth: int = attrs.field(default=8, validator=_int_range("runtime.inbox_depth", 1, 1024))
    #: Frames of output a session may hold before its writer has sent them.
    outbox_depth: int = attrs.field(default=8, validator=_int_range("runtime.outbox_depth", 1, 1024))
    #: Once one frame waits, how long the scheduler waits for the other active slots to be ready.
    #: Not after a step that cost more than this: what queued during it is stepped at once.
    gather_window_ms: float = attrs.field(
        default=2.0, validator=_float_range("runtime.gather_window_ms", 0.0, 1000.0)
    )
    #: ``counted``: only encoded formats and full inboxes use worker threads.  ``always``: every
    #: conversion and submit hops through a worker thread (the reference behaviour, for comparison).
    offload: str = attrs.field(default="counted", validator=_one_of("runtime.offload", OFFLOAD_POLICIES))
    #: Pin the trio thread and the scheduler thread to one CPU.  Both run Python under the GIL,
    #: so they never run Python at once anyway; on separate cores every GIL handoff crosses
    #: cores, which costs more CPU per frame and wakes the threads more often (benchmarks/core.py
    #: measures both ways).  ``"auto"``: only on CPUs given to this process, never on a set it
    #: shares with the rest of the box; ``true``: always (``core/affinity.py``).
    pin_host_threads: bool | str = attrs.field(default="auto", validator=_pin_mode)
    #: The CPUs this process runs on (empty: chosen, see ``core/affinity.py``): the process keeps
    #: to them, and its two host threads share the first.  Give each replica on a box its own
    #: (one replica per GPU: the CPUs near that GPU, ``nvidia-smi topo -m``).  Every one must be
    #: among those the process may use (``sched_getaffinity``).
    cpus: tuple[int, ...] = attrs.field(default=(), converter=_cpu_list, validator=_cpus_valid)
    #: A session that reaches this much input ends with finish reason ``length`` (0: no limit
    #: beyond the model's own context).
    max_session_seconds: float = attrs.field(
        default=0.0, validator=_float_range("runtime.max_session_seconds", 0.0, 7 * 24 * 3600.0))
    #: After this many failed model steps in a row, ``/readyz`` answers 503 (``model_failing``)
    #: until a step works again.
    max_consecutive_step_failures: int = attrs.field(
        default=3, validator=_int_range("runtime.max_consecutive_step_failures", 1, 1_000_000))
    #: Admission by cost: the share of a frame period kept free when working out how many
    #: sessions the model can step in one (steps also pay gathering, copies and delivery, and
    #: their time varies).  New sessions past that number are refused with ``at_capacity``.
    capacity_margin: float = attrs.field(
        default=0.05, validator=_float_range("runtime.capacity_margin", 0.0, 0.9))
    #: Pin the number of sessions admitted instead of estimating it from step costs (0: estimate).
    #: ``runtime.slots`` stays the hard cap.
    max_sessions: int = attrs.field(default=0, validator=_int_range("runtime.max_sessions", 0, 4096))
    #: A session whose input falls behind the wall clock: ``wait`` for it (the model's clock for
    #: that conversation stops: exact for echo and synthetic checks), or ``fill`` each frame more
    #: than ``fill_after_ms`` overdue with silence, so the model keeps listening and talking; input
    #: that then arrives for time already filled is dropped.
    late_input: str = attrs.field(default="wait", validator=_one_of("runtime.late_input", LATE_INPUT_POLICIES))
    #: With ``late_input = "fill"``: how overdue a frame is (past the end of its audio) before it
    #: is filled.  Longer than the audio one client message carries, or on-time messages get filled.
    fill_after_ms: float = attrs.field(
        default=240.0, validator=_float_range("runtime.fill_after_ms", 0.0, 60_000.0))
    #: A client message of several frames gets its answer as one message: the output of its
    #: first frames waits (on the server) for that of its last, which is already queued and comes
    #: a step or two later.  Half the messages, syscalls and translator calls per frame for a
    #: client that sends 160 ms; the first frame of each message is that much later.  Off: each
    #: step's output goes out as soon as it is made.
    coalesce_output: bool = attrs.field(default=True, validator=_is_bool("runtime.coalesce_output"))
    #: Resume after a dropped connection: how long a session whose connection dropped without
    #: a clean end keeps its slot, waiting for its client to reconnect with the session's resume
    #: token (0: no resume, a drop ends the session).  Input waits per ``late_input`` meanwhile.
    resume_window_s: float = attrs.field(
        default=10.0, validator=_float_range("runtime.resume_window_s", 0.0, 3600.0))
    #: Seconds of output (by when it was sent) kept for a resume: what the client may have missed
    #: when the connection dropped, plus all that is made while it is away.  A session whose
    #: missed output no longer fits cannot be resumed.  Longer than ``resume_window_s``.
    resume_journal_s: float = attrs.field(
        default=15.0, validator=_float_range("runtime.resume_journal_s", 0.1, 3600.0))

    def __attrs_post_init__(self) -> None:
        if 0 < self.resume_journal_s < self.resume_window_s:
            raise ConfigError(
                f"runtime.resume_journal_s ({self.resume_journal_s:g}) must be at least runtime.resume_window_s "
                f"({self.resume_window_s:g}): a client away for the whole window could not resume, its missed "
                "output gone from the journal")


@attrs.frozen(kw_only=True)
class MetricsConfig:
    """What the runtime measures beyond usage, which is always exact."""

    #: Per-frame stage timing (received, decoded, submitted, stepped, delivered, sent) into
    #: fixed-size histograms.  Off, sessions still report exact usage and finish reasons.
    collect_stage_metrics: bool = attrs.field(default=True, validator=_is_bool("metrics.collect_stage_metrics"))
    #: A periodic one-line summary in the log (``duplexrt serve``); needs the stage metrics.
    log_stats: bool = attrs.field(default=True, validator=_is_bool("metrics.log_stats"))
    log_stats_interval_s: float = attrs.field(
        default=10.0, validator=_float_range("metrics.log_stats_interval_s", 0.1, 86400.0))


def _is_string(key: str, *, may_be_empty: bool = False) -> Validator:
    def check(_instance: object, _attribute: attrs.Attribute, value: object) -> None:
        if not isinstance(value, str) or not (value or may_be_empty):
            raise ConfigError(f"{key} must be a {'' if may_be_empty else 'non-empty '}string, got {value!r}")

    return check


def _stripped(value: object) -> object:
    return value.strip() if isinstance(value, str) else value


def _stripped_secret(key: str, value: object) -> object:
    """A key (``server.api_key``, ``server.admin_key``) without surrounding whitespace; one of
    whitespace only is refused, not read as "no key" (which an operator who wrote a key never meant)."""
    if isinstance(value, str) and value and not value.strip():
        raise ConfigError(f"{key} is only whitespace: give the key, or leave it empty for no key")
    return _stripped(value)


def _stripped_key(value: object) -> object:
    return _stripped_secret("server.api_key", value)


def _stripped_admin_key(value: object) -> object:
    return _stripped_secret("server.admin_key", value)


def _is_replica_id(key: str) -> Validator:
    # It lands in log lines, a Prometheus label and balancer configs: a plain name only.
    def check(_instance: object, _attribute: attrs.Attribute, value: object) -> None:
        if not isinstance(value, str) or not _REPLICA_ID.fullmatch(value):
            raise ConfigError(f"{key} must be empty or up to 128 of A-Z a-z 0-9 . _ : -, got {value!r}")

    return check


_REPLICA_ID = re.compile(r"[A-Za-z0-9._:-]{0,128}")


def _is_api_key(key: str) -> Validator:
    def check(_instance: object, _attribute: attrs.Attribute, value: object) -> None:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {type(value).__name__}")
        # The key itself is never echoed: it is a secret.
        if not all(33 <= ord(c) <= 126 for c in value):
            raise ConfigError(f"{key} must be printable ASCII without spaces or control characters "
                              "(surrounding whitespace is removed); a client could never send this key "
                              "in an Authorization header")

    return check


def _origins(value: object) -> tuple[str, ...]:
    """``server.allowed_origins``: a list of ``scheme://host[:port]`` (a page's origin, as its
    browser sends it), ``"null"`` or ``"*"``."""
    if not isinstance(value, list | tuple) or not all(isinstance(item, str) for item in value):
        raise ConfigError(f"server.allowed_origins must be a list of origins, got {value!r}")
    for item in value:
        if item.strip() not in ("*", "null") and not _ORIGIN.fullmatch(item.strip()):
            raise ConfigError(f"server.allowed_origins: {item!r} is not an origin: write it as the browser "
                              'sends it, scheme://host[:port] with no path ("https://app.example.com"), '
                              'or "*" for any page')
    return tuple(item.strip() for item in value)


_ORIGIN = re.compile(r"(?i)(https?|wss?)://[^/\s?#@]+/?")

#: Loopback, IPv4 and IPv6: the default of ``server.drain_from``.
LOOPBACK_NETWORKS = ("127.0.0.0/8", "::1/128")
#: Loopback and the private ranges (RFC 1918, IPv6 unique local): the default of
#: ``server.unlimited_peers``.  Balancers, a cluster's own Pods and benchmarks on the host come
#: from these; a client reaching a server exposed to the internet does not.
PRIVATE_NETWORKS = (*LOOPBACK_NETWORKS, "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")


def _networks(key: str, value: object) -> tuple[str, ...]:
    """A list of IP networks (``"10.0.0.0/8"``, ``"::1/128"``) or single addresses, checked and
    written in their normal form (``"10.1.2.3"`` becomes ``"10.1.2.3/32"``)."""
    if not isinstance(value, list | tuple) or not all(isinstance(item, str) for item in value):
        raise ConfigError(f"{key} must be a list of IP networks like \"10.0.0.0/8\", got {value!r}")
    found = []
    for item in value:
        try:
            found.append(str(ipaddress.ip_network(item.strip(), strict=False)))
        except ValueError:
            raise ConfigError(f"{key}: {item!r} is not an IP network or address "
                              '(write "10.0.0.0/8", "192.0.2.7" or "::1/128")') from None
    return tuple(found)


def _drain_from(value: object) -> tuple[str, ...]:
    return _networks("server.drain_from", value)


def _trusted_proxies(value: object) -> tuple[str, ...]:
    return _networks("server.trusted_proxies", value)


def _unlimited_peers(value: object) -> tuple[str, ...]:
    return _networks("server.unlimited_peers", value)


def _as_table(value: object) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"backend.options must be a table of option = value, got {value!r}")
    return dict(value)


@attrs.frozen(kw_only=True)
class BackendConfig:
    """Which model serves the sessions, and its own options (checked by the backend itself)."""

    name: str = attrs.field(default="echo", validator=_is_string("backend.name"))
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=_as_table)


@attrs.frozen(kw_only=True)
class ServerConfig:
    """``duplexrt serve``: where it listens and how it treats connections."""

    host: str = attrs.field(default="127.0.0.1", validator=_is_string("server.host"))
    port: int = attrs.field(default=8000, validator=_int_range("server.port", 0, 65535))
    #: Empty: no key needed.  Otherwise clients send it as a Bearer token or ``?api_key=``.
    #: Surrounding whitespace is removed (a secret read from a file ends in a newline).
    api_key: str = attrs.field(default="", converter=_stripped_key, validator=_is_api_key("server.api_key"))
    #: With no api_key: the web pages (origins) that may open sessions besides the server's own
    #: and loopback ones; "*": any.  A browser's upgrade from any other is refused (403).
    allowed_origins: tuple[str, ...] = attrs.field(default=(), converter=_origins)
    #: Largest WebSocket message on /v1/duplex and /api/chat (1 MiB: 5 s of f32 audio).
    max_message_bytes: int = attrs.field(
        default=1 << 20, validator=_int_range("server.max_message_bytes", 1024, 1 << 30))
    #: Largest message on /v1/realtime, where audio travels as base64 inside JSON.  2 MiB holds
    #: ten seconds of 24 kHz pcm16 (``audio.max_message_seconds``) three times over; a larger
    #: message costs its JSON parse on the trio thread, in proportion to its size, before it can
    #: be refused, and trio-websocket may queue four of them per connection.
    realtime_max_message_bytes: int = attrs.field(
        default=2 << 20, validator=_int_range("server.realtime_max_message_bytes", 1024, 1 << 30))
    #: A client must finish its HTTP request head within this time.
    handshake_timeout_s: float = attrs.field(
        default=10.0, validator=_float_range("server.handshake_timeout_s", 0.1, 3600))
    #: ... and send its first message within this time once the WebSocket is open.
    first_message_timeout_s: float = attrs.field(
        default=10.0, validator=_float_range("server.first_message_timeout_s", 0.1, 3600))
    #: The drain (SIGINT/SIGTERM, POST /drain): how long the calls under way may go on before
    #: they are told ``shutdown``.  Five minutes: longer than a Moshi call can last (its context).
    shutdown_grace_s: float = attrs.field(
        default=300.0, validator=_float_range("server.shutdown_grace_s", 0.0, 3600))
    #: A closing connection's last messages and closing handshake get this long; a peer that
    #: has not answered Close by then is dropped.
    close_timeout_s: float = attrs.field(
        default=3.0, validator=_float_range("server.close_timeout_s", 0.01, 600))
    #: A WebSocket ping this often (0: none) ...
    ping_interval_s: float = attrs.field(
        default=20.0, validator=_float_range("server.ping_interval_s", 0.0, 3600))
    #: ... and a peer whose pong has not come this long after a ping is dropped (0: never).
    ping_timeout_s: float = attrs.field(
        default=20.0, validator=_float_range("server.ping_timeout_s", 0.0, 3600))
    #: A session whose client sends nothing for this long ends with reason ``idle_timeout`` (0: never).
    idle_timeout_s: float = attrs.field(
        default=120.0, validator=_float_range("server.idle_timeout_s", 0.0, 7 * 24 * 3600.0))
    #: Connections still sending their request head; above this, new ones get HTTP 503 at once
    #: (a plain GET whose head is already there is still answered, so /metrics works).
    max_pending_handshakes: int = attrs.field(
        default=256, validator=_int_range("server.max_pending_handshakes", 1, 65536))
    #: This replica's name behind a load balancer, shown in /readyz, /metrics and the log.
    #: Empty: the host name and the bound port (``gpu-node-3:8000``).
    replica_id: str = attrs.field(default="", converter=_stripped, validator=_is_replica_id("server.replica_id"))
    #: ``POST /drain`` stops the replica: it is not for whoever may use the model.  It is served
    #: to a peer in these networks (loopback: a Kubernetes preStop hook, an operator on the host),
    #: with the API key when there is one, and to any peer that sends ``server.admin_key``.
    drain_from: tuple[str, ...] = attrs.field(default=LOOPBACK_NETWORKS, converter=_drain_from)
    #: A second key, for ``POST /drain`` from anywhere (empty: none); not for sessions.
    admin_key: str = attrs.field(default="", converter=_stripped_admin_key, validator=_is_api_key("server.admin_key"))
    #: Balancers whose ``X-Forwarded-For`` is believed: a connection from one of them counts as
    #: the client it names (the per-peer cap, who may drain).  Empty: none, the header is ignored.
    trusted_proxies: tuple[str, ...] = attrs.field(default=(), converter=_trusted_proxies)
    #: Connections one client address may hold open at once (sessions, request heads being
    #: read, plain HTTP); more are refused with 429 (0: no cap).  Behind a balancer, list it in
    #: ``trusted_proxies`` for each client to be capped (a balancer on a public address would
    #: otherwise be capped itself: list it in ``unlimited_peers`` at least).
    max_connections_per_peer: int = attrs.field(
        default=16, validator=_int_range("server.max_connections_per_peer", 0, 1_000_000))
    #: Peers the per-peer cap leaves alone: by default loopback and the private ranges, where
    #: balancers, a cluster's Pods and benchmarks come from (a balancer carries many clients).
    unlimited_peers: tuple[str, ...] = attrs.field(
        default=PRIVATE_NETWORKS, converter=_unlimited_peers)
    #: TLS on the one port (https://, wss://): a PEM certificate (chain) file and its unencrypted
    #: PEM key file, uvicorn's names.  Both or neither; checked before the model loads.
    ssl_certfile: str = attrs.field(default="", converter=_stripped, validator=_is_string("server.ssl_certfile", may_be_empty=True))
    ssl_keyfile: str = attrs.field(default="", converter=_stripped, validator=_is_string("server.ssl_keyfile", may_be_empty=True))

    def __attrs_post_init__(self) -> None:
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            given, missing = (("ssl_certfile", "ssl_keyfile") if self.ssl_certfile else ("ssl_keyfile", "ssl_certfile"))
            raise ConfigError(f"server.{given} is set but server.{missing} is not: TLS needs both the "
                              f"certificate and its key (--ssl-certfile, --ssl-keyfile)")
        if self.admin_key and self.admin_key == self.api_key:
            raise ConfigError("server.admin_key must differ from server.api_key: draining the server is "
                              "not for every client that may use the model")

@attrs.frozen(kw_only=True)
class RealtimeConfig:
    """/v1/realtime in duplex mode: the model's continuous output is cut into one response per
    burst of speech, at its pauses, as voice-agent frameworks expect."""

    #: A batch of output quieter than this (mean power, dBFS) is a pause.
    duplex_gate_dbfs: float = attrs.field(
        default=-50.0, validator=_float_range("realtime.duplex_gate_dbfs", -120.0, 0.0))
    #: A pause this long ends the response; shorter ones stay inside it.
    duplex_hangover_ms: float = attrs.field(
        default=480.0, validator=_float_range("realtime.duplex_hangover_ms", 1.0, 60000.0))
    #: false: one open-ended response for the whole session (no cutting).
    duplex_split_responses: bool = attrs.field(
        default=True, validator=_is_bool("realtime.duplex_split_responses"))
    #: What a session starts with before any session.update: OpenAI's own default is server VAD,
    #: and clients that never set turn_detection (pipecat) rely on it.  "none": the client commits.
    turn_detection: str = attrs.field(
        default="server_vad", validator=_one_of("realtime.turn_detection", ("server_vad", "none")))


def _optional_delay(_instance: object, _attribute: attrs.Attribute, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 10.0:
        raise ConfigError(f"transcriber.delay_seconds must be a number from 0 to 10, got {value!r}")


@attrs.frozen(kw_only=True)
class TranscriberConfig:
    """``[transcriber]``: what the caller says, written by a Kyutai speech-to-text model stepped in
    the scheduler thread next to the dialogue model (``duplexrt.transcribe``).  Off by default."""

    enabled: bool = attrs.field(default=False, validator=_is_bool("transcriber.enabled"))
    #: The seeded random ``stt-tiny`` model (tests, CPU demos), instead of a checkpoint.
    tiny: bool = attrs.field(default=False, validator=_is_bool("transcriber.tiny"))
    seed: int = attrs.field(default=0, validator=_int_range("transcriber.seed", 0, 2**31 - 1))
    #: A directory in Kyutai's layout (config.json with an stt_config) or a Hugging Face repository
    #: id in the local cache (``kyutai/stt-1b-en_fr``).
    checkpoint: str = attrs.field(default="", validator=_is_string("transcriber.checkpoint", may_be_empty=True))
    #: ``"cpu"`` or a torch device (``"cuda"``, ``"cuda:1"``).
    device: str = attrs.field(default="cpu", validator=_is_string("transcriber.device"))
    #: ``"auto"`` (bfloat16 on a GPU, float32 on a CPU), ``"float32"``, ``"bfloat16"``, ``"float16"``.
    dtype: str = attrs.field(default="auto", validator=_one_of(
        "transcriber.dtype", ("auto", "float32", "bfloat16", "float16")))
    #: How far the text lags the audio, in seconds; None: the checkpoint's own
    #: ``stt_config.audio_delay_seconds``.  Only for a model trained on another shift.
    delay_seconds: float | None = attrs.field(default=None, validator=_optional_delay)

    def __attrs_post_init__(self) -> None:
        if self.enabled and not self.tiny and not self.checkpoint:
            raise ConfigError("transcriber.enabled needs a model: transcriber.checkpoint (a directory or "
                              "kyutai/stt-1b-en_fr) or transcriber.tiny = true")
        if self.tiny and self.checkpoint:
            raise ConfigError("transcriber.tiny and transcriber.checkpoint both name a model: give one")


TRANSCRIPT_SINKS = ("none", "jsonl")


@attrs.frozen(kw_only=True)
class TranscriptsConfig:
    """``[transcripts]``: each call's transcript (the caller's words and the model's, with their
    times) kept after the call to be fetched by id (``GET /v1/transcripts/{id}``) and/or appended
    to a JSON Lines file per day (``duplexrt.transcripts``).  Kept for ``keep_seconds`` by
    default; ``keep_seconds``, ``max_calls`` or ``max_bytes`` 0 turns the keeping off."""

    #: How long an ended call's transcript can be fetched; 0: not kept.
    keep_seconds: float = attrs.field(default=600.0, validator=_float_range("transcripts.keep_seconds", 0, 604800))
    #: The most ended calls kept at once (the oldest go first); 0: none kept.
    max_calls: int = attrs.field(default=1000, validator=_int_range("transcripts.max_calls", 0, 1_000_000))
    #: The most bytes of JSON kept at once (the oldest go first); 0: none kept.
    max_bytes: int = attrs.field(default=64_000_000, validator=_int_range("transcripts.max_bytes", 0, 2**40))
    #: One call's text, both sides together, in characters; past it the rest is dropped and the
    #: transcript says ``"truncated": true``.
    max_chars_per_call: int = attrs.field(
        default=20_000, validator=_int_range("transcripts.max_chars_per_call", 64, 1_000_000))
    #: ``"jsonl"``: append each ended call's transcript to ``directory``; ``"none"``: no file.
    sink: str = attrs.field(default="none", validator=_one_of("transcripts.sink", TRANSCRIPT_SINKS))
    #: Where ``sink = "jsonl"`` writes ``transcripts-YYYY-MM-DD.jsonl`` (created 0700 if missing).
    directory: str = attrs.field(default="", validator=_is_string("transcripts.directory", may_be_empty=True))

    @property
    def kept(self) -> bool:
        """Ended calls are kept to be fetched."""
        return self.keep_seconds > 0 and self.max_calls > 0 and self.max_bytes > 0

    @property
    def recorded(self) -> bool:
        """Sessions record their transcript at all (kept, written, or both)."""
        return self.kept or self.sink != "none"

    def __attrs_post_init__(self) -> None:
        if self.sink == "jsonl" and not self.directory.strip():
            raise ConfigError('transcripts.sink = "jsonl" needs transcripts.directory: where the '
                              "transcripts-YYYY-MM-DD.jsonl files go")


@attrs.frozen(kw_only=True)
class Config:
    audio: AudioConfig = attrs.field(factory=AudioConfig)
    runtime: RuntimeConfig = attrs.field(factory=RuntimeConfig)
    backend: BackendConfig = attrs.field(factory=BackendConfig)
    server: ServerConfig = attrs.field(factory=ServerConfig)
    metrics: MetricsConfig = attrs.field(factory=MetricsConfig)
    realtime: RealtimeConfig = attrs.field(factory=RealtimeConfig)
    transcriber: TranscriberConfig = attrs.field(factory=TranscriberConfig)
    transcripts: TranscriptsConfig = attrs.field(factory=TranscriptsConfig)

    def __attrs_post_init__(self) -> None:
        audio = self.audio
        if self.transcriber.enabled and (audio.sample_rate, audio.frame_size) != (24000, 1920):
            # Kyutai's STT models read Mimi's frames, the very frames the scheduler steps.
            raise ConfigError(f"transcriber.enabled reads the model's frames as Mimi does: audio.sample_rate = "
                              f"24000 and audio.frame_size = 1920, got {audio.sample_rate} and {audio.frame_size}")
        if self.metrics.log_stats and not self.metrics.collect_stage_metrics:
            raise ConfigError(
                "metrics.log_stats (--log-stats) needs metrics.collect_stage_metrics "
                "(--collect-stage-metrics): turn log_stats off too (--no-log-stats), or keep collecting"
            )

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self, recurse=True)


_SECTIONS: dict[str, type] = {
    "audio": AudioConfig, "runtime": RuntimeConfig, "backend": BackendConfig, "server": ServerConfig,
    "metrics": MetricsConfig, "realtime": RealtimeConfig, "transcriber": TranscriberConfig,
    "transcripts": TranscriptsConfig,
}


def _build(data: Mapping[str, Any], origin: str) -> Config:
    unknown = set(data) - set(_SECTIONS)
    if unknown:
        raise ConfigError(
            f"{origin}: unknown section(s) {', '.join(sorted(unknown))}; "
            f"allowed: {', '.join(_SECTIONS)}"
        )
    sections: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        values = data.get(name, {})
        if not isinstance(values, Mapping):
            raise ConfigError(f"{origin}: [{name}] must be a table, got {values!r}")
        fields = {f.name for f in attrs.fields(cls)}
        extra = set(values) - fields
        if extra:
            raise ConfigError(
                f"{origin}: unknown key(s) {', '.join(f'{name}.{k}' for k in sorted(extra))}; "
                f"allowed in [{name}]: {', '.join(sorted(fields))}"
            )
        try:
            sections[name] = cls(**values)
        except ConfigError as exc:
            raise ConfigError(f"{origin}: {exc}") from None
    try:
        return Config(**sections)
    except ConfigError as exc:
        raise ConfigError(f"{origin}: {exc}") from None


def _parse_value(text: str) -> Any:
    """An override's value as TOML would read it, falling back to a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` strings (``backend.options.step_ms=20`` reaches one level deeper)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        parts = key.split(".")
        if len(parts) < 2:
            raise ConfigError(f"override key {key!r} must name a section and a key, like runtime.slots")
        target = data
        for part in parts[:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"override key {key!r} goes inside a value that is not a table")
        target[parts[-1]] = _parse_value(raw.strip())
    return data


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """Read ``path`` (or the defaults), apply overrides, validate everything."""
    data: dict[str, Any] = {}
    origin = "defaults"
    if path is not None:
        path = Path(path)
        origin = str(path)
        try:
            with path.open("rb") as handle:  # TOML is UTF-8 whatever the locale says
                data = tomllib.load(handle)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except OSError as exc:
            raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: not valid TOML: the file is not UTF-8 text") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    overrides = list(overrides)
    if overrides:
        apply_overrides(data, overrides)
        origin += " with overrides"
    return _build(data, origin)
