"""Where a model's files come from: the built-in tiny model, a packaged model (spmdrl.models.packaged), a
local directory, or a hub id."""

from __future__ import annotations

import logging
from pathlib import Path

from spmdrl.models.families import check_architecture

log = logging.getLogger(__name__)

_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def check_model_path(path: str, *, key: str = "model.path", critic: bool = False) -> Path | None:
    """The local model directory ``path`` names, checked to hold config.json and safetensors of a supported
    family (spmdrl.models.families; ``critic``: one a critic can be built on); None for a hub id
    (org/name). Raises FileNotFoundError for a missing directory that is not a hub id either, ConfigError
    for an unsupported architecture. No download, no heavy import: spmdrl.preflight calls it before a run
    starts. ``key`` starts the messages."""
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise FileNotFoundError(
                f"{key}={path}: no config.json in {local}; point it at an HF model directory"
            )
        if not any(local.glob("*.safetensors")):
            raise FileNotFoundError(
                f"{key}={path}: no *.safetensors in {local}; spmdrl loads safetensors only "
                "(convert with transformers' save_pretrained(safe_serialization=True))"
            )
        check_architecture(local, key=key, critic=critic)
        return local
    if path.startswith(("/", ".", "~")) or path.count("/") != 1:
        raise FileNotFoundError(
            f"{key}={path}: no such directory, and it does not look like a hub id (org/name)"
        )
    return None


def resolve_model_path(path: str, cache_dir: Path, *, critic: bool = False) -> Path:
    """A local directory holding config.json + *.safetensors (and the tokenizer).

    ``"tiny"`` builds (once, cached) the deterministic tiny Qwen2, ``"tiny-moe"`` its mixture-of-experts
    sibling (spmdrl.models.tiny); a packaged model's name (``smollm2-135m``) converts (once, cached) the
    checkpoint its installed package ships; an existing directory is used as is; anything else is taken as
    a Hugging Face hub id and downloaded (safetensors only).
    """
    from spmdrl.models.tiny import BUILT_IN_MODELS, ensure_tiny_model

    if path in BUILT_IN_MODELS:
        return ensure_tiny_model(cache_dir, path)
    key = "critic.model_path" if critic else "model.path"
    from spmdrl.models import packaged

    if packaged.is_packaged(path):
        local = packaged.ensure_packaged_model(path, cache_dir, key=key)
        check_architecture(local, key=key, critic=critic)
        return local
    local = check_model_path(path, key=key, critic=critic)
    if local is not None:
        return local
    from huggingface_hub import snapshot_download

    log.info("downloading %s from the hub (safetensors and tokenizer files)", path)
    try:
        downloaded = Path(snapshot_download(path, allow_patterns=_HUB_PATTERNS))
    except Exception as e:  # noqa: BLE001 - re-raised with the fix
        raise RuntimeError(
            f"model.path={path}: could not download from the hub ({type(e).__name__}: {e}). Offline? "
            "Download it elsewhere and set model.path to the local directory."
        ) from e
    check_architecture(downloaded, key=key, critic=critic)
    return downloaded


def resolve_model_path_all_ranks(path: str, cache_dir: Path, *, critic: bool = False) -> Path:
    """resolve_model_path with rank 0 going first (one download / one build or conversion), the others after it (waiting
    outside any collective, so a long download does not count against the collective timeout)."""
    import torch.distributed as dist

    from spmdrl.distributed.env import wait_for

    main = not dist.is_initialized() or dist.get_rank() == 0
    if main:
        resolved = resolve_model_path(path, cache_dir, critic=critic)
    wait_for("model-files", writer=main)
    if not main:
        resolved = resolve_model_path(path, cache_dir, critic=critic)
    return resolved


def load_tokenizer(model_dir: Path, trust_remote_code: bool = False):  # noqa: ANN201 - HF tokenizer type
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        # Padding is masked out everywhere; any id works, and eos is always present.
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        raise ValueError(
            f"{model_dir}: the tokenizer has no chat_template; spmdrl applies the chat template to prompts"
        )
    return tok


def load_processor(model_dir: Path, trust_remote_code: bool = False):  # noqa: ANN201 - HF processor type
    """A vision-language model's processor (its image processor and tokenizer: spmdrl.data.vision), None
    for a text model."""
    from transformers import AutoConfig, AutoProcessor

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    if getattr(config, "vision_config", None) is None:
        return None
    try:
        return AutoProcessor.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as e:
        raise ValueError(
            f"{model_dir}: a vision-language model without a processor spmdrl can load ({type(e).__name__}: "
            f"{e}); save the model's processor (processor_config.json, the image processor's config) with it"
        ) from e
