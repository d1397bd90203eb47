"""The core runtime's benchmark (issue: core runtime targets).

Runs, in one process and one sitting so that ratios compare like with like on a noisy machine:

1. burst, 96 sessions x 512 frames, pcm_f32le, synthetic backend at zero cost: the default offload
   policy and ``--offload always`` (the reference behaviour) alternated ``--pairs`` times;
2. paced, 96 sessions, synthetic ``step_ms=20``: late frames and step-finished -> sent delay;
3. burst host CPU per frame at 16, 96 and 512 sessions (flatness);
4. burst 96 sessions: stage metrics collected against not collected, alternated ``--pairs`` times;
5. burst 96 sessions: host threads pinned to one CPU (the default) against not pinned.

Usage: python benchmarks/core.py [--pairs 3] [--frames 512] [--paced-frames 250] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys

import trio

from duplexrt.config import load_config
from duplexrt.simulate.runner import SimulateOptions, run_simulation


def _run(overrides: list[str], **options) -> dict:
    config = load_config(None, ['backend.name="synthetic"', *overrides])
    report = trio.run(run_simulation, config, SimulateOptions(**options))
    round_ = report.rounds[-1]
    if not round_.ok:
        raise SystemExit(f"guards failed: {round_.failures[:3]}")
    return round_.as_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--frames", type=int, default=512)
    parser.add_argument("--paced-frames", type=int, default=250)
    parser.add_argument("--scale-frames", type=int, default=128)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results: dict = {"machine": f"{platform.machine()} {platform.processor() or ''} Python {platform.python_version()}"}

    print(f"1. burst 96 x {args.frames}, pcm_f32le, synthetic zero cost: counted vs always, {args.pairs} pairs",
          file=sys.stderr)
    pairs = []
    for i in range(args.pairs):
        counted = _run(["runtime.slots=96"], concurrency=96, frames=args.frames, warmup_frames=8)
        always = _run(["runtime.slots=96", 'runtime.offload="always"'], concurrency=96, frames=args.frames,
                      warmup_frames=8)
        pairs.append({"counted": counted, "always": always,
                      "elapsed_ratio": always["elapsed_s"] / counted["elapsed_s"],
                      "cpu_ratio": always["cpu_us_per_frame"] / counted["cpu_us_per_frame"]})
        print(f"   pair {i + 1}: counted {counted['elapsed_s']:.2f}s {counted['cpu_us_per_frame']:.1f}us/frame "
              f"vcs/frame {counted['voluntary_switches_per_frame']:.3f} offloads "
              f"{sum(v for k, v in counted['handoffs'].items() if k.endswith('offload'))}; "
              f"always {always['elapsed_s']:.2f}s {always['cpu_us_per_frame']:.1f}us/frame; "
              f"elapsed ratio {pairs[-1]['elapsed_ratio']:.2f}", file=sys.stderr)
    results["burst"] = pairs

    print(f"2. paced 96 sessions x {args.paced_frames} frames, step_ms=20", file=sys.stderr)
    paced = _run(["runtime.slots=96", "backend.options.step_ms=20"], concurrency=96, frames=args.paced_frames,
                 mode="paced")
    results["paced"] = paced
    print(f"   late frames {paced['late_frames']}, step->delivered p50/p99/max "
          f"{paced['delivery_ms']['p50']:.3f}/{paced['delivery_ms']['p99']:.3f}/{paced['delivery_ms']['max']:.3f} ms, "
          f"frame lag p99 {paced['frame_lag_ms']['p99']:.1f} ms, cpu {paced['cpu_us_per_frame']:.1f}us/frame",
          file=sys.stderr)

    print(f"3. burst CPU per frame by sessions ({args.scale_frames} frames each)", file=sys.stderr)
    scale = {}
    for sessions in (16, 96, 512):
        runs = [_run([f"runtime.slots={sessions}"], concurrency=sessions, frames=args.scale_frames, warmup_frames=4)
                for _ in range(2)]
        scale[sessions] = {"cpu_us_per_frame": [r["cpu_us_per_frame"] for r in runs],
                           "mean_batch": [r["mean_batch"] for r in runs]}
        print(f"   {sessions:4d} sessions: {', '.join(f'{r:.1f}' for r in scale[sessions]['cpu_us_per_frame'])} us/frame",
              file=sys.stderr)
    results["scale"] = scale

    print(f"4. burst 96 x {args.frames}: stage metrics on vs off, {args.pairs} pairs", file=sys.stderr)
    collect_pairs = []
    for i in range(args.pairs):
        on = _run(["runtime.slots=96"], concurrency=96, frames=args.frames, warmup_frames=8)
        off = _run(["runtime.slots=96", "metrics.collect_stage_metrics=false", "metrics.log_stats=false"],
                   concurrency=96, frames=args.frames, warmup_frames=8)
        collect_pairs.append({"on": on["cpu_us_per_frame"], "off": off["cpu_us_per_frame"],
                              "ratio": on["cpu_us_per_frame"] / off["cpu_us_per_frame"]})
        print(f"   pair {i + 1}: on {on['cpu_us_per_frame']:.1f} us/frame, off {off['cpu_us_per_frame']:.1f}, "
              f"ratio {collect_pairs[-1]['ratio']:.3f}", file=sys.stderr)
    results["collect"] = collect_pairs

    print(f"5. burst 96 x {args.frames}: host threads pinned vs not, {args.pairs} pairs", file=sys.stderr)
    pin_pairs = []
    for i in range(args.pairs):
        pinned = _run(["runtime.slots=96", "runtime.pin_host_threads=true"], concurrency=96, frames=args.frames,
                      warmup_frames=8)
        loose = _run(["runtime.slots=96", "runtime.pin_host_threads=false"], concurrency=96, frames=args.frames,
                     warmup_frames=8)
        pin_pairs.append({"pinned": pinned["cpu_us_per_frame"], "unpinned": loose["cpu_us_per_frame"],
                          "pinned_vcs": pinned["voluntary_switches_per_frame"],
                          "unpinned_vcs": loose["voluntary_switches_per_frame"],
                          "cpu_ratio": loose["cpu_us_per_frame"] / pinned["cpu_us_per_frame"],
                          "elapsed_ratio": loose["elapsed_s"] / pinned["elapsed_s"]})
        print(f"   pair {i + 1}: pinned {pinned['cpu_us_per_frame']:.1f} us/frame "
              f"({pinned['voluntary_switches_per_frame']:.3f} vcs), not pinned {loose['cpu_us_per_frame']:.1f} "
              f"({loose['voluntary_switches_per_frame']:.3f} vcs), elapsed ratio {pin_pairs[-1]['elapsed_ratio']:.2f}",
              file=sys.stderr)
    results["pinning"] = pin_pairs

    summary = {
        "burst_cpu_us_per_frame_median": statistics.median(p["counted"]["cpu_us_per_frame"] for p in pairs),
        "burst_voluntary_switches_per_frame_median": statistics.median(
            p["counted"]["voluntary_switches_per_frame"] for p in pairs),
        "burst_offloads_total": sum(v for p in pairs for k, v in p["counted"]["handoffs"].items() if k.endswith("offload")),
        "always_over_counted_elapsed_median": statistics.median(p["elapsed_ratio"] for p in pairs),
        "paced_late_frames": paced["late_frames"],
        "paced_step_to_sent_p99_ms": paced["delivery_ms"]["p99"],
        "scale_cpu_us_per_frame_median": {k: statistics.median(v["cpu_us_per_frame"]) for k, v in scale.items()},
        "collect_on_over_off_cpu_median": statistics.median(p["ratio"] for p in collect_pairs),
        "unpinned_over_pinned_cpu_median": statistics.median(p["cpu_ratio"] for p in pin_pairs),
    }
    results["summary"] = summary
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
