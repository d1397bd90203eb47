"""benchmarks/gpu.sh as a bare device machine runs it, on this CPU: the wheel folder prepared by
benchmarks/gpu_wheels.sh (from PyPI, for this machine's Python), installed with
``pip install --no-index --no-deps --target``, and the script run by a Python that has torch and
the device machine's common packages but neither duplexrt nor any of the wheel folder's packages
(the project's own environment with ``-S``, and only those packages on ``PYTHONPATH``).  Without
CUDA it runs every phase on the tiny model: what is checked is that it runs, not its figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

#: Downloads ~19 MB of wheels and runs every phase: about a minute (`pytest -m "not packaging"`
#: leaves it out while iterating; CI, `make test`, runs it).
pytestmark = pytest.mark.packaging

ROOT = Path(__file__).resolve().parent.parent
SITE = Path(next(p for p in sys.path if p.endswith("site-packages")))
TIMEOUT_S = 600


def _device_like(wheels: Path, dest: Path) -> Path:
    """This environment's packages less duplexrt and less every package the wheel folder brings:
    what a device machine has (its torch, numpy, attrs, typer, h11, huggingface-hub...)."""
    brought: set[str] = set()
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as archive:
            brought |= {name.split("/", 1)[0] for name in archive.namelist()}
    dest.mkdir()
    for entry in SITE.iterdir():
        name = entry.name
        if name in brought or "duplexrt" in name or name.startswith("__editable__") or name.endswith(".pth"):
            continue
        (dest / name).symlink_to(entry.resolve())
    return dest


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("gpu-bare")
    wheels = work / "wheels"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_wheels.sh"), str(wheels), version],
                          capture_output=True, text=True, timeout=TIMEOUT_S,
                          env={**os.environ, "PYTHON": sys.executable})
    if done.returncode and "Could not" in done.stderr and "connection" in done.stderr.lower():
        pytest.skip(f"PyPI cannot be reached from here: {done.stderr[-500:]}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    listed = [line.split("==")[0] for line in (ROOT / "benchmarks" / "gpu_wheels.txt").read_text().splitlines()
              if line and not line.startswith("#")]
    assert len(list(wheels.glob("*.whl"))) == len(listed)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DUPLEXRT_", "NO_TORCH_COMPILE"))}
    env.update(PYTHON=f"{sys.executable} -S", PYTHONPATH=str(_device_like(wheels, work / "device")))
    return {"work": work, "wheels": wheels, "env": env}


def test_the_script_runs_every_phase_in_the_bare_layout(bare):
    out = bare["work"] / "out"
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--wheels", str(bare["wheels"]), str(out)],
                          cwd=bare["work"], env=bare["env"], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    phases = json.loads((out / "gpu.json").read_text())["phases"]
    assert phases["device"]["cuda"] is False and "torch" in phases["device"]
    assert phases["build"]["bytes_per_slot"]["total"] > 0 and phases["build"]["fit_memory"] >= 4
    rows = phases["steps"]["rows"]
    assert [r["rows"] for r in rows] == [1, 2, 4]
    for row in rows:
        assert set(row["stage_ms"]) == {"encode", "lm", "decode"} and row["step_ms"]["p50"] > 0
        assert 0 < row["thread_cpu_ms_per_step"] and "within_budget" in row
        exact = row["exact"]
        assert isinstance(exact["row_0_as_largest_batch"], bool) and isinstance(exact["last_row_as_row_0"], bool)
        assert exact["row_0_as_largest_batch"] == (exact["max_abs_diff"] == 0.0)
    assert rows[-1]["exact"]["row_0_as_largest_batch"] and rows[0]["exact"]["last_row_as_row_0"]  # itself; one row
    assert "skipped" in phases["wait"]  # no GPU to wait for
    cells = phases["ring"]["cells"]
    assert [(c["rows"], c["ring_positions"]) for c in cells] == [(2, 16), (2, 64), (4, 16), (4, 64)]
    assert all(c["step_ms"]["p50"] > 0 and c["ratio_to_full_ring"] > 0 for c in cells)
    batch = phases["batch"]
    assert [(run["batch"], run["active"]) for run in batch["runs"]] == [
        ("fixed", 1), ("fixed", 2), ("fixed", 4), ("buckets", 1), ("buckets", 2), ("buckets", 4)]
    assert all(run["ratio_to_fixed"] > 0 for run in batch["runs"])
    probe = batch["probe"]
    assert probe["frames"] == 24 and probe["neighbours"] == 3  # slots 1-3 of the 4 join and leave
    assert 0 <= probe["frames_text_differs"] <= probe["frames"] and probe["max_abs_diff"] < 1e-3
    serve = phases["serve"]
    assert serve["clients_exit_status"] == 0, serve.get("clients_output")
    assert serve["frames_out"] == serve["sessions"] * serve["frames_per_session"] and not serve["failures"]
    assert serve["lag_p50_ms"] > 0 and serve["host_cpu_us_per_frame"] > 0
    assert "done" in phases
    build = phases["build"]
    assert build["model_s"] > 0 and build["warmup_s"] >= 0 and build["phase_s"] >= build["load_s"] > 0
    variants = phases["variants"]
    assert {(r["rows"], r["cuda_graphs"], r["torch_compile"]) for r in variants["runs"] if "step_ms" in r} == {
        (1, False, False), (4, False, False)}  # no GPU: graphs and compile off, the rest said skipped
    assert variants["columns"]["graphs_off_compile_off"].keys() == {"1", "4"}
    assert len(variants["runs"]) == 8 and all("skipped" in r or "step_ms" in r for r in variants["runs"])
    assert serve["server_cpu"] is not None and serve["server_cpu"] not in serve["clients_cpus"] or \
        serve["clients_cpus"] == [serve["server_cpu"]]
    # What comes back from a device is the output folder: the results alone, never the installed
    # wheels (a remote run brings back a few small files).
    assert sorted(path.name for path in out.iterdir()) == ["gpu.json"]
    assert (out / "gpu.json").stat().st_size < 1 << 20


def test_the_script_fails_at_once_naming_what_is_missing(bare):
    """Without the wheel folder: the first thing it says is which imports are missing."""
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), str(bare["work"] / "none")],
                          cwd=bare["work"], env=bare["env"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3
    assert "cannot run: missing" in done.stderr and "trio (from trio)" in done.stderr
    assert "moshi (from moshi)" in done.stderr and "torch" not in done.stderr.split("missing", 1)[1]


def test_the_cli_runs_from_the_bare_checkout(bare):
    site = bare["work"] / "site"
    subprocess.run([sys.executable, "-S", "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                    "--target", str(site), *map(str, bare["wheels"].glob("*.whl"))],
                   env=bare["env"], check=True, timeout=TIMEOUT_S, capture_output=True)
    env = {**bare["env"], "PYTHONPATH": f"{site}:{bare['env']['PYTHONPATH']}"}
    done = subprocess.run([sys.executable, "-S", str(ROOT / "benchmarks" / "bare_cli.py"), "--version"],
                          cwd=bare["work"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("duplexrt "), done.stderr
