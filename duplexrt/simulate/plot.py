"""``simulate --plot``: each round's frame lag over time and its distribution, as a PNG.

matplotlib is an optional extra (``duplexrt[plot]``): imported only here, only when asked.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from duplexrt.simulate.find_capacity import CapacitySearch
from duplexrt.simulate.report import SimulationReport


class PlotUnavailable(RuntimeError):
    pass


def require_matplotlib() -> None:
    """Raise PlotUnavailable unless matplotlib can be imported: checked before a run, so that a
    missing extra fails at once rather than after minutes of load."""
    _pyplot()


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'duplexrt[plot]'") from None
    return plt


def plot_report(report: SimulationReport, path: str | Path, *, late_ms: float) -> Path:
    """Write the plot; one row per measured round (left: lag over time, right: histogram)."""
    plt = _pyplot()
    rounds = [(r, r.lag_samples) for r in report.rounds if r.lag_samples is not None]
    if not rounds:
        raise PlotUnavailable("no per-frame samples were kept for this run")
    figure, axes = plt.subplots(len(rounds), 2, figsize=(12, 3.6 * len(rounds)), squeeze=False,
                                gridspec_kw={"width_ratios": [3, 1]})
    for row, (round_, samples) in zip(axes, rounds):
        times, lags = samples
        over_time, distribution = row
        over_time.scatter(times, lags, s=5, alpha=0.6, linewidths=0)
        over_time.axhline(late_ms, color="tab:red", linewidth=1, linestyle="--", label=f"late ({late_ms:g} ms)")
        over_time.set_xlabel("seconds into the round")
        over_time.set_ylabel("frame lag (ms)")
        over_time.set_title(f"{round_.sessions} sessions, {round_.mode}: each output frame's lag")
        over_time.legend(loc="upper right")
        if len(lags):
            p50, p99 = np.percentile(lags, [50, 99])
            distribution.hist(lags, bins=60, orientation="horizontal", color="tab:gray")
            for value, name, colour in ((p50, "p50", "tab:blue"), (p99, "p99", "tab:orange")):
                distribution.axhline(value, linewidth=1, color=colour, label=f"{name} {value:.1f} ms")
            distribution.legend(loc="upper right")
        distribution.set_xlabel("frames")
        distribution.set_ylim(over_time.get_ylim())
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_search(search: CapacitySearch, path: str | Path) -> Path:
    """``--find-capacity --plot``: frame lag percentiles by session count, each probe's deadline,
    and which held."""
    plt = _pyplot()
    probes = sorted((p for p in search.probes if p.lag_p50_ms is not None), key=lambda p: p.sessions)
    if not probes:
        raise PlotUnavailable("no probe measured any frame lag")
    figure, axis = plt.subplots(figsize=(9, 4.5))
    x = [p.sessions for p in probes]
    for attr, name in (("lag_p50_ms", "p50"), ("lag_p99_ms", "p99"), ("lag_p999_ms", "p99.9")):
        axis.plot(x, [getattr(p, attr) for p in probes], marker="o", label=f"frame lag {name}")
    axis.plot(x, [p.deadline_ms for p in probes], linestyle="--", color="tab:red", label="deadline")
    for p in probes:
        axis.annotate("ok" if p.holds else "late", (p.sessions, p.lag_p999_ms), textcoords="offset points",
                      xytext=(0, 6), ha="center", fontsize=8)
    if search.sessions:
        axis.axvline(search.sessions, color="black", linewidth=1, label=f"capacity {search.sessions}")
    axis.set_xlabel("paced sessions")
    # Lags span from a few ms to seconds once past capacity: a log axis keeps both readable.
    axis.set_yscale("log")
    axis.set_ylabel("ms (log scale)")
    axis.set_title("--find-capacity: frame lag by session count")
    axis.legend(loc="upper left")
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
