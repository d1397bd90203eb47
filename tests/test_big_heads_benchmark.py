"""benchmarks/big_heads.py end to end, as small as it goes: a real server process, one paced call
and one attacker sending heads of thousands of header fields, which the server refuses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "big_heads.py"


def test_big_heads_times_a_call_beside_an_attacker():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--heads", "many", "--rounds", "1", "--seconds", "1",
                           "--attackers", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    round_line = re.search(r"round 1 .*: victim echo ms p50 [\d.]+ p99 [\d.]+ max [\d.]+ \((\d+) frames\); "
                           r"heads sent (\d+)", proc.stdout)
    assert round_line, proc.stdout
    assert int(round_line[1]) == 12 and int(round_line[2]) > 0
    assert "all rounds" in proc.stdout and "later than one frame period" in proc.stdout
