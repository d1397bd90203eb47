"""The browser side of ``duplexrt serve``: the talk page, the dashboard and ``/stats``.

The pages are plain files shipped in the package (``static/``): no build step, nothing fetched
from the internet.  Only the files found there when the module loads can be served, looked up by
name in a dict: a request path is never joined onto a directory, so no path can leave it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from duplexrt.config import Config
from duplexrt.server.statistics import ServerStatistics

STATIC_DIR = Path(__file__).parent / "static"

_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".png": "image/png",
    ".svg": "image/svg+xml",
}

#: Page routes: the paths a person types, and the file each one is.  /favicon.ico for clients
#: that ask for it without reading the pages' icon link.
PAGES = {"/": "index.html", "/dashboard": "dashboard.html", "/favicon.ico": "favicon.svg"}

#: Frame lag bucket edges for /stats, in ms: 0.25 ms to ~10 s, 25% apart.  The dashboard
#: subtracts two readings and takes percentiles of what happened in between, so no state is
#: kept per viewer here.
LAG_EDGES_MS = [round(0.25 * 1.25 ** i, 3) for i in range(48)]


def _shipped_files() -> dict[str, Path]:
    if not STATIC_DIR.is_dir():
        return {}
    return {path.name: path for path in STATIC_DIR.iterdir() if path.is_file() and path.suffix in _TYPES}


_FILES = _shipped_files()


def static_answer(path: str) -> tuple[int, bytes, str] | None:
    """The page or static file at ``path``, or None when the path is not one of ours."""
    name = PAGES.get(path)
    if name is None and path.startswith("/static/"):
        name = path[len("/static/"):]
        if name not in _FILES:
            return 404, f"no static file {name!r}\n".encode(), "text/plain; charset=utf-8"
    if name is None or name not in _FILES:
        return None
    file = _FILES[name]
    return 200, file.read_bytes(), _TYPES[file.suffix]


#: ``/readyz?full=ok``: the readiness a Kubernetes probe should ask (deploy/kubernetes).  A replica
#: that is merely full stays ready there: readiness also counts as availability for rolling updates
#: (``maxUnavailable``) and disruption budgets, and a full pod taken out of them stalls both.  A
#: full replica still refuses the session it cannot take (503 with Retry-After).
FULL_OK = ("full", "ok")


def readyz_answer(stats: ServerStatistics, query: dict[str, str]) -> tuple[int, bytes, str]:
    """``/readyz``: 200 when this replica takes new sessions, else 503 with the reason; with
    ``?full=ok``, 503 only when it serves nothing new whatever its load (not loaded, draining,
    failing)."""
    full = stats.full_reason
    reason = stats.not_serving_reason if query.get(FULL_OK[0]) == FULL_OK[1] else stats.not_ready_reason
    body = {"ready": reason is None, "reason": reason, "model_loaded": stats.runtime.ready,
            "draining": stats.draining, "full": full is not None, "backend": stats.runtime.backend,
            "slots": stats.runtime.slots, "free_slots": stats.free_slots,
            "sessions": stats.runtime.sessions_active,
            "consecutive_step_failures": stats.runtime.scheduler.consecutive_step_failures,
            "replica_id": stats.replica_id, "admitted": stats.admitted, "detached": stats.detached,
            "pending_handshakes": stats.pending_handshakes,
            "capacity": stats.runtime.capacity.as_dict(), "slot_choice": stats.runtime.slot_choice.as_dict(),
            # The persona a caller may set (voices, defaults, prompt cache); null: the model takes none.
            "persona": stats.runtime.persona}
    return (200 if reason is None else 503), json.dumps(body).encode(), "application/json"


def _transcriber(config: Config) -> dict[str, str] | None:
    """``/stats`` "transcriber": read from the config, since a server whose transcriber cannot
    load does not start (so an enabled one is a running one)."""
    transcriber = config.transcriber
    if not transcriber.enabled:
        return None
    return {"model": "stt-tiny" if transcriber.tiny else transcriber.checkpoint}


def stats_json(stats: ServerStatistics, config: Config) -> bytes:
    """What the dashboard draws, read from ``Server.statistics()`` (nothing per frame).

    Counters are cumulative; the page turns two readings into rates and interval percentiles."""
    runtime = stats.runtime
    steps = runtime.scheduler
    frames = runtime.frames
    lag = runtime.histograms.latency
    lag_counts = lag.cumulative([int(edge * 1e6) for edge in LAG_EDGES_MS])
    stages = {name: {"count": histogram.count, "total_ms": histogram.total / 1e6}
              for name, histogram in runtime.histograms.stages.items()}
    step_time = runtime.histograms.step_time
    body = {
        "time": time.monotonic(),
        "backend": runtime.backend,
        "sample_rate": config.audio.sample_rate,
        "frame_ms": config.audio.frame_seconds * 1e3,
        "api_key_required": bool(config.server.api_key),
        "ready": runtime.ready and not stats.draining,
        # Shutting down: no new sessions (the talk page says so).
        "draining": stats.draining,
        "slots": runtime.slots,
        # How the slot count came about: runtime.slots as given, or what "auto" chose and why.
        "slot_choice": runtime.slot_choice.as_dict(),
        # The persona a caller may set (voices, defaults, prompt cache); null: the model takes none.
        "persona": runtime.persona,
        # The caller's words are written down ([transcriber]): its model; null: no transcriber.
        # The talk page shows the caller's words beside the model's when it is there.
        "transcriber": _transcriber(config),
        # What admission lets in: the sessions the fitted step cost fits in a frame period (or
        # runtime.max_sessions), never above the slots.
        "capacity": runtime.capacity.limit,
        "admitted": stats.admitted,
        "free_slots": stats.free_slots,
        "sessions_active": frames.sessions_active,
        "sessions_opened": frames.sessions_opened,
        "steps": steps.steps,
        "frames": steps.frames,
        "max_batch": steps.max_batch,
        "failed_steps": steps.failed_steps,
        "queued_frames": steps.queued_frames,
        "step": {"count": step_time.count, "total_ms": step_time.total / 1e6,
                 "p50_ms": steps.step_time_us.p50 / 1e3, "p99_ms": steps.step_time_us.p99 / 1e3,
                 "max_ms": steps.step_time_us.max / 1e3},
        # How far each send strays from one frame period after the previous one (since start).
        "send_jitter_ms": {"p50": frames.jitter_us.p50 / 1e3, "p99": frames.jitter_us.p99 / 1e3,
                           "max": frames.jitter_us.max / 1e3},
        "stages": stages,
        "frames_in": frames.frames_in,
        "frames_out": frames.frames_out,
        "late_frames": frames.late_frames,
        "text_pieces": frames.text_pieces,
        "lag_ms": {"p50": frames.latency_us.p50 / 1e3, "p99": frames.latency_us.p99 / 1e3},
        "lag_histogram": {"edges_ms": LAG_EDGES_MS, "cumulative": lag_counts, "count": lag.count},
        "handoffs": dict(sorted(runtime.handoffs.by_kind.items())),
        "refused": stats.refused,
        # Where the output went from: the step delivery or the session's writer
        # (docs/architecture.md, "The hot path").
        "hot_path": {
            "direct_batches": frames.direct_batches,
            "writer_wakeups": frames.writer_wakeups,
            "scheduler_thread_cpu_s": steps.thread_cpu_seconds,
        },
    }
    return json.dumps(body).encode()
