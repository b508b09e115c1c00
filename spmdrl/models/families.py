"""The decoder families spmdrl trains, serves and exports, and the check that refuses the others at start.

A family is supported when the trainer (transformers' class under FSDP2), the in-process engine (vLLM's
class), the weight sync with its per-step check, checkpoints and export all work for it, which
``tests/integration/test_model_families.py`` verifies on a small random model of each (see
docs/models.md). Anything else may fail anywhere from the first sync to an export that loads with the
wrong weights, so :func:`check_architecture` refuses it where the model's config.json is first read
(spmdrl.preflight, before any process group or model), naming the supported architectures.

Light on purpose: no torch, no transformers (the preflight imports it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from spmdrl.errors import ConfigError


@dataclass(frozen=True)
class Family:
    name: str
    # config.json's "model_type": what transformers builds the trainer's class from.
    model_type: str
    # config.json's "architectures" entry (what vLLM builds the engine's class from) of a causal-LM checkpoint of this family.
    architecture: str
    # transformers' token-classification class, the critic's (None: the family has none, so no PPO critic).
    critic_architecture: str | None
    # Whether an untied LM head (tie_word_embeddings=false) is served correctly by vLLM.
    untied_ok: bool = True
    why_not_untied: str = ""
    # A mixture of experts (spmdrl.models.experts; docs/models.md: what is and is not supported for them).
    moe: bool = False
    # Why the family has no critic, where critic_architecture is None.
    why_no_critic: str = "has no token-classification class in transformers"
    # A vision-language model: a vision tower beside the decoder (docs/models.md#vision-language-models).
    vision: bool = False


FAMILIES = (
    Family("Llama 3.x", "llama", "LlamaForCausalLM", "LlamaForTokenClassification"),
    Family("Qwen2 / Qwen2.5", "qwen2", "Qwen2ForCausalLM", "Qwen2ForTokenClassification"),
    Family("Qwen3 (dense)", "qwen3", "Qwen3ForCausalLM", "Qwen3ForTokenClassification"),
    Family("Mistral", "mistral", "MistralForCausalLM", "MistralForTokenClassification"),
    Family(
        "Gemma 2",
        "gemma2",
        "Gemma2ForCausalLM",
        "Gemma2ForTokenClassification",
        untied_ok=False,
        # vLLM 0.32's Gemma2ForCausalLM computes logits from embed_tokens whatever the config says.
        why_not_untied="vLLM's Gemma2ForCausalLM always computes logits from the input embedding",
    ),
    # Text-only Gemma 3 (model_type gemma3_text). transformers has no Gemma3ForTokenClassification.
    Family("Gemma 3 (text)", "gemma3_text", "Gemma3ForCausalLM", None),
    # transformers has Qwen3MoeForTokenClassification, but a critic of this family is untested here.
    Family(
        "Qwen3 MoE",
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        None,
        moe=True,
        why_no_critic="is a mixture of experts, and spmdrl does not build a critic (PPO's value model) on one yet",
    ),
    # SmolVLM's architecture (a SigLIP tower, pixel shuffle, a Llama decoder); the built-in tiny-vl is one.
    Family(
        "Idefics3 / SmolVLM (vision-language)",
        "idefics3",
        "Idefics3ForConditionalGeneration",
        None,
        vision=True,
        why_no_critic="is a vision-language model, and spmdrl builds no critic (PPO's value model) on one",
    ),
)

SUPPORTED_ARCHITECTURES = tuple(f.architecture for f in FAMILIES)
# Every family's decoder linear modules, by their last name: what model.lora.target_modules may name (checked
# here, at start, before any model; spmdrl.models.lora checks the built model itself).
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES}
# Vision-language architectures users ask for that are not supported yet (their message says why).
_TORCHVISION_VLMS = (
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "LlavaForConditionalGeneration",
)
_BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES}
_BY_CRITIC_ARCHITECTURE = {f.critic_architecture: f for f in FAMILIES if f.critic_architecture}


def lora_on_moe_message(what: str) -> str:
    """Why a LoRA run on a mixture of experts is refused (at start, and where the model is built)."""
    return (
        f"model.lora: {what} is a mixture of experts, and LoRA on one is not supported yet (its experts are "
        "3-D tensors, not linear layers an adapter can wrap); train every weight (model.lora.rank=0) "
        "(docs/models.md, Mixture of experts)"
    )


def check_ep(num_experts: int | None, ep: int, where: str) -> None:
    """parallel.ep against the model: an MoE whose expert count ep divides. ConfigError naming the fix."""
    if ep == 1:
        return
    if num_experts is None:
        raise ConfigError(
            f"parallel.ep={ep} places experts on ranks, but {where} is a dense model (no mixture of experts): "
            "set parallel.ep=1"
        )
    if num_experts % ep:
        divisors = ", ".join(str(d) for d in range(1, num_experts + 1) if num_experts % d == 0)
        raise ConfigError(
            f"parallel.ep={ep} must divide the {num_experts} experts of each layer of {where} (each rank of "
            f"an ep group holds num_experts / ep of them): pick one of {divisors} that divides the actor's "
            "ranks"
        )


def supported_list() -> str:
    return ", ".join(f"{f.architecture} ({f.name})" for f in FAMILIES)


def family_of(config: dict, *, where: str, key: str = "model.path", critic: bool = False) -> Family | None:
    """The family of a checkpoint whose config.json holds ``config``; raises ConfigError naming the
    supported architectures if it is none of them (or, for ``critic``, if the family has no critic class).

    Both fields that choose code are checked: ``model_type`` (transformers' class, the trainer) and
    ``architectures`` (vLLM's class, the engine). A config with neither is left to transformers, which
    refuses it when it loads. ``where``: the file, for the message. A critic (``critic.model_path``) may
    also be a token-classification checkpoint of a supported family (a critic saved by a PPO run)."""
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    if model_type is None and not archs:
        return None
    arch = str(archs[0]) if isinstance(archs, list) and archs else None
    family = None
    if arch is not None:
        family = _BY_ARCHITECTURE.get(arch) or (_BY_CRITIC_ARCHITECTURE.get(arch) if critic else None)
    elif model_type is not None:
        family = _BY_MODEL_TYPE.get(str(model_type))
    if family is not None and model_type is not None and model_type != family.model_type:
        family = None  # e.g. a Llama architecture over another model_type: trainer and engine would differ
    if family is None:
        what = arch or f"model_type {model_type!r}"
        hint = ""
        if arch in _TORCHVISION_VLMS:
            hint = (
                " (a vision-language model whose vLLM class imports torchvision's image processors; spmdrl "
                "supports the Idefics3 / SmolVLM architecture so far: docs/models.md#vision-language-models)"
            )
        elif arch == "Gemma3ForConditionalGeneration":
            hint = (
                " (the multimodal Gemma 3; spmdrl trains the text-only Gemma3ForCausalLM: save the "
                "language model alone, model_type gemma3_text)"
            )
        elif model_type is not None and arch is not None:
            hint = f" with model_type {model_type!r}"
        raise ConfigError(
            f"{key}: {where} is a {what}{hint}, which spmdrl does not support; supported architectures: "
            f"{supported_list()}"
        )
    if critic and family.critic_architecture is None:
        raise ConfigError(
            f"{key}: {where} is a {family.architecture}, which {family.why_no_critic}, so no critic (PPO's "
            "value model) can be built on it; families with one: "
            f"{', '.join(f.name for f in FAMILIES if f.critic_architecture)}"
        )
    if not config.get("tie_word_embeddings", True) and not family.untied_ok:
        raise ConfigError(
            f"{key}: {where} is a {family.architecture} with tie_word_embeddings=false, which the engine "
            f"cannot serve ({family.why_not_untied}); every released checkpoint of this family is tied"
        )
    return family


def check_architecture(model_dir: Path, *, key: str = "model.path", critic: bool = False) -> Family | None:
    """:func:`family_of` for the config.json in ``model_dir``."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: cannot read {path} ({type(e).__name__}: {e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{key}: {path} is not a JSON object")
    return family_of(config, where=str(path), key=key, critic=critic)
