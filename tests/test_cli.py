"""The command line: help that explains, a real run, and start-up errors that name the key."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from duplexrt_cli.app import app

runner = CliRunner()


def _commands(output: str) -> list[tuple[str, str]]:
    """The command list of a --help: (name, summary) per command, in order."""
    listing = output.split("Commands:\n", 1)[1]
    rows: list[tuple[str, str]] = []
    for line in listing.splitlines():
        if line.startswith("  ") and not line.startswith("   ") and line.strip():
            name, _, summary = line.strip().partition(" ")
            rows.append((name, summary.strip()))
        elif line.strip() and rows:  # a summary's continuation line
            rows[-1] = (rows[-1][0], rows[-1][1] + " " + line.strip())
    return rows


def test_help_lists_the_commands_serve_first_each_with_a_whole_sentence():
    result = runner.invoke(app, ["--help"], terminal_width=80)
    assert result.exit_code == 0
    rows = _commands(result.output)
    assert [name for name, _ in rows] == ["serve", "simulate", "client", "configs"]
    for name, summary in rows:
        assert summary.endswith(".") and not summary.endswith("..."), (name, summary)
    assert dict(rows)["serve"] == "Serve a model to many real-time sessions over WebSocket."


@pytest.mark.parametrize("command", [[], ["serve"], ["simulate"], ["client"], ["configs"]])
def test_every_help_takes_h_and_shows_no_type_placeholders(command):
    short = runner.invoke(app, [*command, "-h"], terminal_width=100)
    assert short.exit_code == 0 and short.output == runner.invoke(app, [*command, "--help"], terminal_width=100).output
    for placeholder in ("<bool>", "<list[", "<str>"):
        assert placeholder not in short.output, (command, placeholder)


def test_simulate_help_keeps_the_extra_name_in_brackets():
    result = runner.invoke(app, ["simulate", "--help"], terminal_width=200)
    assert "duplexrt[plot]" in " ".join(result.output.split())


def test_a_log_level_that_does_not_exist_is_a_clear_error_not_a_traceback():
    result = runner.invoke(app, ["serve", "--log-level", "verbose"])
    assert result.exit_code == 2
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)
    assert "'verbose' is not one of 'debug', 'info', 'warning', 'error'" in result.output


def test_simulate_help_explains_the_options():
    result = runner.invoke(app, ["simulate", "--help"], terminal_width=200)
    assert result.exit_code == 0
    for option in ("--concurrency", "--frames", "--message-ms", "--mode", "--format", "--backend",
                   "--backend-option", "--warmup-frames", "--repeat", "--offload", "--json"):
        assert option in result.output


def test_invalid_config_value_stops_start_up_naming_the_key():
    result = runner.invoke(app, ["simulate", "--set", "runtime.inbox_depth=0"])
    assert result.exit_code == 2
    assert "runtime.inbox_depth" in result.output
    assert "1 to 1024" in result.output


def test_unknown_backend_option_is_refused():
    result = runner.invoke(app, ["simulate", "-b", "synthetic", "-o", "speed=3"])
    assert result.exit_code == 2
    assert "speed" in result.output


def test_simulate_runs_as_a_real_process_and_writes_json(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "duplexrt_cli.app", "simulate", "--concurrency", "3", "--frames", "5",
         "-b", "synthetic", "--json", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "host CPU per frame" in proc.stdout
    data = json.loads(out.read_text())
    assert data["ok"] is True
    assert data["rounds"][0]["frames_out"] == 15
    assert data["settings"]["config"]["backend"]["name"] == "synthetic"


def test_every_package_is_listed_for_the_wheel():
    """An editable install finds subpackages anyway; a wheel only ships what pyproject lists."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "duplexrt").rglob("__init__.py")}
    assert found <= listed, f"missing from pyproject packages: {sorted(found - listed)}"
    assert "duplexrt_cli" in listed


def test_simulate_plot_draws_a_png(tmp_path):
    out = tmp_path / "lag.png"
    result = runner.invoke(app, ["simulate", "--concurrency", "3", "--frames", "6", "-b", "synthetic",
                                 "--plot", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_a_paced_run_that_misses_real_time_says_so_and_can_fail_on_it():
    # A model step of 100 ms cannot keep up with 80 ms frames: every guard passes (all frames
    # back, in order), but the criterion does not.
    args = ["simulate", "-b", "synthetic", "-o", "step_ms=100", "--mode", "paced", "--concurrency", "2",
            "--frames", "12", "--no-progress"]
    lenient = runner.invoke(app, args)
    assert lenient.exit_code == 0, lenient.output
    [line] = [line for line in lenient.output.splitlines() if "real time (docs/capacity.md)" in line]
    assert line.startswith("round 1: real time (docs/capacity.md): FAILS: ") and "indicative only" in line
    strict = runner.invoke(app, [*args, "--require-real-time"])
    assert strict.exit_code == 1 and "FAILS" in strict.output


def test_a_paced_run_in_real_time_holds():
    result = runner.invoke(app, ["simulate", "-b", "synthetic", "-o", "step_ms=2", "--mode", "paced",
                                 "--concurrency", "2", "--frames", "12", "--no-progress", "--require-real-time"])
    assert result.exit_code == 0, result.output
    assert "round 1: real time (docs/capacity.md): holds (" in result.output


def test_require_real_time_needs_paced_rounds():
    result = runner.invoke(app, ["simulate", "--require-real-time", "--frames", "4"])
    assert result.exit_code == 2 and "--mode paced" in result.output


def test_plot_without_matplotlib_fails_before_the_run(tmp_path):
    # FAKE: a matplotlib that cannot be imported, first on the path (the real one is installed
    # here, as the test extra asks).
    (tmp_path / "matplotlib").mkdir()
    (tmp_path / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    done = subprocess.run([sys.executable, "-m", "duplexrt_cli.app", "simulate", "--frames", "100000",
                           "--concurrency", "64", "--plot", str(tmp_path / "x.png"), "--no-progress"],
                          capture_output=True, text=True, timeout=60,
                          env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 2
    assert "pip install 'duplexrt[plot]'" in done.stderr and "elapsed" not in done.stdout


def test_turning_stage_metrics_off_with_log_stats_on_is_refused_naming_both():
    result = runner.invoke(app, ["serve", "--no-collect-stage-metrics", "--port", "0"])
    assert result.exit_code == 2
    assert "--log-stats" in result.output and "--collect-stage-metrics" in result.output


def test_simulate_without_stage_metrics_still_reports_exact_frames(tmp_path):
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["simulate", "--concurrency", "2", "--frames", "5",
                                 "--no-collect-stage-metrics", "--json", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["ok"] and data["rounds"][0]["frames_out"] == 10
    assert data["settings"]["config"]["metrics"]["collect_stage_metrics"] is False
    assert data["rounds"][0]["latency_ms"]["count"] == 0


def test_serve_options_with_environment_variables_are_exactly_the_documented_ones():
    """README (Serving): which `serve` options can come from a DUPLEXRT_* variable, and which
    cannot.  Read from the command's own definition, so the list in the README stays true."""
    import typer.main

    command = typer.main.get_command(app).commands["serve"]
    variables = {param.opts[0]: param.envvar for param in command.params if param.envvar}
    assert variables == {
        "--host": "DUPLEXRT_HOST", "--port": "DUPLEXRT_PORT", "--api-key": "DUPLEXRT_API_KEY",
        "--replica-id": "DUPLEXRT_REPLICA_ID",
        "--ssl-certfile": "DUPLEXRT_SSL_CERTFILE", "--ssl-keyfile": "DUPLEXRT_SSL_KEYFILE",
        "--log-level": "DUPLEXRT_LOG_LEVEL", "--config": "DUPLEXRT_CONFIG", "--backend": "DUPLEXRT_BACKEND",
        "--slots": "DUPLEXRT_SLOTS",
    }
    without = {param.opts[0] for param in command.params if not param.envvar}
    assert without == {"--set", "--backend-option", "--offload", "--collect-stage-metrics", "--log-stats"}


@pytest.mark.parametrize("level", ["info", "debug"])
def test_a_model_that_fails_to_load_says_its_message_once_and_its_traceback_only_at_debug(
        level, monkeypatch, caplog):
    """Issue 40: a missing-weights error printed a 19-line traceback and its message twice."""
    from duplexrt.backends.echo import EchoBackend

    def load(self) -> None:
        raise FileNotFoundError("no weights at /models/missing.safetensors")

    monkeypatch.setattr(EchoBackend, "load", load)
    caplog.set_level(logging.DEBUG)
    result = runner.invoke(app, ["serve", "--port", "0", "--no-log-stats", "--log-level", level])
    assert result.exit_code == 2
    assert result.output.count("no weights at /models/missing.safetensors") == 1
    assert "Traceback" not in result.output
    said = [r for r in caplog.records if "missing.safetensors" in r.getMessage()
            or (r.exc_info and "missing.safetensors" in str(r.exc_info[1]))]
    loud = [r for r in said if r.levelno >= logging.INFO]
    assert not loud, [r.getMessage() for r in loud]
    traced = [r for r in caplog.records if r.exc_info and r.levelno == logging.DEBUG]
    assert len(traced) == (1 if level == "debug" else 0)
    assert all("failed to load" in r.getMessage() for r in traced)


@pytest.mark.parametrize("require", [False, True])
def test_a_paced_round_that_fails_real_time_says_whether_it_sets_the_exit_status(require):
    """A model slower than real time: the verdict is FAILS either way; it sets the exit status
    only with --require-real-time, and says so without it.  The two ratios are named apart."""
    args = ["simulate", "-b", "synthetic", "-o", "step_ms=90", "--mode", "paced", "--frames", "8",
            "--concurrency", "2"] + (["--require-real-time"] if require else [])
    result = runner.invoke(app, args, terminal_width=200)
    verdict = [line for line in result.output.splitlines() if line.startswith("round 1: real time")]
    assert len(verdict) == 1 and "FAILS" in verdict[0], result.output
    assert "stream real-time factor (criterion)" in result.output
    assert "send→last output / audio (incl. lag)" in result.output
    assert result.exit_code == (1 if require else 0)
    assert ("exit status unaffected: add --require-real-time" in verdict[0]) is not require
