"""``stt-tiny``: a seeded, randomly initialised speech-to-text model of Kyutai's STT shape.

Kyutai's STT checkpoints are ``moshi`` LMs with no depformer (``dep_q = 0``): the temporal
transformer reads the caller's Mimi codes (every codebook as an input stream, all at delay 0)
and writes one text token a step, trained to lag the audio by ``stt_config.audio_delay_seconds``.
This one has that shape at toy sizes (the tiny Mimi of ``backends.moshi.tiny``, 8 codebooks, a
two-layer LM), so tests and a CPU deployment run the very code paths a real checkpoint runs,
with nothing downloaded.  Its text is noise, of course; what matters is that it is the package's
own computation, which the tests compare token for token.

The same seed always gives the same weights and tokenizer, in memory (``build_tiny_stt``) or
saved in Kyutai's layout (``save_tiny_stt``) and loaded back through ``CheckpointInfo``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from duplexrt.backends.moshi.env import import_moshi
from duplexrt.backends.moshi.internals import mark_codebook_initialised
from duplexrt.backends.moshi.tiny import TINY_MIMI, TINY_TEXT_CARD, train_tokenizer

NAME = "stt-tiny"
#: Input codebooks: all of the tiny Mimi's.
TINY_STT_CODEBOOKS = TINY_MIMI["quantizer"]["n_q"]
#: What Kyutai's ``stt-1b-en_fr`` declares (0.5 s of delay); a short prefix keeps joins cheap.
TINY_STT_CONFIG: dict[str, float] = {"audio_delay_seconds": 0.5, "audio_silence_prefix_seconds": 0.16}
TINY_STT_LM: dict[str, Any] = {
    "dim": 64, "text_card": TINY_TEXT_CARD, "existing_text_padding_id": 3,
    "n_q": TINY_STT_CODEBOOKS, "dep_q": 0, "card": TINY_MIMI["quantizer"]["bins"],
    "num_heads": 4, "num_layers": 2, "hidden_scale": 2, "causal": True, "layer_scale": None,
    "context": 64, "max_period": 10000, "gating": "silu", "norm": "rms_norm_f32",
    "positional_embedding": "rope", "delays": [0] * (TINY_STT_CODEBOOKS + 1),
}
#: The tokenizer seed is the model seed plus this, so the STT model's vocabulary is not the
#: dialogue model's by accident (each is still fixed by its seed).
_LM_SEED_OFFSET = 1000


def build_tiny_stt(seed: int = 0, *, device: str = "cpu", dtype: Any = None) -> tuple[Any, Any, Any, dict[str, float]]:
    """``(mimi, lm, tokenizer, stt_config)`` for ``seed``, built in memory.  The global torch RNG is
    left as it was."""
    import sentencepiece
    import torch

    models = import_moshi(device)
    dtype = dtype or torch.float32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mimi = models.loaders.get_mimi(None, TINY_MIMI, device="cpu", num_codebooks=TINY_STT_CODEBOOKS)
        _randomise_codebooks(mimi, torch.Generator().manual_seed(seed + 1))
        torch.manual_seed(seed + _LM_SEED_OFFSET)
        lm = models.loaders.get_moshi_lm(None, lm_kwargs=json.loads(json.dumps(TINY_STT_LM)), device="cpu",
                                         dtype=torch.float32)
    lm.eval()
    mimi = mimi.to(device)
    lm = lm.to(device=device, dtype=dtype)
    tokenizer = sentencepiece.SentencePieceProcessor(model_proto=train_tokenizer(seed))
    return mimi, lm, tokenizer, dict(TINY_STT_CONFIG)


def _varied_signal(generator: Any, seconds: float = 12.0, sample_rate: int = 24000) -> Any:
    """Seconds of varied sound (tones gliding in pitch and loudness, noise bursts, silences),
    cut in 80 ms pieces: what the codebooks are fitted to."""
    import torch

    frame = 1920
    pieces = []
    t = torch.arange(frame, dtype=torch.float32) / sample_rate
    for _ in range(int(seconds * sample_rate / frame)):
        kind = int(torch.randint(0, 4, (1,), generator=generator))
        loud = float(torch.rand(1, generator=generator)) ** 2
        if kind == 0:
            pieces.append(torch.zeros(frame))
        elif kind == 1:
            pieces.append(torch.randn(frame, generator=generator) * loud)
        else:
            pitch = 60.0 + 3000.0 * float(torch.rand(1, generator=generator))
            pieces.append(torch.sin(2 * torch.pi * pitch * t * kind) * loud)
    return torch.cat(pieces)[None, None]


def _randomise_codebooks(mimi: Any, generator: Any) -> None:
    """Codebooks fitted to the tiny encoder's own latents.  Mimi's codebooks are learnt (k-means
    at first); random centroids far from the random encoder's latents would give every sound the
    same codes, and then no transcript would depend on the audio.  So each codebook of the split
    RVQ takes its centroids from the residuals of a varied signal's latents (the initialisation
    k-means starts from), and each later codebook sees what the earlier ones left."""
    import torch
    from moshi.quantization.core_vq import EuclideanCodebook

    with torch.no_grad():
        latent = mimi.encode_to_latent(_varied_signal(generator), quantize=False)
        quantizer = mimi.quantizer
        for rvq in (quantizer.rvq_first, quantizer.rvq_rest):
            residual = rvq.input_proj(latent)[0].transpose(0, 1).contiguous()  # (frames, dim)
            for layer in rvq.vq.layers:
                codebook = next(m for m in layer.modules() if isinstance(m, EuclideanCodebook))
                bins = codebook.embedding_sum.shape[0]
                picks = torch.randint(0, residual.shape[0], (bins,), generator=generator)
                spread = residual.std() * 0.05 + 1e-6
                centroids = residual[picks] + torch.randn((bins, residual.shape[1]), generator=generator) * spread
                codebook.embedding_sum.copy_(centroids)
                codebook.cluster_usage.fill_(1.0)
                mark_codebook_initialised(codebook)
                nearest = torch.cdist(residual, centroids).argmin(dim=1)
                residual = residual - centroids[nearest]


def save_tiny_stt(directory: str | Path, seed: int = 0) -> Path:
    """Write ``stt-tiny`` for ``seed`` to ``directory`` in Kyutai's layout (``config.json`` with its
    ``stt_config``, the weights as safetensors, Mimi's config, the tokenizer).  Returns it."""
    from safetensors.torch import save_file

    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    mimi, lm, _tokenizer, stt_config = build_tiny_stt(seed)
    save_file({k: v.detach().clone().contiguous() for k, v in lm.state_dict().items()},
              str(directory / "model.safetensors"))
    save_file({k: v.detach().clone().contiguous() for k, v in mimi.state_dict().items()},
              str(directory / "mimi.safetensors"))
    (directory / "tokenizer.model").write_bytes(train_tokenizer(seed))
    (directory / "mimi_config.json").write_text(json.dumps(TINY_MIMI, indent=1))
    config = json.loads(json.dumps(TINY_STT_LM))
    config.update({
        "model_type": "stt",
        "moshi_name": "model.safetensors",
        "mimi_name": "mimi.safetensors",
        "tokenizer_name": "tokenizer.model",
        "mimi_config_name": (directory / "mimi_config.json").as_uri(),
        "stt_config": stt_config,
        "model_id": {"sig": f"duplexrt-stt-tiny-{seed}", "epoch": 0},
    })
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory
