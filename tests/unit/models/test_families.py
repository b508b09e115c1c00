"""The supported-family check (spmdrl/models/families.py) and where a run applies it: before anything
is built, from the model's config.json alone, naming the supported architectures."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from spmdrl.config import Config, ConfigError
from spmdrl.models.families import FAMILIES, SUPPORTED_ARCHITECTURES, check_architecture, family_of
from spmdrl.models.load import check_model_path
from spmdrl.preflight import check_inputs, check_model


def _model_dir(path: Path, **config: object) -> Path:
    """A directory that passes the file checks: config.json with ``config`` and an (empty) safetensors."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"")
    return path


# The (architecture, model_type) pairs released checkpoints of each family carry.
RELEASED = [
    ("LlamaForCausalLM", "llama"),
    ("Qwen2ForCausalLM", "qwen2"),
    ("Qwen3ForCausalLM", "qwen3"),
    ("MistralForCausalLM", "mistral"),
    ("Gemma2ForCausalLM", "gemma2"),
    ("Gemma3ForCausalLM", "gemma3_text"),
    ("Qwen3MoeForCausalLM", "qwen3_moe"),
]


@pytest.mark.parametrize(("arch", "model_type"), RELEASED)
def test_each_supported_family_passes(tmp_path: Path, arch: str, model_type: str) -> None:
    d = _model_dir(tmp_path / "m", architectures=[arch], model_type=model_type, tie_word_embeddings=True)
    assert check_architecture(d).architecture == arch
    assert check_model(str(d), "model.path") == f"model.path={d} (a local directory)"
    assert arch in SUPPORTED_ARCHITECTURES


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
        ({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"}, "Qwen2MoeForCausalLM"),
        # An actor that is not a causal LM (a reward model's head) is refused too.
        ({"architectures": ["LlamaForSequenceClassification"], "model_type": "llama"}, "LlamaFor"),
        # The architecture alone does not decide: transformers builds the trainer from model_type.
        ({"architectures": ["LlamaForCausalLM"], "model_type": "phi3"}, "model_type 'phi3'"),
        ({"model_type": "phi3"}, "model_type 'phi3'"),
    ],
)
def test_an_unsupported_architecture_is_refused_naming_the_supported_ones(
    tmp_path: Path, config: dict, named: str
) -> None:
    d = _model_dir(tmp_path / "m", **config)
    with pytest.raises(ConfigError) as e:
        check_model_path(str(d))
    msg = str(e.value)
    assert msg.startswith("model.path: ") and str(d / "config.json") in msg and named in msg, msg
    assert "does not support" in msg
    for family in FAMILIES:
        assert family.architecture in msg and family.name in msg, msg


def test_multimodal_gemma3_says_to_save_the_text_model(tmp_path: Path) -> None:
    d = _model_dir(tmp_path / "m", architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3")
    with pytest.raises(ConfigError, match="text-only Gemma3ForCausalLM.*gemma3_text"):
        check_architecture(d)


def test_untied_gemma2_is_refused_with_the_reason(tmp_path: Path) -> None:
    d = _model_dir(
        tmp_path / "m", architectures=["Gemma2ForCausalLM"], model_type="gemma2", tie_word_embeddings=False
    )
    with pytest.raises(ConfigError, match="tie_word_embeddings=false.*always computes logits from the input"):
        check_architecture(d)
    # Every other family serves an untied head.
    for arch, model_type in RELEASED:
        if arch != "Gemma2ForCausalLM":
            config = {"architectures": [arch], "model_type": model_type, "tie_word_embeddings": False}
            assert family_of(config, where="x").architecture == arch


def test_critic_checkpoints(tmp_path: Path) -> None:
    # A critic saved by a PPO run is a token-classification checkpoint: fine as a critic, not as an actor.
    critic = _model_dir(tmp_path / "c", architectures=["Qwen2ForTokenClassification"], model_type="qwen2")
    assert check_architecture(critic, critic=True).architecture == "Qwen2ForCausalLM"
    with pytest.raises(ConfigError, match="Qwen2ForTokenClassification"):
        check_architecture(critic)
    # Gemma 3 has no token-classification class in transformers: no critic on it.
    gemma3 = _model_dir(tmp_path / "g", architectures=["Gemma3ForCausalLM"], model_type="gemma3_text")
    with pytest.raises(ConfigError, match="critic.model_path: .*no token-classification class"):
        check_model(str(gemma3), "critic.model_path", critic=True)


def test_the_preflight_refuses_before_anything_is_built(tmp_path: Path) -> None:
    """check_inputs (every rank, and --check) reads config.json only: no process group, no model."""
    bad = _model_dir(tmp_path / "bad", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    cfg = Config()
    with pytest.raises(ConfigError, match="model.path: .*GPT2LMHeadModel.*supported architectures"):
        check_inputs(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(bad))))
    # A PPO run whose critic would start from a Gemma 3 actor is refused too; GRPO on it is fine.
    gemma3 = _model_dir(tmp_path / "g3", architectures=["Gemma3ForCausalLM"], model_type="gemma3_text")
    grpo = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(gemma3)))
    check_inputs(grpo)
    ppo = dataclasses.replace(grpo, algorithm=dataclasses.replace(grpo.algorithm, adv_estimator="gae"))
    with pytest.raises(ConfigError, match="critic.model_path unset.*no token-classification class"):
        check_inputs(ppo)


def test_a_config_without_model_type_or_architectures_is_left_to_transformers(tmp_path: Path) -> None:
    assert check_architecture(_model_dir(tmp_path / "m")) is None


def test_a_mixture_of_experts_has_no_critic_and_no_lora_yet(tmp_path: Path) -> None:
    """Qwen3-MoE trains with every weight (GRPO); PPO's critic on it and LoRA are refused at start, saying
    why, for the built-in tiny-moe (before it is built) and for a local checkpoint alike."""
    moe = _model_dir(tmp_path / "moe", architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
    cfg = Config()
    for path in ("tiny-moe", str(moe)):
        grpo = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=path))
        check_inputs(grpo)
        ppo = dataclasses.replace(grpo, algorithm=dataclasses.replace(grpo.algorithm, adv_estimator="gae"))
        with pytest.raises(ConfigError, match="critic.model_path unset.*is a mixture of experts.*no critic"):
            check_inputs(ppo)
        lora = dataclasses.replace(
            grpo, model=dataclasses.replace(grpo.model, lora=dataclasses.replace(grpo.model.lora, rank=8))
        )
        with pytest.raises(ConfigError, match="model.lora: .* mixture of experts.*model.lora.rank=0"):
            check_inputs(lora)
