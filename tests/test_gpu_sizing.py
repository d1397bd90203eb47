"""Every shipped preset and Kubernetes manifest that names a GPU fits it, by the arithmetic the
moshi backend makes at load (``backends/moshi/memory.py``), on this CPU: the architecture is built
on PyTorch's ``meta`` device (real shapes, no memory), its weights and per-slot state counted, and
the slots compared with what fits the GPU's memory less the reserve.

A GPU preset names its GPU on one machine-readable comment line,
``# sized for: gpu=NAME memory_gb=N``; a manifest names it in its nodeSelector
(``nvidia.com/gpu.product``, whose product names carry the memory: ``NVIDIA-H100-80GB-HBM3``).
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import pytest

os.environ.setdefault("NO_TORCH_COMPILE", "1")

from duplexrt.backends.moshi import memory  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("moshi")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted((ROOT / "configs").glob("*.toml"))
SIZED_FOR = re.compile(r"^# sized for: gpu=(\S+) memory_gb=(\d+)\s*$", re.MULTILINE)
#: The checkpoints whose architecture this test can build offline: Kyutai's Moshi 7B repositories
#: carry no config.json, and the package's own 7B configuration is theirs.
MOSHI_7B = re.compile(r"^kyutai/moshi(ko|ka)-")
#: NVIDIA's PersonaPlex repositories: Moshi 7B's architecture, weights fine-tuned (no config.json).
PERSONAPLEX_7B = re.compile(r"^nvidia/personaplex-7b")


@pytest.fixture(scope="module")
def moshi_7b_at():
    """``(backend options) -> (weights, state per slot)`` of the Moshi 7B architecture in bf16, on
    the meta device, at the K/V ring the options give (``context_seconds``; unset: the model's)."""
    from moshi.models import loaders

    from duplexrt.backends.moshi import ring

    mimi = loaders.get_mimi(None, device="meta")
    lm = loaders.get_moshi_lm(None, device="meta", dtype=torch.bfloat16)
    weights, own = memory.weight_bytes(lm, mimi), ring.model_context(lm)

    def at(options: dict) -> tuple[int, int]:
        chosen = ring.choose(options.get("context_seconds"), options.get("beyond_context", "end"), own, 12.5)
        ring.apply(lm, chosen)
        return weights, memory.slot_bytes(mimi, lm, guided=False).total

    return at


@pytest.fixture(scope="module")
def moshi_7b(moshi_7b_at):
    """(weights, state per slot) of the Moshi 7B architecture in bf16 at the model's own ring."""
    return moshi_7b_at({})


def _architecture(options: dict) -> str | None:
    checkpoint = str(options.get("checkpoint", ""))
    if options.get("random") == "moshi-7b" or MOSHI_7B.match(checkpoint) or PERSONAPLEX_7B.match(checkpoint):
        return "moshi-7b"
    return None


def _gpu_presets() -> list[Path]:
    found = []
    for path in PRESETS:
        config = tomllib.loads(path.read_text())
        backend = config.get("backend", {})
        if backend.get("name") == "moshi" and str(backend.get("options", {}).get("device", "")).startswith("cuda"):
            found.append(path)
    return found


def test_the_gpu_presets_are_the_ones_expected():
    assert {p.stem for p in _gpu_presets()} == {"moshiko", "moshiko-stt", "moshi-7b-random", "hibiki",
                                                   "hibiki-zero", "personaplex", "personaplex-stt"}


@pytest.mark.parametrize("preset", _gpu_presets(), ids=lambda p: p.stem)
def test_every_gpu_preset_names_its_gpu_and_fits_it(preset, moshi_7b_at):
    text = preset.read_text()
    named = SIZED_FOR.findall(text)
    assert len(named) == 1, f"{preset.name} must name its GPU once: '# sized for: gpu=NAME memory_gb=N'"
    (gpu, gigabytes), = named
    config = tomllib.loads(text)
    slots = config["runtime"]["slots"]
    architecture = _architecture(config["backend"]["options"])
    if architecture is None:
        # Its architecture is in the checkpoint's config.json, on the hub: only the load can size
        # it, so only "auto" (sized at load from that config) can be right on every GPU.
        assert slots == "auto", f"{preset.name}: no offline architecture to check {slots} slots against"
        return
    weights, per_slot = moshi_7b_at(config["backend"]["options"])  # at the preset's own ring
    options = config["backend"]["options"]
    if options.get("persona"):
        # The prompt lane (one row of the LM's K/V: 1.573 GB at the full ring) and the prompt
        # cache are taken from the memory before the slots (``MoshiBackend.load``).
        weights += 1_572_864_000 + int(options.get("prompt_cache_mb", 2048) * 2**20)
    fit = memory.fits(int(gigabytes) * 10**9, weights, per_slot)
    assert fit >= 1, f"{preset.name}: not one slot fits {gpu}"
    if slots != "auto":
        assert slots <= fit, f"{preset.name}: {slots} slots on {gpu}, at most {fit} fit"


def _containers(document: dict):
    spec = document.get("spec", {}).get("template", {}).get("spec", {})
    for container in spec.get("containers", []):
        yield spec.get("nodeSelector", {}), {e["name"]: e.get("value") for e in container.get("env", [])}


def test_the_kubernetes_manifest_fits_the_gpu_it_selects(moshi_7b_at):
    documents = list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "duplexrt.yaml").read_text()))
    checked = 0
    for document in documents:
        if not document or document.get("kind") != "Deployment":
            continue
        for selector, env in _containers(document):
            product = selector["nvidia.com/gpu.product"]
            gigabytes = int(re.search(r"(\d+)GB", product).group(1))
            preset = tomllib.loads((ROOT / "configs" / f"{env['DUPLEXRT_CONFIG']}.toml").read_text())
            assert _architecture(preset["backend"]["options"]) == "moshi-7b"
            slots = env.get("DUPLEXRT_SLOTS") or preset["runtime"]["slots"]
            weights, per_slot = moshi_7b_at(preset["backend"]["options"])
            fit = memory.fits(gigabytes * 10**9, weights, per_slot)
            assert slots == "auto" or int(slots) <= fit, f"{product}: {slots} slots, at most {fit} fit"
            checked += 1
    assert checked


def test_the_arithmetic_behind_the_shipped_figures(moshi_7b):
    """The figures the presets' comments and docs/capacity.md quote, recomputed."""
    weights, per_slot = moshi_7b
    # 1.59 GB a slot; 15.76 GB of weights: the LM's 7.69 B parameters in bf16, Mimi's in float32.
    assert round(per_slot / 1e9, 2) == 1.59 and round(weights / 1e9, 2) == 15.76
    assert memory.fits(80 * 10**9, weights, per_slot) == 37
    assert memory.fits(141 * 10**9, weights, per_slot) == 73
    assert memory.fits(80 * 10**9, weights, per_slot) < 64  # the manifest's old slot count
    assert memory.fits(141 * 10**9, weights, per_slot) < 128  # the default runtime.slots: no GPU
    # PersonaPlex (the same architecture): the prompt lane and a 2 GiB prompt cache come first.
    held = 1_572_864_000 + 2048 * 2**20
    assert memory.fits(80 * 10**9, weights + held, per_slot) == 34
    assert memory.fits(141 * 10**9, weights + held, per_slot) == 70
