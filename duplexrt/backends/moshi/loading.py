"""Finding a checkpoint: a local directory in Kyutai's layout, or a Hugging Face repository.

A directory holds ``config.json`` (the LM's arguments and the names of the other files), the LM
weights, Mimi's weights (and optionally Mimi's own config) and the sentencepiece text tokenizer.
Every name is resolved inside the directory and handed to ``CheckpointInfo`` as a path, so loading
a directory never touches the network, whatever the names say.

A repository id (``kyutai/moshiko-pytorch-bf16``) is read from the local Hugging Face cache when
it is there; otherwise the hub is asked, but only after a quick check that it can be reached, so
that an offline machine gets a clear error at once instead of a minute of retries.
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from duplexrt.config import ConfigError

KEY = "backend.options.checkpoint"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
#: The hub's address; None: the one huggingface_hub is configured with.  Tests point it elsewhere.
HUB_ENDPOINT: str | None = None
#: How long the reachability check may take.
PROBE_TIMEOUT_S = 3.0


def looks_like_path(spec: str) -> bool:
    """Whether ``spec`` can only be meant as a directory (not a repository id)."""
    return not _REPO_ID.match(spec) or Path(spec).expanduser().exists()


def _names(config: dict[str, Any], loaders: Any) -> dict[str, str | None]:
    return {
        "LM weights": config.get("moshi_name", loaders.MOSHI_NAME),
        "Mimi weights": config.get("mimi_name", loaders.MIMI_NAME),
        "text tokenizer": config.get("tokenizer_name", loaders.TEXT_TOKENIZER_NAME),
        "Mimi config": config.get("mimi_config_name"),
        "LoRA weights": config.get("lora_name"),
    }


def _inside(directory: Path, name: str) -> Path:
    """Where ``name`` (from config.json) lives: a file:// path if it exists, else the directory."""
    if name.startswith("file://"):
        path = Path(urlparse(name).path if name.startswith("file:///") else name.removeprefix("file://"))
        if path.is_absolute() and path.exists():
            return path
        return directory / path.name
    return directory / name


def from_directory(directory: Path, loaders: Any) -> Any:
    """``CheckpointInfo`` for a local directory; ConfigError naming whatever is missing."""
    directory = directory.expanduser().resolve()
    config_path = directory / "config.json"
    config: dict[str, Any] = {}
    if config_path.exists():
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{KEY}: {config_path} is not readable JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ConfigError(f"{KEY}: {config_path} must hold a JSON object")
    paths: dict[str, Path | None] = {}
    for what, name in _names(config, loaders).items():
        if name is None:
            paths[what] = None
        elif name.startswith("hf://"):
            raise ConfigError(f"{KEY}: {config_path} names its {what} as {name!r}, in another "
                              "repository; copy that file into the directory and name it there")
        else:
            paths[what] = _inside(directory, name)
    missing = [f"{what} ({path.name})" for what, path in paths.items() if path is not None and not path.is_file()]
    if missing:
        have = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
        raise ConfigError(
            f"{KEY}: the checkpoint directory {directory} lacks {', '.join(missing)}"
            f"{'' if config else ' (it has no config.json, so the legacy Moshi 7B names were expected)'}; "
            f"it holds: {', '.join(have) or 'nothing'}"
        )
    if not config:
        return loaders.CheckpointInfo(paths["LM weights"], paths["Mimi weights"], paths["text tokenizer"])
    return loaders.CheckpointInfo.from_hf_repo(
        str(directory), moshi_weights=paths["LM weights"], mimi_weights=paths["Mimi weights"],
        tokenizer=paths["text tokenizer"], config_path=config_path,
        mimi_config_path=paths["Mimi config"], lora_weights=paths["LoRA weights"],
    )


def hub_offline_reason() -> str | None:
    """Why the hub cannot be asked now (None: it answered a connection)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}:
        return "HF_HUB_OFFLINE is set"
    endpoint = HUB_ENDPOINT or constants.ENDPOINT
    if HUB_ENDPOINT is None and any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # through a proxy a direct connection proves nothing: let the hub client try
    parsed = urlparse(endpoint)
    host = parsed.hostname or ""
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
            return None
    except OSError as exc:
        return f"{endpoint} cannot be reached ({exc.strerror or exc})"


def from_hub(repo: str, loaders: Any) -> Any:
    """``CheckpointInfo`` for a hub repository: from the local cache, else downloaded."""
    from huggingface_hub import constants, hf_hub_download

    cache = constants.HF_HUB_CACHE
    files: dict[str, Path | None] = {}

    def cached(filename: str) -> Path | None:
        try:
            return Path(hf_hub_download(repo, filename, local_files_only=True))
        except Exception:
            return None

    config_file = cached("config.json")
    config: dict[str, Any] = json.loads(config_file.read_text()) if config_file is not None else {}
    # Without a cached config.json, the legacy Moshi 7B names (repositories that have none).
    names = _names(config, loaders)
    for what, name in names.items():
        if name is not None and not name.startswith(("hf://", "file://")):
            files[what] = cached(name)
    if all(path is not None for path in files.values()):
        if config_file is not None:
            return from_directory(config_file.parent, loaders)
        return loaders.CheckpointInfo(files["LM weights"], files["Mimi weights"], files["text tokenizer"])
    reason = hub_offline_reason()
    if reason is not None:
        absent = ([] if config_file is not None else ["config.json"]) + [
            f"{what} ({names[what]})" for what, path in files.items() if path is None]
        raise ConfigError(
            f"{KEY} = {repo!r}: there is no such local directory ({Path(repo).resolve()}), and as a "
            f"Hugging Face repository it is not in the local cache ({cache}: missing "
            f"{', '.join(absent)}) while the hub is offline: {reason}.  Download it where the hub "
            f"is reachable (huggingface-cli download {repo}) and set {KEY} to that directory, "
            "or set backend.options.tiny = true for the tiny random model"
        )
    try:
        return loaders.CheckpointInfo.from_hf_repo(repo)
    except Exception as exc:
        raise ConfigError(f"{KEY} = {repo!r}: the Hugging Face hub could not provide it: {exc}") from None


def resolve(spec: str, loaders: Any) -> Any:
    """``CheckpointInfo`` for the ``checkpoint`` option: a directory, or a repository id."""
    path = Path(spec.removeprefix("file://")).expanduser()
    if path.is_dir():
        return from_directory(path, loaders)
    if looks_like_path(spec):
        raise ConfigError(f"{KEY}: no checkpoint directory at {path.resolve()}")
    return from_hub(spec, loaders)


#: The files of a PersonaPlex repository the backend reads (the voices come as one archive).
PERSONAPLEX_FILES = ("model.safetensors", "tokenizer-e351c8d8-checkpoint125.safetensors",
                     "tokenizer_spm_32k_3.model", "voices.tgz")


def personaplex_directory(spec: str) -> Path:
    """The directory holding a PersonaPlex checkpoint: ``spec`` itself, or a hub repository's
    files in the local cache (downloaded first where the hub is reachable; a clear error where
    it is not).  NVIDIA's repository is gated: accept its licence on the hub and log in first."""
    path = Path(spec.removeprefix("file://")).expanduser()
    if path.is_dir():
        return path.resolve()
    if looks_like_path(spec):
        raise ConfigError(f"{KEY}: no checkpoint directory at {path.resolve()}")
    from huggingface_hub import hf_hub_download

    found: dict[str, Path] = {}
    for name in PERSONAPLEX_FILES:
        try:
            found[name] = Path(hf_hub_download(spec, name, local_files_only=True))
        except Exception:
            continue
    if len(found) < len(PERSONAPLEX_FILES):
        reason = hub_offline_reason()
        if reason is not None:
            missing = [name for name in PERSONAPLEX_FILES if name not in found]
            raise ConfigError(
                f"{KEY} = {spec!r}: no such local directory, and the repository's {', '.join(missing)} "
                f"are not in the local Hugging Face cache while the hub is offline: {reason}.  Download it "
                f"where the hub is reachable (huggingface-cli download {spec}) and set {KEY} to that "
                "directory, or use the personaplex-tiny preset")
        for name in PERSONAPLEX_FILES:
            if name not in found:
                try:
                    found[name] = Path(hf_hub_download(spec, name))
                except Exception as exc:
                    raise ConfigError(f"{KEY} = {spec!r}: the Hugging Face hub could not provide {name}: {exc} "
                                      "(NVIDIA's repository is gated: accept its licence and log in)") from None
    return found[PERSONAPLEX_FILES[0]].parent
