"""benchmarks/timed_serve.py: ``duplexrt serve`` with thread-CPU timers around named functions,
driven by the real load generator; at exit each timed function has its line, with every call
counted, and the server served as it does untimed.  ``--against`` is run on this same checkout:
what it proves is that another checkout's code can be imported in place of the installed one."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[1]
TIMED_SERVE = CHECKOUT / "benchmarks" / "timed_serve.py"
DUPLEXRT = Path(sys.executable).parent / "duplexrt"


@pytest.mark.parametrize("against", [[], ["--against", str(CHECKOUT)]], ids=["installed", "against a checkout"])
def test_every_call_of_a_timed_function_is_counted_and_the_server_serves_as_ever(tmp_path, against):
    server = subprocess.Popen(
        [sys.executable, str(TIMED_SERVE), "--time", "duplexrt.wsframes:FrameParser.next",
         "--time", "duplexrt.core.session:Session.delivery_done", *against,
         "--", "--port", "0", "--no-log-stats", "--log-level", "info"],
        stderr=subprocess.PIPE, text=True)
    try:
        for line in server.stderr:
            if "port(s)" in line:
                port = int(line.split("port(s) ")[1].split()[0])
                break
        else:
            raise AssertionError("the server did not start")
        out = tmp_path / "simulate.json"
        run = subprocess.run(
            [str(DUPLEXRT), "simulate", "--url", f"ws://127.0.0.1:{port}/v1/duplex", "--mode", "paced",
             "--concurrency", "2", "--frames", "4", "--no-progress", "--json", str(out)],
            capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        report = json.loads(out.read_text())
    finally:
        server.send_signal(signal.SIGINT)
        log = server.communicate(timeout=60)[1]
    assert server.returncode == 0, log
    table = log[log.index("function"):].splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in table[1:] if line.strip()}
    assert set(rows) == {"FrameParser.next", "Session.delivery_done"}
    # Two sessions of 4 frames in 160 ms messages: at least their 4 audio messages were parsed
    # (the parser is also asked once more after each, and for the close), and every one of the
    # 8 frames answered went through a delivery.
    assert int(rows["FrameParser.next"][0]) >= 4
    assert int(rows["Session.delivery_done"][0]) >= 2
    assert all(float(value) > 0 for value in rows["FrameParser.next"][1:])
    [round_] = report["rounds"]
    assert report["ok"] and round_["frames_in"] == round_["frames_out"] == 8  # every echo checked
