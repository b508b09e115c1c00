"""Under LoRA with a bf16 ``model.param_dtype`` (auto on CUDA) the frozen base is stored in bf16 and only the
adapters keep a float32 master (spmdrl.models.build, step 1c), on 2 gloo ranks with FSDP2:

- every frozen shard is the bf16 rounding of the checkpoint's float32 values, which is what FSDP2's mixed
  precision would have cast a float32 base to at every forward: the model computes the same;
- the adapters are float32, train (they get gradients and an optimizer step), and tied weights stay tied;
- the end-of-run export merges in float32: each adapted weight written is float32(W_bf16) + scale * B A,
  computed in float32, so a small adapter delta is not rounded back to bf16;
- ``python -m spmdrl.export`` of a checkpoint of that model (adapters only; the base read again from
  model.path in float32) writes the same weights bit for bit: it rounds the base to the dtype the run stored
  it in, which the checkpoint records.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from spmdrl.testing.spawn import run_distributed

pytestmark = pytest.mark.slow

OVERRIDES = ["recipe=grpo_lora_tiny", "model.param_dtype=bfloat16", "model.lora.rank=4"]


def _worker(rank: int, world: int, model_dir: str, out_dir: str, ckpt_root: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    from spmdrl.checkpoint.checkpointer import RoleState, save_checkpoint
    from spmdrl.checkpoint.export import export_hf, write_hf_metadata
    from spmdrl.config_loader import load_config
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import build_fsdp_model, model_spec
    from spmdrl.models.load import load_tokenizer
    from spmdrl.optim import build_lr_scheduler, build_optimizer

    cfg = load_config(OVERRIDES)
    cpu = torch.device("cpu")
    mesh = Placement.colocated(world).build_meshes("cpu").fsdp("actor")
    model = build_fsdp_model(model_spec(cfg.model, Path(model_dir), cpu, train=True), mesh, cpu)
    disk = {k: v for f in sorted(Path(model_dir).glob("*.safetensors")) for k, v in load_file(f).items()}
    frozen, adapters, mismatched = 0, 0, []
    for name, p in model.named_parameters():
        full = p.full_tensor()
        if p.requires_grad:
            adapters += 1
            assert p.dtype == torch.float32 and "lora_" in name, name
            continue
        frozen += 1
        assert p.dtype == torch.bfloat16, name
        key = name.replace("_checkpoint_wrapped_module.", "")
        if key in disk and not torch.equal(full, disk[key].to(torch.bfloat16)):
            mismatched.append(name)
    # One optimizer step so that B is not zero (a merge of B = 0 would check nothing).
    optimizer = build_optimizer(model, cfg.optim)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    grads = sum(1 for p in model.parameters() if p.grad is not None)
    optimizer.step()
    tokenizer = load_tokenizer(Path(model_dir))
    export_hf(model, tokenizer, Path(out_dir))
    role = RoleState(
        name="actor",
        holds=True,
        model=model,
        optimizer=optimizer,
        scheduler=build_lr_scheduler(optimizer, cfg.optim, total_steps=1),
        write_hf=lambda d: write_hf_metadata(model, tokenizer, d),
    )
    save_checkpoint(Path(ckpt_root), 1, [role], {"step": 1}, keep=1)
    weights = {n: p.full_tensor() for n, p in model.named_parameters()}
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    return dict(
        frozen=frozen,
        adapters=adapters,
        mismatched=mismatched,
        grads=grads,
        weights=weights,
        tied=tied,
        tie_config=bool(model.config.tie_word_embeddings),
    )


def test_lora_base_in_bf16_trains_the_adapters_and_exports_in_float32(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from spmdrl.config_loader import load_config
    from spmdrl.models.tiny import ensure_tiny_model

    model_dir = ensure_tiny_model(tmp_path / "models")
    out = tmp_path / "export"
    ckpt = tmp_path / "checkpoints"
    r0, _ = run_distributed(_worker, 2, str(model_dir), str(out), str(ckpt), timeout_s=240)
    assert r0["frozen"] > 0 and r0["adapters"] > 0
    assert r0["mismatched"] == [], "frozen shards differ from the bf16 rounding of the checkpoint"
    assert r0["grads"] == r0["adapters"]  # only the adapters train
    assert r0["tied"] == r0["tie_config"]
    scale = load_config(OVERRIDES).model.lora.scale
    written = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    w = r0["weights"]
    checked = 0
    for name in w:
        if not name.endswith(".lora_A.weight"):
            continue
        prefix = name.removesuffix(".lora_A.weight")
        key = prefix.replace("_checkpoint_wrapped_module.", "") + ".weight"
        delta = (w[prefix + ".lora_B.weight"].float() @ w[name].float()) * scale
        assert delta.abs().max() > 0, "B is still zero: the export check would check nothing"
        expected = w[prefix + ".weight"].float() + delta
        assert written[key].dtype == torch.float32, key
        assert torch.equal(written[key], expected), key
        checked += 1
    assert checked > 0

    # The checkpoint's export (one process, base from model.path) is the run's export, bit for bit.
    again = tmp_path / "from_checkpoint"
    cli = [sys.executable, "-m", "spmdrl.export", str(ckpt / "step-1"), str(again)]
    done = subprocess.run(cli, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    exported = {k: v for f in sorted(again.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert exported.keys() == written.keys()
    differ = [k for k in written if not torch.equal(exported[k], written[k])]
    assert differ == [], differ
