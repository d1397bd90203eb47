"""A tiny, seeded, randomly initialised Moshi: the real architecture at toy sizes.

It runs the very code paths a real checkpoint runs (Mimi's streaming SEANet and transformer, the
split RVQ, the temporal transformer and the depformer, ``LMGen`` with per-row resets), fast enough
for tests on two CPU cores, and needs nothing downloaded.  The same seed always gives the same
weights and the same text tokenizer, whether the model is built in memory (``build_tiny``) or
written to a directory in Kyutai's layout (``save_tiny_checkpoint``) and loaded back from there.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from duplexrt.backends.moshi.env import import_moshi
from duplexrt.backends.moshi.internals import mark_codebook_initialised

#: Mimi at toy size: the real frame (1920 samples at 24 kHz, 12.5 Hz) and the real strides.
TINY_MIMI: dict[str, Any] = {
    "sample_rate": 24000,
    "channels": 1,
    "frame_rate": 12.5,
    "seanet": {
        "channels": 1, "dimension": 32, "causal": True, "n_filters": 4, "n_residual_layers": 1,
        "activation": "ELU", "compress": 2, "dilation_base": 2, "disable_norm_outer_blocks": 0,
        "kernel_size": 7, "residual_kernel_size": 3, "last_kernel_size": 3, "norm": "none",
        "pad_mode": "constant", "ratios": [8, 6, 5, 4], "true_skip": True,
    },
    "quantizer": {"dimension": 16, "n_q": 8, "bins": 64, "input_dimension": 32, "output_dimension": 32},
    "transformer": {
        "d_model": 32, "num_heads": 2, "num_layers": 1, "causal": True, "layer_scale": 0.01,
        "context": 16, "conv_layout": True, "max_period": 10000, "gating": "none", "norm": "layer_norm",
        "positional_embedding": "rope", "dim_feedforward": 64, "input_dimension": 32,
        "output_dimensions": [32],
    },
}

#: The LM at toy size, with Moshi's layout: 8 audio codebooks out, 8 in, the same delays.
TINY_TEXT_CARD = 96
TINY_LM: dict[str, Any] = {
    "dim": 64, "text_card": TINY_TEXT_CARD, "existing_text_padding_id": 3, "n_q": 16, "dep_q": 8,
    "card": TINY_MIMI["quantizer"]["bins"], "num_heads": 4, "num_layers": 2, "hidden_scale": 2,
    "causal": True, "layer_scale": None, "context": 64, "max_period": 10000, "gating": "silu",
    "norm": "rms_norm_f32", "positional_embedding": "rope",
    "depformer_dim": 32, "depformer_dim_feedforward": 64, "depformer_num_heads": 2,
    "depformer_num_layers": 1, "depformer_layer_scale": None, "depformer_multi_linear": True,
    "depformer_context": 8, "depformer_max_period": 10000, "depformer_gating": "silu",
    "depformer_pos_emb": "none", "depformer_weights_per_step": True,
    "delays": [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1],
}

#: Added for a conditioned tiny model (``cfg_coef != 1``): Hibiki's "description" lookup table.
TINY_CONDITIONING: dict[str, Any] = {
    "conditioners": {
        "description": {
            "type": "lut",
            "lut": {"n_bins": 8, "dim": 16, "tokenizer": "noop",
                    "possible_values": ["very_bad", "bad", "neutral", "good", "very_good"]},
        },
    },
    "fuser": {"sum": ["description"]},
}

LM_NAME = "model.safetensors"
MIMI_NAME = "mimi.safetensors"
MIMI_CONFIG_NAME = "mimi_config.json"
TOKENIZER_NAME = "tokenizer.model"

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "en", "or", "ba", "di", "fu", "ge", "ha",
              "ji", "ku", "la", "mo", "nu", "pe", "qui", "ro", "su", "ta", "u", "ve", "wa", "xo", "yo",
              "ze", "an", "il", "ost", "ber", "cal")


def lm_config(conditioned: bool = False) -> dict[str, Any]:
    """The tiny LM's constructor arguments (a fresh copy)."""
    config = json.loads(json.dumps(TINY_LM))
    if conditioned:
        config.update(json.loads(json.dumps(TINY_CONDITIONING)))
    return config


def tiny_corpus(seed: int, words: int = 400) -> list[str]:
    """A few hundred made-up words in short sentences, the same for the same seed."""
    rng = np.random.default_rng(seed)
    lexicon = ["".join(rng.choice(_SYLLABLES, size=int(rng.integers(1, 4)))) for _ in range(120)]
    picks = rng.choice(lexicon, size=words)
    return [" ".join(picks[i:i + 8]) for i in range(0, words, 8)]


def train_tokenizer(seed: int, vocab_size: int = TINY_TEXT_CARD) -> bytes:
    """A sentencepiece model trained on ``tiny_corpus(seed)`` with ``vocab_size`` pieces and
    Kyutai's special ids (0 unk, 1 bos, 2 eos, 3 pad), serialised."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(tiny_corpus(seed)), model_writer=model, vocab_size=vocab_size,
        model_type="bpe", character_coverage=1.0, num_threads=1, unk_id=0, bos_id=1, eos_id=2,
        pad_id=3, minloglevel=2,
    )
    return model.getvalue()


def _randomise_codebooks(mimi: Any, generator: Any) -> None:
    """Mimi's codebooks start at zero (they are learnt by k-means); give them random centroids so
    that different sounds map to different codes."""
    import torch

    from moshi.quantization.core_vq import EuclideanCodebook

    with torch.no_grad():
        for module in mimi.modules():
            if isinstance(module, EuclideanCodebook):
                module.embedding_sum.copy_(torch.randn(module.embedding_sum.shape, generator=generator))
                module.cluster_usage.fill_(1.0)
                mark_codebook_initialised(module)


def build_tiny(seed: int = 0, *, device: str = "cpu", dtype: Any = None,
               conditioned: bool = False, lm_kwargs: dict[str, Any] | None = None) -> tuple[Any, Any, Any]:
    """``(mimi, lm, tokenizer)``: the tiny model for ``seed``, built in memory (``lm_kwargs``:
    the LM's arguments, ``lm_config(conditioned)`` unless given).

    The global torch RNG is left as it was.
    """
    import sentencepiece
    import torch

    models = import_moshi(device)
    dtype = dtype or torch.float32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mimi = models.loaders.get_mimi(None, TINY_MIMI, device="cpu",
                                       num_codebooks=TINY_LM["n_q"] - TINY_LM["dep_q"])
        _randomise_codebooks(mimi, torch.Generator().manual_seed(seed + 1))
        lm = models.loaders.get_moshi_lm(None, lm_kwargs=lm_kwargs or lm_config(conditioned), device="cpu",
                                         dtype=torch.float32)
    if conditioned:
        # What the package's loader does to every "hibiki" model (an early EOS reads as PAD):
        # done here too, so the in-memory model and its saved copy are the same model.
        with torch.no_grad():
            lm.text_emb.weight[2] = lm.text_emb.weight[3]
    mimi = mimi.to(device)
    lm = lm.to(device=device, dtype=dtype)
    if lm.condition_provider is not None:
        lm.condition_provider.to(device=device, dtype=torch.float32)
    tokenizer = sentencepiece.SentencePieceProcessor(model_proto=train_tokenizer(seed))
    return mimi, lm, tokenizer


def save_tiny_checkpoint(directory: str | Path, seed: int = 0, *, conditioned: bool = False) -> Path:
    """Write the tiny model for ``seed`` to ``directory`` in Kyutai's layout: ``config.json`` (the
    LM's arguments plus the file names), the LM and Mimi weights as safetensors, Mimi's config,
    and the sentencepiece tokenizer.  Loading it with ``checkpoint = DIR`` goes through
    ``moshi.models.loaders.CheckpointInfo`` and needs no network.  Returns the directory."""
    from safetensors.torch import save_file

    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    mimi, lm, _tokenizer = build_tiny(seed, conditioned=conditioned)
    # safetensors refuses tensors that share storage; every tensor is written as its own copy.
    save_file({k: v.detach().clone().contiguous() for k, v in lm.state_dict().items()},
              str(directory / LM_NAME))
    save_file({k: v.detach().clone().contiguous() for k, v in mimi.state_dict().items()},
              str(directory / MIMI_NAME))
    (directory / TOKENIZER_NAME).write_bytes(train_tokenizer(seed))
    (directory / MIMI_CONFIG_NAME).write_text(json.dumps(TINY_MIMI, indent=1))
    config = lm_config(conditioned)
    config.update({
        "model_type": "hibiki" if conditioned else "moshi",
        "moshi_name": LM_NAME,
        "mimi_name": MIMI_NAME,
        "tokenizer_name": TOKENIZER_NAME,
        # A bare name would be fetched from the hub by the package's own loader: file:// keeps
        # even that loader offline (this backend resolves every name inside the directory).
        "mimi_config_name": (directory / MIMI_CONFIG_NAME).as_uri(),
        "model_id": {"sig": f"duplexrt-tiny-{seed}", "epoch": 0},
    })
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def build_random(architecture: str, seed: int = 0, *, device: str = "cpu", dtype: Any = None) -> tuple[Any, Any, Any]:
    """``(mimi, lm, tokenizer)``: a full-size architecture (``moshi-7b``: the package's own Mimi and
    7B LM configuration, as Kyutai's checkpoints use) with seeded random weights, built directly on
    ``device``: the real step cost with nothing downloaded and no weights copied from the host.

    Its speech is noise; its text comes from the tiny tokenizer (the ids past its pieces decode as
    nothing).  For benchmarks on a GPU; on a CPU the 7B model takes minutes a step.
    """
    import sentencepiece
    import torch

    if architecture != "moshi-7b":
        raise ValueError(f"no random architecture {architecture!r}")
    models = import_moshi(device)
    loaders = models.loaders
    dtype = dtype or torch.bfloat16
    devices = [torch.device(device)] if device.startswith("cuda") else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        if devices:
            torch.cuda.manual_seed(seed)
        mimi = loaders.get_mimi(None, device=device)
        _randomise_codebooks(mimi, torch.Generator().manual_seed(seed + 1))
        mimi = mimi.to(device)  # the codebooks' fresh tensors were made on the host
        # No file: the LM's parameters are initialised where they live (``LMModel(device=...)``).
        lm = loaders.get_moshi_lm(None, device=device, dtype=dtype)
    lm.eval()
    tokenizer = sentencepiece.SentencePieceProcessor(model_proto=train_tokenizer(seed))
    return mimi, lm, tokenizer
