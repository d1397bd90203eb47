"""benchmarks/core.py end to end, as small as it goes: each of its five steps runs the real
runtime in process (synthetic backend, the simulator's guards on every frame) and lands in its
JSON, and the two offload policies it compares do what the table in docs/benchmarks.md says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "benchmarks" / "core.py"


def test_core_benchmark_runs_every_step_and_compares_the_offload_policies(tmp_path):
    out = tmp_path / "core.json"
    proc = subprocess.run(
        [sys.executable, str(CORE), "--pairs", "1", "--frames", "8", "--paced-frames", "4",
         "--scale-frames", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())

    [pair] = result["burst"]
    counted, always = pair["counted"], pair["always"]
    for round_ in (counted, always):
        assert round_["frames_in"] == round_["frames_out"] == 96 * 8 and round_["failures"] == [], round_
    # The default policy keeps every frame on trio; "always" hops once per submitted frame.
    assert sum(v for k, v in counted["handoffs"].items() if k.endswith("offload")) == 0
    assert always["handoffs"]["submit_offload"] == always["frames_in"]
    assert always["handoffs"]["convert_offload"] > 0

    assert result["paced"]["frames_out"] == 96 * 4 and result["paced"]["mode"] == "paced"
    assert sorted(result["scale"], key=int) == ["16", "96", "512"]
    assert all(len(row["cpu_us_per_frame"]) == 2 for row in result["scale"].values())
    assert len(result["collect"]) == 1 and len(result["pinning"]) == 1
    assert result["summary"]["burst_offloads_total"] == 0
    assert json.loads(proc.stdout) == result["summary"]
