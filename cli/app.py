"""The ``duplexrt`` command line."""

from __future__ import annotations

import enum
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import trio
import typer

from duplexrt import __version__, presets
from duplexrt.audio import AudioFormat, AudioFormatError
from duplexrt.config import ConfigError, load_config
from duplexrt.core.scheduler import BackendLoadError
from duplexrt.routes import client_paths, routes_help

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from duplexrt.config import Config
    from duplexrt.simulate.find_capacity import CapacitySearch, Verdict
    from duplexrt.simulate.options import SimulateOptions
    from duplexrt.simulate.report import SimulationReport

log = logging.getLogger("duplexrt.cli")

app = typer.Typer(
    name="duplexrt",
    help="Serve full-duplex speech models (Moshi, Hibiki and kin) to many real-time sessions per GPU.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help: no `<bool>` beside every flag, and text in brackets (`duplexrt[plot]`) is not
    # taken for markup and dropped.
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"duplexrt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Serve full-duplex speech models (Moshi, Hibiki and kin) to many real-time sessions per GPU."""


configs_app = typer.Typer(no_args_is_help=False, add_completion=False, rich_markup_mode=None)
app.add_typer(configs_app, name="configs", short_help="List the model presets, or show one (configs show NAME).")


@configs_app.callback(invoke_without_command=True)
def configs(ctx: typer.Context) -> None:
    """List the model presets shipped with duplexrt, one line each.

    Pass a name to --config (`duplexrt serve --config moshi-tiny`).  To start a config of your
    own from one: `duplexrt configs show default > my.toml`, then `--config my.toml`."""
    if ctx.invoked_subcommand is not None:
        return
    try:
        found = presets.names()
        width = max(map(len, found), default=0)
        for name in found:
            typer.echo(f"{name:<{width}}  {presets.summary(name)}")
    except ConfigError as exc:
        raise _fail(str(exc)) from None


@configs_app.command("show")
def configs_show(name: Annotated[str, typer.Argument(help="A preset's name, as `duplexrt configs` lists it.")]) -> None:
    """Print a preset's TOML (the installed files are not for editing in place: copy one instead)."""
    try:
        typer.echo(presets.read_text(name.removesuffix(".toml")), nl=False)
    except ConfigError as exc:
        raise _fail(str(exc)) from None


class Mode(str, enum.Enum):
    burst = "burst"
    paced = "paced"


class Offload(str, enum.Enum):
    counted = "counted"
    always = "always"


class LogLevel(str, enum.Enum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


ConfigOption = Annotated[
    Optional[str],
    typer.Option("--config", "-c", metavar="NAME|FILE",
                 help="A preset's name (moshi-tiny, moshiko, hibiki...: `duplexrt configs` lists them) or "
                      "a TOML file; defaults apply without one.",
                 envvar="DUPLEXRT_CONFIG"),
]
SetOption = Annotated[
    Optional[list[str]],
    typer.Option("--set", metavar="KEY=VALUE",
                 help="Override any config key: --set runtime.inbox_depth=8 (repeatable)."),
]
BackendOption = Annotated[
    Optional[str], typer.Option("--backend", "-b", metavar="NAME",
                                help="Model backend: echo (default), synthetic or moshi.",
                                envvar="DUPLEXRT_BACKEND")
]
BackendOptionOption = Annotated[
    Optional[list[str]],
    typer.Option("--backend-option", "-o", metavar="KEY=VALUE",
                 help="A backend option KEY=VALUE, e.g. -o step_ms=20 -o slot_us=50 (repeatable)."),
]
SlotsOption = Annotated[Optional[str], typer.Option("--slots", metavar="N|auto", help="Sessions served at once (batch rows): a "
                                                                   "number, or auto (the moshi backend: the "
                                                                   "most that fit the GPU's memory and keep "
                                                                   "real time, measured at load).",
                                                    envvar="DUPLEXRT_SLOTS")]
CollectOption = Annotated[
    Optional[bool],
    typer.Option("--collect-stage-metrics/--no-collect-stage-metrics", metavar="",
                 help="Per-frame stage timing (metrics.collect_stage_metrics). Usage and finish reasons "
                      "are exact either way."),
]
LogStatsOption = Annotated[
    Optional[bool],
    typer.Option("--log-stats/--no-log-stats", metavar="",
                 help="A periodic one-line summary in the log (metrics.log_stats); needs stage metrics."),
]
OffloadOption = Annotated[
    Optional[Offload],
    typer.Option("--offload", help="counted: worker threads only for encoded formats and full inboxes; "
                                   "always: a thread hop for every conversion and submit (the reference "
                                   "behaviour, for comparison)."),
]


def _overrides(backend: str | None, backend_options: list[str] | None, slots: str | None,
               offload: Offload | None, extra: list[str] | None) -> list[str]:
    overrides: list[str] = []
    if backend is not None:
        overrides.append(f"backend.name={_quoted(backend)}")
    for item in backend_options or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--backend-option {item!r} must look like KEY=VALUE")
        overrides.append(f"backend.options.{key.strip()}={value.strip()}")
    if slots is not None:
        overrides.append(f"runtime.slots={slots.strip()}")
    if offload is not None:
        overrides.append(f"runtime.offload={_quoted(offload.value)}")
    overrides.extend(extra or [])
    return overrides


def _metrics_overrides(collect: bool | None, log_stats: bool | None) -> list[str]:
    overrides = []
    if collect is not None:
        overrides.append(f"metrics.collect_stage_metrics={str(collect).lower()}")
    if log_stats is not None:
        overrides.append(f"metrics.log_stats={str(log_stats).lower()}")
    return overrides


def _quoted(text: str) -> str:
    """``text`` as a TOML string for an override; JSON's escapes are TOML's (a newline too)."""
    return json.dumps(text)


def _sent_key(given: str | None) -> str | None:
    """The key ``client`` and ``simulate --url`` send: as ``serve`` reads it, without the
    surrounding whitespace a secret keeps (a newline in a header would end the request head)."""
    key = given.strip() if given is not None else ""
    return key or None


def _server_key(given: str) -> str:
    """The key ``serve`` requires, from --api-key or DUPLEXRT_API_KEY.  A secret read from a file
    or a Kubernetes ``secretKeyRef`` ends in a newline nobody typed: surrounding whitespace is
    removed, and the log says so.  An empty key is refused: an operator who gave one meant a key,
    and it would silently mean no authentication at all."""
    key = given.strip()
    if not key:
        raise ConfigError("--api-key (or DUPLEXRT_API_KEY) is empty: give the key clients must send, "
                          "or leave both out to serve without a key")
    if key != given:
        log.info("--api-key/DUPLEXRT_API_KEY: %d surrounding whitespace characters removed (a secret "
                 "file or a Kubernetes secret ends in a newline); clients send the key without them",
                 len(given) - len(key))
    return key


def _fail(message: str) -> typer.Exit:
    typer.echo(f"duplexrt: error: {message}", err=True)
    return typer.Exit(2)


def simulate(
    concurrency: Annotated[int, typer.Option(help="Virtual sessions at once.")] = 96,
    frames: Annotated[int, typer.Option(help="Model frames (80 ms each by default) per session.")] = 512,
    message_ms: Annotated[float, typer.Option(help="Audio per client message, in ms (160 = two frames).")] = 160.0,
    mode: Annotated[Mode, typer.Option(help="burst: send as fast as the runtime takes it; "
                                            "paced: send in real time, as a live caller does.")] = Mode.burst,
    format: Annotated[Optional[str], typer.Option("--format", metavar="FORMAT", help="Wire format both ways: pcm_f32le, pcm_s16le, "
                                                                   "g711_ulaw, g711_alaw or opus (default "
                                                                   "pcm_f32le; with --url, the route's: "
                                                                   "pcm_s16le on /v1/realtime and "
                                                                   "/v1/live/sessions, opus on "
                                                                   "/api/chat).")] = None,
    sample_rate: Annotated[Optional[int], typer.Option(help="Wire sample rate (default: the model's; "
                                                            "8000 for G.711).")] = None,
    warmup_frames: Annotated[int, typer.Option(help="Frames per session in an unmeasured warm-up round.")] = 0,
    repeat: Annotated[int, typer.Option(help="Measured rounds, each reported.")] = 1,
    late_ms: Annotated[float, typer.Option(help="Paced mode: a frame whose output comes back later than "
                                                "this after its input was sent is late.")] = 80.0,
    json_path: Annotated[Optional[Path], typer.Option("--json", metavar="FILE",
                                                      help="Also write the report as JSON here.")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", metavar="FILE.png", help="Also draw each round's per-frame lag over "
                                                               "time and its histogram into this PNG "
                                                               "(needs matplotlib: duplexrt[plot]).")] = None,
    progress: Annotated[Optional[bool], typer.Option("--progress/--no-progress", metavar="",
                                                     help="Progress bar (default: when stderr is a terminal).")] = None,
    url: Annotated[Optional[str], typer.Option(
        metavar="URL",
        help=f"Load a running server instead: ws://HOST:PORT/ROUTE ({client_paths()}). "
             "Each virtual session is a real WebSocket; server-side figures come from its /metrics, and "
             "--backend/-o describe the server's backend for the guards (default: the backend its "
             "/readyz names, with its default options).")] = None,
    api_key: Annotated[Optional[str], typer.Option(metavar="KEY", help="With --url: the server's API key (sent as "
                                                        "'Authorization: Bearer KEY').",
                                                   envvar="DUPLEXRT_API_KEY")] = None,
    drop_rate: Annotated[float, typer.Option(
        help="With --url: the share of sessions (0-1) whose connection is cut once mid-stream, without "
             "a Close frame; each resumes on its own (docs/resume.md) and the guards check that no "
             "frame was lost or heard twice.")] = 0.0,
    find_capacity: Annotated[bool, typer.Option(
        "--find-capacity", metavar="",
        help="Bisect paced concurrency (up to the slots: --slots, or the server's) for the most sessions "
             "that hold the real-time criterion (docs/capacity.md) over at least 30 s of audio; print it "
             "with its lag percentiles and the runtime's own admission estimate.")] = False,
    probe_seconds: Annotated[float, typer.Option(
        help="--find-capacity: paced audio per probe, in seconds.  The criterion asks for 30; shorter "
             "probes are for smoke tests, and the result says so.")] = 30.0,
    require_real_time: Annotated[bool, typer.Option(
        "--require-real-time", metavar="",
        help="Paced mode: also fail (exit status 1) when a measured round misses the real-time "
             "criterion (docs/capacity.md: real-time factor at most 1.0, 99.9 % of frames within a "
             "frame period + the step time + 10 ms), not only when a guard fails.  Without it a paced "
             "round's verdict line (holds / FAILS) is printed for information and the exit status "
             "follows the guards alone.")] = False,
    probe_retries: Annotated[int, typer.Option(
        help="--find-capacity: probe a count that fails on time again, up to this many times; it holds if "
             "any try does (other processes on the host can only make a probe fail).")] = 1,
    collect_stage_metrics: CollectOption = None,
    log_stats_flag: LogStatsOption = None,
    config: ConfigOption = None,
    backend: BackendOption = None,
    backend_option: BackendOptionOption = None,
    slots: SlotsOption = None,
    offload: OffloadOption = None,
    set_: SetOption = None,
) -> None:
    """Drive virtual sessions through the real session pipeline, in process, and report what the
    host paid per frame: CPU, context switches, thread handoffs, latency.  Every session's output
    is checked (complete, in order, expected content); a failed check exits with status 1.

    With --url, the same load goes over real WebSockets to a running server, and connection
    errors (refused, HTTP 503 when its slots are full, closed early) are counted and fail the
    guards."""
    from duplexrt.client.connection import ConnectError
    from duplexrt.simulate.report import format_table
    from duplexrt.simulate.runner import SimulateOptions, default_format, run_simulation

    try:
        if url is not None and (slots is not None or offload is not None):
            raise ConfigError("--slots and --offload configure the in-process runtime; with --url the "
                              "server's own settings apply")
        config_file = presets.resolve(config)
        overrides = _overrides(backend, backend_option, slots, offload, set_)
        # In process, the summary line is off unless asked for: the report says it all.
        overrides += _metrics_overrides(collect_stage_metrics, False if log_stats_flag is None else log_stats_flag)
        cfg = load_config(config_file, overrides)
        fixed_slots = cfg.runtime.slots if isinstance(cfg.runtime.slots, int) else None  # None: "auto"
        if url is None and slots is None and fixed_slots is not None and concurrency > fixed_slots:
            cfg = load_config(config_file, [*overrides, f"runtime.slots={concurrency}"])
            fixed_slots = concurrency
        if find_capacity and url is None and fixed_slots is not None:
            concurrency = min(concurrency, fixed_slots)  # the search's ceiling is the slots
        wire_format = format or (default_format(url) if url is not None else AudioFormat.PCM_F32LE.value)
        paced = mode is Mode.paced
        if require_real_time and not paced and not find_capacity:
            raise ConfigError("--require-real-time judges paced rounds: add --mode paced")
        # Paced rounds keep each frame's lag: the real-time verdict reads them.
        options = SimulateOptions(concurrency=concurrency, frames=frames, message_ms=message_ms,
                                  mode=mode.value, format=AudioFormat.parse(wire_format).value,
                                  sample_rate=sample_rate, warmup_frames=warmup_frames, repeat=repeat,
                                  late_ms=late_ms, keep_samples=plot is not None or paced, drop_rate=drop_rate)
        options.check(cfg, slots=url is None)
        if drop_rate and url is None:
            raise ConfigError("--drop-rate cuts real connections: it needs --url")
        if plot is not None:  # before the run, not after it: a missing extra fails at once
            from duplexrt.simulate.plot import PlotUnavailable, require_matplotlib

            try:
                require_matplotlib()
            except PlotUnavailable as exc:
                raise ConfigError(str(exc)) from None
    except (ConfigError, AudioFormatError) as exc:
        raise _fail(str(exc)) from None
    show = sys.stderr.isatty() if progress is None else progress
    api_key = _sent_key(api_key)
    if find_capacity:
        _find_capacity(cfg, options, url, api_key, show, backend is None, json_path, plot, probe_seconds,
                       probe_retries)
        return
    if url is None:
        def run():
            return run_simulation(cfg, options, progress=show)
    else:
        from duplexrt.simulate.runner import run_url_simulation

        def run():
            return run_url_simulation(cfg, options, url, api_key=api_key, progress=show,
                                      adopt_server_backend=backend is None)
    try:
        report = trio.run(run)
    except (ConfigError, AudioFormatError, BackendLoadError) as exc:
        raise _fail(str(exc)) from None
    except ConnectError as exc:  # the server could not be reached at all
        typer.echo(f"duplexrt: error: {exc.message}", err=True)
        raise typer.Exit(1) from None
    typer.echo(format_table(report))
    missed = _real_time_verdicts(report, cfg.audio.frame_seconds, require_real_time)
    if json_path is not None:
        json_path.write_text(report.to_json())
    if plot is not None:
        from duplexrt.simulate.plot import PlotUnavailable, plot_report

        try:
            typer.echo(f"plot written to {plot_report(report, plot, late_ms=late_ms)}", err=True)
        except PlotUnavailable as exc:
            raise _fail(str(exc)) from None
    failures = [f for r in report.rounds for f in r.failures]
    for failure in failures[:20]:
        typer.echo(f"guard failed: {failure}", err=True)
    if len(failures) > 20:
        typer.echo(f"... and {len(failures) - 20} more guard failures", err=True)
    if failures or (require_real_time and missed):
        raise typer.Exit(1)


def _real_time_verdicts(report: SimulationReport, frame_seconds: float, require: bool = False) -> int:
    """Print the real-time criterion's verdict for each paced round; return how many missed it."""
    from duplexrt.simulate.find_capacity import describe_verdict, judge

    missed = 0
    for i, round_ in enumerate(report.rounds, 1):
        if round_.mode != "paced":
            continue
        verdict = judge(round_, frame_seconds * 1e3)
        missed += not verdict.holds
        note = "" if verdict.holds or require else " [exit status unaffected: add --require-real-time]"
        typer.echo(f"round {i}: {describe_verdict(verdict, round_.elapsed_s)}{note}")
    return missed


def _find_capacity(cfg: Config, options: SimulateOptions, url: str | None, api_key: str | None, show: bool, adopt: bool,
                   json_path: Path | None, plot: Path | None, probe_seconds: float = 30.0,
                   retries: int = 1) -> None:
    """``simulate --find-capacity``: the bisection, its probes as they finish, then the result."""
    import json

    from duplexrt.client.connection import ConnectError
    from duplexrt.simulate.find_capacity import format_search
    from duplexrt.simulate.runner import run_find_capacity, run_url_find_capacity

    def told(verdict: Verdict) -> None:
        typer.echo(f"{verdict.sessions} sessions: {'holds' if verdict.holds else 'fails'}"
                   + (f" ({verdict.reason})" if verdict.reason else ""), err=True)

    if url is None:
        def run() -> Awaitable[CapacitySearch]:
            return run_find_capacity(cfg, options, progress=show, on_probe=told, min_seconds=probe_seconds,
                                     retries=retries)
    else:
        def run() -> Awaitable[CapacitySearch]:
            return run_url_find_capacity(cfg, options, url, api_key=api_key, progress=show,
                                         adopt_server_backend=adopt, on_probe=told, min_seconds=probe_seconds,
                                         retries=retries)
    try:
        search = trio.run(run)
    except (ConfigError, AudioFormatError, BackendLoadError) as exc:
        raise _fail(str(exc)) from None
    except ConnectError as exc:
        typer.echo(f"duplexrt: error: {exc.message}", err=True)
        raise typer.Exit(1) from None
    typer.echo(format_search(search))
    if probe_seconds < 30:
        typer.echo(f"note: probes of {probe_seconds:g} s, shorter than the criterion's 30 s: a smoke test, "
                   "not a capacity figure")
    if json_path is not None:
        json_path.write_text(json.dumps(search.as_dict(), indent=2))
    if plot is not None:
        from duplexrt.simulate.plot import PlotUnavailable, plot_search

        try:
            typer.echo(f"plot written to {plot_search(search, plot)}", err=True)
        except PlotUnavailable as exc:
            raise _fail(str(exc)) from None
    if search.sessions == 0:
        raise typer.Exit(1)


class ClientProtocolName(str, enum.Enum):
    duplex = "duplex"
    realtime = "realtime"
    moshi = "moshi"
    live = "live"


def client(
    input_path: Annotated[Path, typer.Argument(metavar="IN.wav", help="Audio file to send (WAV, or anything "
                                                                      "sphn reads); mixed to mono.")],
    url: Annotated[str, typer.Option(metavar="URL", help="ws://HOST:PORT/ROUTE: /v1/duplex (PCM f32 at the file's rate; "
                                          "?format=&rate= to choose), /v1/realtime (pcm16 24 kHz; "
                                          "?duplex=1 for one continuous response), /api/chat (Opus) or "
                                          "/v1/live/sessions (OpenAI Live, pcm16 24 kHz).")],
    out: Annotated[Path, typer.Option("--out", "-O", metavar="OUT.wav", help="Where to write what comes back (WAV).")],
    realtime: Annotated[bool, typer.Option("--realtime", metavar="", help="Send in real time, one 80 ms message every "
                                                              "80 ms, as a live caller does (default: as "
                                                              "fast as the server takes it).")] = False,
    api_key: Annotated[Optional[str], typer.Option(metavar="KEY", help="The server's API key (sent as 'Authorization: "
                                                        "Bearer KEY').", envvar="DUPLEXRT_API_KEY")] = None,
    protocol: Annotated[Optional[ClientProtocolName], typer.Option(
        metavar="duplex|realtime|moshi|live", help="Speak this protocol whatever the URL's path (for a server behind a proxy).")] = None,
    idle_timeout: Annotated[float, typer.Option(metavar="SECONDS", help="Once the input is sent, give up after this many "
                                                     "seconds without a message.")] = 10.0,
    progress: Annotated[Optional[bool], typer.Option("--progress/--no-progress", metavar="",
                                                     help="Progress bar (default: when stderr is a terminal).")] = None,
) -> None:
    """Stream an audio file to a running server and write what comes back to a WAV file.

    Prints one line: seconds sent (what the server says its model took, from its end event's
    input frames where the route reports them; else what was written) and received, and how the
    session ended.  A dropped connection is resumed for up to 10 s, saying so on stderr.  Exit status 0 when
    the session ended normally, 1 when the connection failed, the server refused it (HTTP 503:
    no free slot), sent an error or closed abnormally, 2 for bad arguments."""
    from duplexrt.client.stream import ClientRequest, run_client

    if not idle_timeout > 0:
        raise _fail(f"--idle-timeout must be positive, got {idle_timeout}")
    request = ClientRequest(input_path=input_path, url=url, output_path=out, realtime=realtime,
                            api_key=_sent_key(api_key), protocol=protocol.value if protocol else None,
                            idle_timeout=idle_timeout)
    show = sys.stderr.isatty() if progress is None else progress
    code = trio.run(lambda: run_client(request, progress=show))
    if code:
        raise typer.Exit(code)


_SERVE_HELP = f"""Serve the model over WebSocket on one port:

\b
{routes_help()}
  GET /healthz, /readyz, /metrics (Prometheus)

SIGINT or SIGTERM (or POST /drain with the key, from a preStop hook) begins a drain:
/readyz answers 503 "draining", new sessions are refused, and the calls under way go on until
they end or server.shutdown_grace_s (300 s) passes; then they are told "shutdown" and cut.  A
second signal stops at once."""


def serve(
    host: Annotated[Optional[str], typer.Option(metavar="HOST", help="Address to listen on (default 127.0.0.1).",
                                                envvar="DUPLEXRT_HOST")] = None,
    port: Annotated[Optional[int], typer.Option(metavar="PORT", help="Port to listen on (default 8000; 0 picks a free one).",
                                                envvar="DUPLEXRT_PORT")] = None,
    api_key: Annotated[Optional[str], typer.Option(metavar="KEY", help="Require this key from clients, as "
                                                        "'Authorization: Bearer KEY' or ?api_key=KEY.",
                                                   envvar="DUPLEXRT_API_KEY")] = None,
    ssl_certfile: Annotated[Optional[str], typer.Option(metavar="FILE", help="Serve https:// and wss:// on the "
                                                        "port with this PEM certificate (chain) file "
                                                        "(uvicorn's name; with --ssl-keyfile).",
                                                        envvar="DUPLEXRT_SSL_CERTFILE")] = None,
    ssl_keyfile: Annotated[Optional[str], typer.Option(metavar="FILE", help="The certificate's PEM key file "
                                                       "(unencrypted).", envvar="DUPLEXRT_SSL_KEYFILE")] = None,
    log_level: Annotated[LogLevel, typer.Option(help="What the log shows: debug, info (every session's "
                                                "start and end, the stats line, the drain), warning "
                                                "or error.", envvar="DUPLEXRT_LOG_LEVEL",
                                           case_sensitive=False)] = LogLevel.info,
    replica_id: Annotated[Optional[str], typer.Option(metavar="NAME", help="This replica's name behind a load balancer, in "
                                                           "/readyz, /metrics and the log (default: host "
                                                           "name:port).", envvar="DUPLEXRT_REPLICA_ID")] = None,
    collect_stage_metrics: CollectOption = None,
    log_stats_flag: LogStatsOption = None,
    config: ConfigOption = None,
    backend: BackendOption = None,
    backend_option: BackendOptionOption = None,
    slots: SlotsOption = None,
    offload: OffloadOption = None,
    set_: SetOption = None,
) -> None:
    from duplexrt.server import serve as run_server

    root = logging.getLogger()
    level_before = root.level
    root.setLevel(log_level.value.upper())
    try:
        overrides = _overrides(backend, backend_option, slots, offload, set_)
        overrides += _metrics_overrides(collect_stage_metrics, log_stats_flag)
        if host is not None:
            overrides.append(f"server.host={_quoted(host)}")
        if port is not None:
            overrides.append(f"server.port={port}")
        if api_key is not None:
            overrides.append(f"server.api_key={_quoted(_server_key(api_key))}")
        if replica_id is not None:
            overrides.append(f"server.replica_id={_quoted(replica_id)}")
        if ssl_certfile is not None:
            overrides.append(f"server.ssl_certfile={_quoted(ssl_certfile)}")
        if ssl_keyfile is not None:
            overrides.append(f"server.ssl_keyfile={_quoted(ssl_keyfile)}")
        cfg = load_config(presets.resolve(config), overrides)
        trio.run(run_server, cfg)
    except (ConfigError, BackendLoadError) as exc:
        raise _fail(str(exc)) from None
    except OSError as exc:
        raise _fail(f"cannot listen: {exc}") from None
    finally:
        root.setLevel(level_before)  # run in process (a test's CliRunner), the level goes back


# Registered here, in the order `duplexrt --help` lists them: serving first.
app.command(help=_SERVE_HELP, short_help="Serve a model to many real-time sessions over WebSocket.")(serve)
app.command(short_help="Load the runtime (or a running server) with virtual sessions and report the cost.")(
    simulate)
app.command(short_help="Stream an audio file to a running server; write what comes back.")(client)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()
