"""PersonaPlex (NVIDIA, 2026): Moshi 7B fine-tuned so that a voice prompt and a text role prompt,
stepped before the conversation, set who the model is and how it sounds.

The network is Moshi's, layer for layer, so the ``moshi`` package builds it from its own 7B
configuration.  What NVIDIA's checkpoint and fork change is handled here, each for a reason:

* **Sixteen depformer steps in the checkpoint, eight served.**  NVIDIA's fork builds the
  depformer with 16 steps, the last 8 predicting the caller's own codebooks; in serving those
  are overwritten by the caller's audio before anything reads them, and the depformer is causal
  (step k sees steps < k only), so steps 8-15 change nothing the caller hears.  The model is
  built with the package's 8 steps and the checkpoint's weights for steps 8-15 are dropped
  (``depformer_state``): half the depformer's work, the same tokens.
* **Stacked per-step weights** (``self_attn.in_proj_weight`` of 16 steps in one tensor): cut to
  the 8 steps served before the package's own loader splits them per step.
* **The prompt's filler frames**: while the prompt is stepped, the model's own stream hears
  silence and the caller's stream a 440 Hz tone, given as Mimi codes.  NVIDIA fixed them for
  the real Mimi (``SILENCE_CODES``, ``TONE_CODES``); for another Mimi (the tiny model) they are
  what that Mimi encodes for one frame of silence and of the tone (``filler_codes``).
* **Voices** are saved prompts (``voices/*.pt`` in the checkpoint repository): see ``persona``.

``build_tiny_personaplex`` is the tiny random model of this shape (the tiny Moshi with a K/V
ring long enough for a prompt), and ``save_nvidia_layout`` writes it as NVIDIA lays out a
checkpoint (16 depformer steps, stacked weights), so the loader is tested on that layout here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

#: What the real Mimi encodes for one 80 ms frame of silence and of a 440 Hz tone at half scale
#: (NVIDIA's measured constants: the filler frames of the prompt, 8 codebooks each).
SILENCE_CODES = (948, 243, 1178, 546, 1736, 1030, 1978, 2008)
TONE_CODES = (430, 1268, 381, 1611, 1095, 1495, 56, 472)
#: The text token every prompt frame without a text token carries (the model's padding id).
PROMPT_TEXT_PAD = 3
#: Seconds of filler after the voice and after the text (the reference's 0.5 s).
FILLER_SECONDS = 0.5
#: The tags the model was trained to read its role prompt between.
SYSTEM_TAG = "<system>"
#: The file names of NVIDIA's checkpoint repository (the same names as Kyutai's Moshi 7B).
LM_NAME = "model.safetensors"
MIMI_NAME = "tokenizer-e351c8d8-checkpoint125.safetensors"
TOKENIZER_NAME = "tokenizer_spm_32k_3.model"
VOICES_DIR = "voices"
VOICES_ARCHIVE = "voices.tgz"
#: The voices NVIDIA packages with the checkpoint (natural and varied, female and male).
PACKAGED_VOICES = tuple([f"NATF{i}" for i in range(4)] + [f"NATM{i}" for i in range(4)]
                        + [f"VARF{i}" for i in range(5)] + [f"VARM{i}" for i in range(5)])
#: The tiny model's K/V ring: room for a voice, the fillers and a few hundred prompt tokens.
TINY_CONTEXT = 512
#: The tiny model's voices last this long (12 frames after the one the reference skips).
TINY_VOICE_SECONDS = 1.04


def wrap_in_system_tags(text: str) -> str:
    """The role prompt as the model was trained to read it: between system tags, added unless
    the caller wrote them."""
    cleaned = text.strip()
    if cleaned.startswith(SYSTEM_TAG) and cleaned.endswith(SYSTEM_TAG) and len(cleaned) > len(SYSTEM_TAG):
        return cleaned
    return f"{SYSTEM_TAG} {cleaned} {SYSTEM_TAG}"


def tone(frame_size: int, sample_rate: int) -> np.ndarray:
    """One frame of the 440 Hz tone at half scale that the caller's stream hears during a prompt."""
    t = np.arange(frame_size, dtype=np.float64) / sample_rate
    return (0.5 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)


def filler_codes(mimi: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(silence, tone): what ``mimi`` encodes for one frame of each, from a fresh state, as
    NVIDIA measured its constants on the real Mimi.  ``mimi`` must not be streaming."""
    import torch

    frame = int(mimi.sample_rate / mimi.frame_rate)
    param = next(mimi.parameters())
    silence = torch.zeros(1, 1, frame, device=param.device)
    sine = torch.from_numpy(tone(frame, int(mimi.sample_rate)))[None, None].to(param.device)
    with torch.no_grad():
        codes = [tuple(int(c) for c in mimi.encode(x)[0, :, 0].tolist()) for x in (silence, sine)]
    return codes[0], codes[1]


# -- loading NVIDIA's checkpoint --------------------------------------------------------------------

_PER_STEP = re.compile(r"^(?P<head>.*?\b(?:linears|depformer_in|depformer_emb|gating))\.(?P<step>\d+)\.(?P<tail>.*)$")


def depformer_state(state: dict[str, Any], lm: Any) -> dict[str, Any]:
    """NVIDIA's LM weights cut to the depformer steps ``lm`` serves (see the module's docstring):
    per-step modules past them dropped, stacked per-step attention weights cut to their first
    steps.  Anything else is left for ``load_state_dict`` to judge."""
    served = int(lm.dep_q)
    wanted = lm.state_dict()
    out: dict[str, Any] = {}
    for key, value in state.items():
        match = _PER_STEP.match(key)
        if match is not None and key not in wanted:
            limit = served - 1 if match["head"].endswith("depformer_emb") else served
            if int(match["step"]) >= limit:
                continue  # a step the served depformer does not have
        if key.startswith("depformer.") and key.endswith(("self_attn.in_proj_weight", "self_attn.out_proj.weight")):
            prefix = key.rsplit("self_attn.", 1)[0] + "self_attn."
            per_step = wanted[prefix + ("in_projs.0.weight" if "in_proj" in key else "out_projs.0.weight")]
            value = value[: served * per_step.shape[0]]
        out[key] = value
    return out


def load_lm(path: Path, *, device: str, dtype: Any, lm_kwargs: dict[str, Any] | None = None) -> Any:
    """The PersonaPlex LM from NVIDIA's ``model.safetensors`` (16 or 8 depformer steps), as the
    package's 8-step Moshi 7B, on ``device`` in ``dtype``."""
    import torch
    from safetensors.torch import load_file

    from moshi.models.lm import LMModel

    from duplexrt.backends.moshi.internals import moshi_7b_lm_kwargs

    kwargs = dict(lm_kwargs or moshi_7b_lm_kwargs())
    kwargs.pop("depformer_causal", None)  # the package's depformer is causal whatever this says
    with torch.device("meta"):
        lm = LMModel(device="meta", dtype=dtype, **kwargs)
    state = load_file(str(path), device="cpu")
    state = {k: (v.to(dtype) if v.dtype.is_floating_point else v) for k, v in depformer_state(state, lm).items()}
    lm.load_state_dict(state, assign=True)
    return lm.to(device=device).eval()


def find_voices(directory: Path) -> Path | None:
    """The checkpoint's voices folder: ``voices/``, or ``voices.tgz`` unpacked beside it (only
    plain ``*.pt`` files, each under the folder: nothing in the archive can write elsewhere)."""
    folder = directory / VOICES_DIR
    if folder.is_dir():
        return folder
    archive = directory / VOICES_ARCHIVE
    if not archive.is_file():
        return None
    import tarfile

    folder.mkdir(exist_ok=True)
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            if member.isfile() and name.endswith(".pt") and not name.startswith("."):
                source = tar.extractfile(member)
                if source is not None:
                    (folder / name).write_bytes(source.read())
    return folder


def load_checkpoint(directory: Path, *, device: str, dtype: Any) -> tuple[Any, Any, Any, Path | None]:
    """``(mimi, lm, tokenizer, voices folder)`` from a directory laid out as NVIDIA's repository."""
    import sentencepiece

    from moshi.models import loaders

    from duplexrt.config import ConfigError

    missing = [name for name in (LM_NAME, MIMI_NAME, TOKENIZER_NAME) if not (directory / name).is_file()]
    if missing:
        have = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
        raise ConfigError(f"backend.options.checkpoint: the PersonaPlex checkpoint {directory} lacks "
                          f"{', '.join(missing)}; it holds: {', '.join(have) or 'nothing'}")
    mimi = loaders.get_mimi(directory / MIMI_NAME, device=device)
    lm = load_lm(directory / LM_NAME, device=device, dtype=dtype)
    tokenizer = sentencepiece.SentencePieceProcessor(str(directory / TOKENIZER_NAME))
    return mimi, lm, tokenizer, find_voices(directory)


# -- the tiny model ---------------------------------------------------------------------------------

def tiny_lm_config() -> dict[str, Any]:
    from duplexrt.backends.moshi.tiny import lm_config

    config = lm_config()
    config["context"] = TINY_CONTEXT
    return config


def build_tiny_personaplex(seed: int = 0, *, device: str = "cpu", dtype: Any = None) -> tuple[Any, Any, Any]:
    """``(mimi, lm, tokenizer)``: the tiny Moshi of ``tiny`` with a K/V ring a prompt fits in."""
    from duplexrt.backends.moshi.tiny import build_tiny

    return build_tiny(seed, device=device, dtype=dtype, lm_kwargs=tiny_lm_config())


def tiny_voice_wav(name: str, sample_rate: int = 24000) -> np.ndarray:
    """A synthetic voice sample for a tiny voice: a few harmonics whose pitch and timbre the
    name decides, so that each voice prompt is different (the tiny model's voices are made from
    these by the reference's own procedure: ``persona.make_voice``)."""
    rng = np.random.default_rng(sum(ord(c) * 31 ** i for i, c in enumerate(name)) & 0xFFFFFFFF)
    t = np.arange(int(TINY_VOICE_SECONDS * sample_rate)) / sample_rate
    pitch = rng.uniform(90, 260)
    wav = sum(rng.uniform(0.05, 0.3) * np.sin(2 * np.pi * pitch * (h + 1) * t + rng.uniform(0, 6))
              for h in range(5))
    wav = wav * (0.6 + 0.4 * np.sin(2 * np.pi * rng.uniform(2, 5) * t))
    return np.asarray(wav, dtype=np.float32)


def nvidia_state(lm: Any) -> dict[str, Any]:
    """``lm``'s weights (8 served depformer steps) as NVIDIA's checkpoint holds them: 16
    depformer steps (8-15 copies of 0-7, as NVIDIA's loader fills them) and each attention's
    per-step projections stacked in one tensor (``in_proj_weight``, ``out_proj.weight``)."""
    import torch

    served = int(lm.dep_q)
    out: dict[str, Any] = {}
    stacked: dict[str, dict[int, Any]] = {}
    for key, value in lm.state_dict().items():
        value = value.detach().clone().contiguous()
        attn = re.match(r"^(.*\.self_attn\.)(in_projs|out_projs)\.(\d+)\.weight$", key)
        if attn is not None:
            name = attn[1] + ("in_proj_weight" if attn[2] == "in_projs" else "out_proj.weight")
            stacked.setdefault(name, {})[int(attn[3])] = value
            continue
        out[key] = value
        match = _PER_STEP.match(key)
        if match is not None and key.startswith(("linears", "depformer")):
            # NVIDIA's loader fills step s + 8 from step s; the one embedding it leaves unfilled
            # (``depformer_emb.7``: the served steps have 7) is filled from step 0 here.
            step = int(match["step"])
            out[f"{match['head']}.{step + served}.{match['tail']}"] = value.clone()
            if match["head"].endswith("depformer_emb") and step == 0:
                out[f"{match['head']}.{served - 1}.{match['tail']}"] = value.clone()
    for key, parts in stacked.items():
        steps = [parts[i] for i in sorted(parts)]
        if key.startswith("depformer."):
            steps = steps + steps  # 16 steps: 8-15 repeat 0-7
        out[key] = torch.cat(steps, dim=0).contiguous()
    return out


def save_nvidia_layout(directory: str | Path, lm: Any, mimi: Any, tokenizer_proto: bytes) -> Path:
    """Write ``lm``, ``mimi`` and the tokenizer as NVIDIA's repository lays them out
    (``nvidia_state``; no config.json)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(nvidia_state(lm), str(directory / LM_NAME))
    save_file({k: v.detach().clone().contiguous() for k, v in mimi.state_dict().items()},
              str(directory / MIMI_NAME))
    (directory / TOKENIZER_NAME).write_bytes(tokenizer_proto)
    return directory
