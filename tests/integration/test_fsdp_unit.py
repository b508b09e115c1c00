"""model.fsdp_unit: the whole model as one FSDP2 unit trains bit for bit as per-layer units do, with less
host work per micro-batch, frees its gathered copy after a no-grad pass, and auto takes it only on a
one-rank mesh (spmdrl.models.parallelize.apply_fsdp, spmdrl.models.memory_model.whole_model_unit); none
(no FSDP2, the bare module under autocast: spmdrl.models.parallelize.apply_autocast) trains as that unit
does in float32, in fewer ATen ops, and under bf16 autocast close to FSDP2's bf16 parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmdrl.testing.models import save_small_qwen2
from spmdrl.testing.spawn import run_distributed, run_side_by_side

pytestmark = pytest.mark.slow

VOCAB = 96


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (4, 16), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 11:] = 0
    return ids, attn


def _aten_ops(fn: object) -> int:
    from torch.profiler import profile

    with profile() as prof:
        fn()  # type: ignore[operator]
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def _worker(
    rank: int, world_size: int, model_dir: str, unit: str, fused_chunk: int, dtype: str = "float32"
) -> dict[str, object]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.models.forward import policy_logprobs
    from spmdrl.models.parallelize import decoder_layers, gathered_through

    torch.manual_seed(0)
    model = build_fsdp_model(
        ModelSpec(Path(model_dir), getattr(torch, dtype), torch.float32, fsdp_unit=unit),
        Placement.colocated(world_size).build_meshes("cpu").fsdp("actor"),
        torch.device("cpu"),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    ids, attn = _rows()
    with torch.no_grad():  # the first logprobs, before any step
        first_logprobs, _ = policy_logprobs(model, ids, attn, first_column=4, fused_chunk_tokens=fused_chunk)
    first_loss = -(first_logprobs * attn).sum() / attn.sum()
    first_loss_grads = {}
    loss_value = (
        -(policy_logprobs(model, ids, attn, first_column=4, fused_chunk_tokens=fused_chunk)[0] * attn).sum()
        / attn.sum()
    )
    loss_value.backward()
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        first_loss_grads[name.replace("._checkpoint_wrapped_module", "")] = grad.detach().clone()
    param_dtypes = sorted({str(p.dtype) for p in model.parameters()})
    opt.zero_grad(set_to_none=True)

    def loss() -> torch.Tensor:
        lp, _ = policy_logprobs(model, ids, attn, first_column=4, fused_chunk_tokens=fused_chunk)
        return -(lp * attn).sum() / attn.sum()

    losses = []
    for _ in range(3):
        value = loss()
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(value.item())
    with torch.no_grad():
        policy_logprobs(model, ids, attn, first_column=4, fused_chunk_tokens=fused_chunk)
    sharded_after_no_grad = all(isinstance(p, DTensor) for p in model.parameters())
    with torch.no_grad(), gathered_through(model):  # a pass of two micro-batches
        policy_logprobs(model, ids, attn, first_column=4, fused_chunk_tokens=fused_chunk)
        kept_within_pass = not any(isinstance(p, DTensor) for p in model.parameters())
        policy_logprobs(model, ids, attn, first_column=4, fused_chunk_tokens=fused_chunk)
    sharded_after_pass = all(isinstance(p, DTensor) for p in model.parameters())
    ops = _aten_ops(lambda: loss().backward())
    opt.zero_grad(set_to_none=True)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {
        "fsdp_modules": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "param_dtypes": param_dtypes,
        "first_logprobs": first_logprobs,
        "first_loss": float(first_loss),
        "first_grads": first_loss_grads,
        "layer_units": sum(isinstance(layer, FSDPModule) for layer in decoder_layers(model)),
        "losses": losses,
        "state": state,
        "sharded_after_no_grad": sharded_after_no_grad,
        "kept_within_pass": kept_within_pass,
        "sharded_after_pass": sharded_after_pass,
        "ops": ops,
    }


@pytest.mark.parametrize("fused_chunk", [0, 8])
def test_whole_model_unit_trains_as_layer_units(tmp_path: Path, fused_chunk: int) -> None:
    """One rank: auto is the whole-model unit; it reaches the same losses and weights to the last bit as
    per-layer units (the same kernels in the same order, only fewer gathers), with the LM head's chunked
    backward (fused_chunk 8) too, in fewer ATen ops per forward + backward, and leaves no gathered copy
    after a no-grad forward, or after a pass of several (gathered_through: gathered once for it)."""
    save_small_qwen2(tmp_path / "m", vocab_size=VOCAB)
    (layer,), (auto,) = run_side_by_side(
        _worker, 1, [(str(tmp_path / "m"), u, fused_chunk) for u in ("layer", "auto")]
    )
    assert layer["layer_units"] > 0 and auto["layer_units"] == 0, "auto on one rank: one unit, no layer units"
    assert auto["losses"] == layer["losses"]
    assert layer["losses"][-1] < layer["losses"][0], "the run must learn, or equal losses prove little"
    for name, tensor in layer["state"].items():
        assert torch.equal(auto["state"][name], tensor), name
    assert auto["sharded_after_no_grad"], "a no-grad forward must not leave the whole model gathered"
    assert auto["kept_within_pass"] and auto["sharded_after_pass"], "gathered once for a pass, then freed"
    assert auto["ops"] < layer["ops"], (auto["ops"], layer["ops"])


@pytest.mark.parametrize("fused_chunk", [0, 8])
def test_no_fsdp2_trains_as_the_one_rank_unit(tmp_path: Path, fused_chunk: int) -> None:
    """model.fsdp_unit=none on one rank: no FSDP2 module at all, the tied LM head still the embedding, and
    in float32 the same first logprobs and gradients to the last bit as FSDP2's whole-model unit (the same
    kernels; its gather is a copy, its reduce over one rank a sum of one), the same three AdamW steps
    within float32 rounding, in fewer ATen ops per forward + backward (no gather, no reduce)."""
    save_small_qwen2(tmp_path / "m", vocab_size=VOCAB)
    (unit,), (bare,) = run_side_by_side(
        _worker, 1, [(str(tmp_path / "m"), u, fused_chunk) for u in ("auto", "none")]
    )
    assert unit["fsdp_modules"] == 1 and bare["fsdp_modules"] == 0
    assert bare["tied"] and unit["tied"]
    assert torch.equal(bare["first_logprobs"], unit["first_logprobs"])
    for name, grad in unit["first_grads"].items():
        assert torch.equal(bare["first_grads"][name], grad), name
    assert bare["losses"] == pytest.approx(unit["losses"], rel=1e-6)
    assert unit["losses"][-1] < unit["losses"][0]
    for name, tensor in unit["state"].items():
        torch.testing.assert_close(bare["state"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    assert bare["ops"] < unit["ops"], (bare["ops"], unit["ops"])


def test_no_fsdp2_under_bf16_autocast(tmp_path: Path) -> None:
    """param_dtype bfloat16 (CUDA's default, forced on CPU): the bare module keeps float32 parameters (and
    float32 gradients) and computes under bf16 autocast; FSDP2 computes on bf16 copies of its float32
    shards. Not the same numbers, but the same model: the first logprobs within bf16's rounding of each
    other, the gradients pointing the same way, and both learn; with the chunked head, whose inputs are
    cast to bf16 before it under autocast (tests/unit/models/test_head.py: its GEMMs' dtypes)."""
    fused_chunk = 8
    save_small_qwen2(tmp_path / "m", vocab_size=VOCAB)
    runs = [("auto", "bfloat16"), ("none", "bfloat16"), ("none", "float32")]
    (unit,), (bare,), (exact,) = run_side_by_side(
        _worker, 1, [(str(tmp_path / "m"), u, fused_chunk, dtype) for u, dtype in runs]
    )
    assert bare["param_dtypes"] == unit["param_dtypes"] == ["torch.float32"]
    diff = (bare["first_logprobs"] - exact["first_logprobs"]).abs().max()
    unit_diff = (unit["first_logprobs"] - exact["first_logprobs"]).abs().max()
    assert 0 < diff < 0.05 and 0 < unit_diff < 0.05, (diff, unit_diff)  # bf16 rounding, not float32's
    for name, grad in exact["first_grads"].items():
        for run in (bare, unit):
            got = run["first_grads"][name]
            assert got.dtype == torch.float32, name
            cos = torch.nn.functional.cosine_similarity(got.flatten(), grad.flatten(), dim=0)
            assert cos > 0.99, (name, float(cos))
    assert bare["losses"][-1] < bare["losses"][0]


def test_auto_keeps_layer_units_on_two_ranks(tmp_path: Path) -> None:
    """Two ranks: auto shards per layer (the gathers overlap compute there); model makes one unit."""
    save_small_qwen2(tmp_path / "m", vocab_size=VOCAB)
    auto = run_distributed(_worker, 2, str(tmp_path / "m"), "auto", 0)
    whole = run_distributed(_worker, 2, str(tmp_path / "m"), "model", 0)
    assert all(r["layer_units"] > 0 for r in auto)
    assert all(r["layer_units"] == 0 for r in whole)
    assert whole[0]["losses"] == pytest.approx(auto[0]["losses"], rel=1e-6)


def _reward_worker(rank: int, world_size: int, model_dir: str) -> tuple[int, float]:
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.models.parallelize import decoder_layers
    from spmdrl.optim import clip_grad_norm
    from spmdrl.rl.reward_model import sequence_scores

    torch.manual_seed(0)
    model = build_fsdp_model(
        ModelSpec(Path(model_dir), torch.float32, torch.float32, head="reward"),
        Placement.colocated(world_size).build_meshes("cpu").fsdp("actor"),
        torch.device("cpu"),
    )
    model.config.pad_token_id = 0  # transformers pools by it (sequence_scores reads the head's own output)
    ids, attn = _rows()
    sequence_scores(model, ids, attn).sum().backward()
    units = sum(isinstance(layer, torch.distributed.fsdp.FSDPModule) for layer in decoder_layers(model))
    return units, clip_grad_norm(model, 1.0)


def test_whole_model_unit_trains_a_reward_head(tmp_path: Path) -> None:
    """The reward model's scores come from a hook on its head (spmdrl.rl.reward_model.sequence_scores),
    not from the model's outputs: through_outputs still gets the whole-model unit's gradients reduced into
    its parameters (without it clip_grad_norm finds none and stops the run)."""
    save_small_qwen2(tmp_path / "m", vocab_size=VOCAB)
    ((units, norm),) = run_distributed(_reward_worker, 1, str(tmp_path / "m"))
    assert units == 0
    assert norm > 0


JOB = [
    "-m",
    "spmdrl.train",
    "recipe=grpo_tiny",
    "model.fsdp_unit=none",
    "warmstart.total_steps=20",
    "warmstart.global_batch_size=16",
    "warmstart.micro_batch_size=16",
    # A small batch: one process generates and trains all of it.
    "tiny_task.num_train=256",
    "tiny_task.num_test=32",
    "trainer.global_batch_size=8",
    "rollout.n=4",
    "trainer.micro_batch_size=8",
    "trainer.total_steps=3",
    "trainer.val_every=0",
    "trainer.save_hf=false",
    "logging.samples_every=0",
]


def test_the_rl_job_runs_without_fsdp2_on_one_process(tmp_path: Path) -> None:
    """recipe=grpo_tiny with model.fsdp_unit=none on one torchrun process: the warm-start, the engine, the
    update and every step's weight sync and its check (which stops a run whose engine does not serve the
    trained weights) on the bare module, the log saying so; the same on 2 processes is refused at start,
    naming the fix, before any model is built."""
    from spmdrl.logging.metrics import read_metrics
    from spmdrl.testing.launch import torchrun
    from spmdrl.testing.small_runs import cache_env

    out = tmp_path / "one"
    res = torchrun([*JOB, f"trainer.output_dir={out}"], nproc=1, cwd=tmp_path, timeout_s=900, env=cache_env())
    assert res.returncode == 0, res.output[-4000:]
    assert "no FSDP2 (model.fsdp_unit=none): the bare module in float32" in res.output
    assert "built Qwen2ForCausalLM" in res.output
    assert "actor update: gradients accumulate in the parameters, nothing to reduce" in res.output
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "timing/weight_sync_check_s" in r]
    assert len(rows) == 3, rows  # checked at every step's sync (a failed check would have stopped the run)

    two = torchrun(
        [*JOB, f"trainer.output_dir={tmp_path / 'two'}"], cwd=tmp_path, timeout_s=300, env=cache_env()
    )
    assert two.returncode != 0
    assert (
        "model.fsdp_unit=none (no FSDP2) needs a one-rank mesh for every model, got actor on 2 ranks, ref on 2 ranks:"
        in two.output
    )
    assert "built Qwen2ForCausalLM" not in two.output, "refused before any model is built"
