"""Multi-turn rollout pieces without an engine: tool-output positions never reach the loss, a tool
instance lives for its trajectory, the multi-turn settings are checked at load."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from spmdrl.rl.batch import pack_generations
from spmdrl.rollout.engine import Generation


def test_logits_at_mask_zero_positions_do_not_reach_the_loss() -> None:
    """Changing the logits where the next token is tool output leaves the loss and every gradient
    bitwise equal (the recipe's own micro-batch loss, on a small random Qwen2)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from spmdrl.algos.aggregation import Aggregation
    from spmdrl.config import Config
    from spmdrl.models.forward import scored_positions
    from spmdrl.rl.settings import update_settings
    from spmdrl.rl.update import micro_batch_loss

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=64,
        )
    )
    gens = [
        Generation(0, [5, 6, 7, 8, 9, 10, 11], [-1.0] * 7, "stop", loss_mask=[1, 1, 0, 0, 0, 1, 1]),
        Generation(1, [12, 13, 14, 15], [-1.0] * 4, "stop", loss_mask=[1, 0, 0, 1]),
    ]
    rows = pack_generations([[1, 2, 3], [1, 4]], gens, pad_id=0)
    assert rows.response_mask_BT[0].tolist() == [False] * 3 + [True, True, False, False, False, True, True]
    from spmdrl.rl.batch import PolicyBatch

    mb = PolicyBatch(
        input_ids_BT=rows.input_ids_BT,
        attention_mask_BT=rows.attention_mask_BT,
        response_mask_BT=rows.response_mask_BT,
        engine_logprobs_BT=rows.engine_logprobs_BT,
        advantages_BT=torch.randn(rows.input_ids_BT.shape),
        old_logprobs_BT=rows.engine_logprobs_BT,
        ref_logprobs_BT=rows.engine_logprobs_BT - 0.1,  # the KL loss term too (use_kl_loss)
    )
    cfg = Config()
    mask = mb.response_mask_BT

    def run(noise: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        handle = None
        if noise:

            def hook(module, args, out):  # noqa: ANN001, ANN202
                # The head runs on the positions that predict a scored token (spmdrl.models.head): row n
                # of its (N, V) output predicts the token at flat index scored[n] of (B, T). Without a
                # plan every row is scored from the batch's first response column to T. The model's own
                # head call gets an empty index and is left alone.
                if not out.numel():
                    return out
                B, T = mask.shape
                first = mb.first_response_column()
                scored = torch.tensor(scored_positions(T, [T] * B, [first] * B))
                assert out.shape[0] == scored.numel()
                hit = ~mask.reshape(-1)[scored]
                assert hit.any(), "no scored position predicts a tool token: the test would test nothing"
                return out + 5.0 * torch.randn_like(out) * hit.unsqueeze(-1)

            handle = model.lm_head.register_forward_hook(hook)
        agg = Aggregation("token-mean", float(mask.sum()))
        loss = micro_batch_loss(update_settings(cfg), model, mb, agg).loss
        loss.backward()
        if handle is not None:
            handle.remove()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    base_loss, base_grads = run(False)
    noisy_loss, noisy_grads = run(True)
    assert torch.equal(base_loss, noisy_loss)
    assert all(torch.equal(a, b) for a, b in zip(base_grads, noisy_grads, strict=True))


def test_tool_instance_lives_for_the_trajectory() -> None:
    from spmdrl.tools import BaseTool, ToolCall, ToolExecutor, ToolResult

    events: list[str] = []

    class Counter(BaseTool):
        def create(self, instance_id: str, **kwargs: Any) -> str:
            events.append("create")
            self.instances[instance_id] = 0
            return instance_id

        def execute(self, instance_id: str, arguments: dict) -> ToolResult:
            self.instances[instance_id] += 1
            return ToolResult(str(self.instances[instance_id]))

        def release(self, instance_id: str) -> None:
            events.append("release")
            self.instances.pop(instance_id)

    schema = {
        "type": "function",
        "function": {
            "name": "count",
            "description": "counts",
            "parameters": {"type": "object", "properties": {}},
        },
    }
    ex = ToolExecutor([Counter({}, schema)])
    session = ex.open_session(None)
    texts = [o.text for turn in range(3) for o in ex.run([ToolCall("count", {})], session=session)]
    assert texts == ["1", "2", "3"] and events == ["create"]
    ex.close_session(session)
    assert events == ["create", "release"]


def test_multi_turn_config_is_checked_at_start() -> None:
    from spmdrl.config_loader import load_config
    from spmdrl.errors import ConfigError

    cfg = load_config(
        ["recipe=grpo_tiny", "rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]"]
    )
    assert cfg.rollout.multi_turn.tools == ["calculator"]
    with pytest.raises(ConfigError, match="needs tools"):
        load_config(["recipe=grpo_tiny", "rollout.multi_turn.enable=true"])
    with pytest.raises(ConfigError, match="collective_timeout_min"):
        load_config(
            [
                "recipe=grpo_tiny",
                "rollout.multi_turn.enable=true",
                "rollout.multi_turn.tools=[calculator]",
                "rollout.multi_turn.rollout_deadline_s=100000",
            ]
        )
    with pytest.raises(ConfigError, match="scheduler"):
        load_config(["recipe=grpo_tiny", "rollout.multi_turn.scheduler=barrier"])
