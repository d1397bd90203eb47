"""What the moshi backend says when its optional packages are missing (duplexrt/backends/optional.py).

Which packages are installed is the machine's, so these tests choose it: ``_importable`` is
replaced by a set of present modules (FAKE: the only stand-in; the wheel test in
tests/test_packaging.py runs the real case, a fresh environment without torch).
"""

from __future__ import annotations

import pytest

from duplexrt.backends import optional as env
from duplexrt.config import ConfigError, load_config


def present(monkeypatch, *modules: str) -> None:
    monkeypatch.setattr(env, "_importable", lambda module: module in modules)


ALL = ("torch", "moshi", "safetensors", "huggingface_hub", "einops", "sentencepiece", "tqdm")


def test_nothing_installed_names_every_package_and_the_tested_route_for_cpu_and_cuda(monkeypatch):
    present(monkeypatch)
    with pytest.raises(ConfigError) as caught:
        env.check_installed()
    message = str(caught.value)
    assert ("needs packages that are not installed: torch, safetensors, huggingface-hub, einops, "
            "sentencepiece, tqdm, moshi.") in message
    # The tested route (packaging/install.sh), torch pinned first: never the extra, whose moshi pins
    # pull torch<2.10 with ~3 GB of CUDA wheels even on a CPU machine.
    assert "duplexrt[moshi]" not in message and "packaging/install.sh" in message
    rest = ("pip install 'safetensors>=0.4,<0.8' 'huggingface-hub>=0.24,<1.0' 'einops>=0.7,<0.9' "
            "'sentencepiece>=0.2,<0.3' 'tqdm>=4.48' && pip install --no-deps moshi==0.2.13")
    assert (f"on a CPU machine pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && {rest}; "
            f"on a CUDA machine pip install torch==2.13.0 && {rest}") in message


def test_beside_an_installed_torch_moshi_goes_in_without_its_pins_after_its_light_dependencies(monkeypatch):
    present(monkeypatch, "torch", "safetensors", "huggingface_hub", "tqdm")
    assert env.missing_packages() == ["einops>=0.7,<0.9", "sentencepiece>=0.2,<0.3", "moshi==0.2.13"]
    assert env.install_command(env.missing_packages()) == (
        "pip install 'einops>=0.7,<0.9' 'sentencepiece>=0.2,<0.3' && pip install --no-deps moshi==0.2.13")


def test_moshi_installed_without_its_dependencies_is_told_to_add_only_those(monkeypatch):
    # What following the old advice (pip install --no-deps moshi==0.2.13) alone leaves.
    present(monkeypatch, "torch", "moshi", "safetensors", "huggingface_hub", "tqdm", "sentencepiece")
    with pytest.raises(ConfigError) as caught:
        env.check_installed()
    assert str(caught.value).endswith("not installed: einops. Install them with: pip install 'einops>=0.7,<0.9'")


def test_everything_installed_passes(monkeypatch):
    present(monkeypatch, *ALL)
    assert env.missing_packages() == []
    env.check_installed()


def test_the_backend_factory_refuses_before_any_thread_starts(monkeypatch):
    present(monkeypatch, "torch")
    from duplexrt.backends import create_backend

    config = load_config(None, ['backend.name="moshi"', "backend.options.tiny=true"])
    with pytest.raises(ConfigError, match="pip install --no-deps moshi==0.2.13$"):
        create_backend(config)


def test_the_install_script_installs_the_same_requirements():
    """packaging/install.sh (make install, the wheel test, the Dockerfile) and the advice agree."""
    from pathlib import Path

    script = (Path(__file__).resolve().parent.parent / "packaging" / "install.sh").read_text()
    for _, requirement in (*env.LIGHT, env.MOSHI):
        assert requirement in script, requirement


def test_the_hint_pins_the_torch_the_install_script_pins():
    from pathlib import Path

    script = (Path(__file__).resolve().parent.parent / "packaging" / "install.sh").read_text()
    assert f': "${{TORCH:={env.TORCH_PIN}}}"' in script
    assert env.TORCH_CPU_INDEX in script
