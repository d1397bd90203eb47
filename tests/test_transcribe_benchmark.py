"""benchmarks/transcribe_tiny.py's pieces, as small as they go: a step timed, and the three host
runs (the transcriber on, on with its messages not sent, the sleeping stand-in) with their guards."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("moshi")

from conftest import load_benchmark  # noqa: E402


def test_the_transcriber_benchmark_times_a_step_and_the_three_host_runs():
    bench = load_benchmark("transcribe_tiny")
    assert bench.transcriber_step_ms(2, 2) > 0
    result = bench.host_cost(2, 8)
    assert set(result) == {"transcriber_on", "transcriber_on_no_messages", "hook_sleeping_same_step"}
    for name, run in result.items():
        assert run["offloads"] == 0, name
        assert 0 < run["output_deliveries"] <= run["steps"], name
        assert run["frames"] >= 16, name
    assert result["transcriber_on"]["pieces_per_frame"] > 0
    assert result["hook_sleeping_same_step"]["pieces_per_frame"] == 0
    # The stand-in was put back: a transcriber built now is the real one.
    from duplexrt.transcribe import transcriber

    assert transcriber.Transcriber.__name__ == "Transcriber"
