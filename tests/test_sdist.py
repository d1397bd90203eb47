"""The sdist carries what the docs tell a user of an unpacked source tree to read or run: the one
install sequence (packaging/install.sh), the guides (docs/), the deployment files (deploy/), the
Makefile and the Dockerfile.  Fast (about a second): the sdist alone, built without isolation
from a copy of the checkout with this environment's setuptools (``build`` is in the test extras;
tests/test_packaging.py builds both distributions the slow way, isolated)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _checkout_files() -> list[str]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [name for name in listed if name and (ROOT / name).is_file()]


def test_the_sdist_carries_the_install_script_the_docs_and_the_deploy_files(tmp_path):
    if importlib.util.find_spec("build") is None or importlib.util.find_spec("setuptools") is None:
        pytest.skip("needs build and setuptools (the test extras): pip install build")
    files = _checkout_files()
    source = tmp_path / "src"
    for name in files:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    done = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir",
                           str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (sdist,) = (tmp_path / "dist").glob("duplexrt-*.tar.gz")
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile() and "/" in m.name}
    wanted = {name for name in files if name.startswith(("docs/", "deploy/"))}
    wanted |= {"packaging/install.sh", "Makefile", "Dockerfile", "LICENSE", "README.md", "CHANGELOG.md"}
    assert any(name.startswith("docs/") for name in wanted) and any(name.startswith("deploy/") for name in wanted)
    assert wanted <= members, f"missing from the sdist: {sorted(wanted - members)}"
    assert not any("__pycache__" in name or name.endswith(".pyc") for name in members)
