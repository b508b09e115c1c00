"""model.router_replay's start checks (spmdrl.preflight.check_router_replay), run as ``--check`` runs them
(``parse_config([..., "--check"])`` in this process), and the Qwen3-30B-A3B recipe validated on 8 ranks
from a local directory holding its config.json (and a one-tensor safetensors file: --check reads headers
only), so nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spmdrl.train import parse_config

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "recipe" / "grpo_moe_30b_a3b.yaml"
TINY_DATA = ["data.train_files=[tiny:train]", "data.val_files=[tiny:test]"]

# Qwen3-30B-A3B's config.json (the fields spmdrl and transformers read).
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)


def _check(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        parse_config([*args, "--check"])
    out = capsys.readouterr()
    return int(exit_info.value.code or 0), out.out, out.err


def _config_only(tmp_path: Path, config: dict) -> Path:
    from safetensors.torch import save_file

    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    save_file({"model.norm.weight": torch.ones(1)}, str(d / "model.safetensors"))
    return d


def test_r3_on_a_dense_model_is_refused_with_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _check(["recipe=grpo_tiny", "model.router_replay=r3"], capsys)
    assert code == 2
    assert "model.router_replay=r3: model.path=tiny is a dense model" in err
    assert "set model.router_replay=disabled, or train a mixture of experts (model.path=tiny-moe" in err


def test_r3_where_the_engine_returns_no_routing_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _check(
        ["recipe=grpo_moe_tiny", "model.router_replay=r3", "rollout.model_runner=v1"], capsys
    )
    assert code == 2
    assert "model.router_replay=r3 is not supported with rollout.model_runner=v1" in err
    assert "set model.router_replay=disabled" in err


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"partial": "continue"}, "rollout.partial=continue"),
        ({"model_runner": "v1"}, "rollout.model_runner=v1"),
    ],
)
def test_each_rollout_path_without_routing_is_named(changes: dict, named: str) -> None:
    from spmdrl.config import RolloutConfig
    from spmdrl.distributed.config import ParallelConfig
    from spmdrl.errors import ConfigError
    from spmdrl.models.config import ModelConfig
    from spmdrl.preflight import check_router_replay

    model = ModelConfig(path="tiny-moe", router_replay="r3")
    with pytest.raises(ConfigError, match=f"is not supported with {named}"):
        check_router_replay(model, RolloutConfig(**changes), ParallelConfig(), "")
    assert check_router_replay(model, RolloutConfig(), ParallelConfig(), "") == "model.router_replay=r3"


@pytest.mark.parametrize("parallel", [{"balance_tokens": True}, {"teacher_ranks": 1}])
def test_r3_where_the_rows_move_between_ranks_is_accepted(parallel: dict) -> None:
    """The routing travels with its rows (PolicyBatch.tensors packs it), so the placements that move rows
    after the rollout keep router replay."""
    from spmdrl.config import RolloutConfig
    from spmdrl.distributed.config import ParallelConfig
    from spmdrl.models.config import ModelConfig
    from spmdrl.preflight import check_router_replay

    model = ModelConfig(path="tiny-moe", router_replay="r3")
    got = check_router_replay(model, RolloutConfig(), ParallelConfig(**parallel), "")
    assert got == "model.router_replay=r3"


def test_r3_on_tiny_moe_passes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _check(["recipe=grpo_moe_tiny", "model.router_replay=r3"], capsys)
    assert code == 0 and "model.router_replay=r3" in out


def test_the_30b_a3b_recipe_checks_on_8_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _config_only(tmp_path, QWEN3_30B_A3B)
    code, out, err = _check(
        [f"recipe={RECIPE}", f"model.path={model}", *TINY_DATA, "--world-size", "8"], capsys
    )
    assert code == 0, err
    assert "recipe grpo_moe_30b_a3b" in out and "model.router_replay=r3" in out
    assert "plan on 8 ranks" in out and "actor: ranks 0-7 (FSDP 8, experts EP 8 x FSDP 1)" in out
    assert "parallel.ep=8 (16 of 128 experts per rank)" in out
