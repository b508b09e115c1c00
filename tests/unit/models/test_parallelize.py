"""apply_ac's variants (model.activation_checkpointing: full, mlp; every k-th layer) give the gradients of
no checkpointing and keep fewer activations for backward.

A plain (unsharded) small Qwen2 on one process: apply_ac wraps modules before FSDP2 and is independent of
it. What autograd keeps is counted with torch.autograd.graph.saved_tensors_hooks around the forward:
non-reentrant checkpointing saves its region's tensors through hooks of its own, so the outer hook sees
only what stays alive until backward (no timing)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from spmdrl.config import AC_MODES, Config, ConfigError, ModelConfig, ac_mode, validate
from spmdrl.models.parallelize import apply_ac, decoder_layers
from spmdrl.testing.models import SMALL_QWEN2

LAYERS = 4


def _model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**{**SMALL_QWEN2, "num_hidden_layers": LAYERS}))


def _grads_and_saved(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], int, int]:
    """(gradients by name, tensors kept for backward, their bytes) of one forward + backward."""
    ids = torch.randint(0, SMALL_QWEN2["vocab_size"], (4, 24), generator=torch.Generator().manual_seed(1))
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids, use_cache=False).logits
    torch.log_softmax(logits.float(), -1).mean().neg().backward()
    # The same storage saved twice is memory once.
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()}
    return grads, len(saved), sum(storages.values())


@pytest.mark.parametrize(("mode", "every"), [("full", 1), ("full", 2), ("mlp", 1), ("mlp", 2)])
def test_checkpointing_gives_the_same_gradients_and_keeps_fewer_activations(mode: str, every: int) -> None:
    base = _model()
    ref_grads, ref_count, ref_bytes = _grads_and_saved(copy.deepcopy(base))
    model = copy.deepcopy(base)
    apply_ac(model, mode, every=every)
    wrapped = [
        i
        for i, layer in enumerate(decoder_layers(model))
        if "_checkpoint_wrapped_module" in str([n for n, _ in layer.named_modules()])
    ]
    assert wrapped == [i for i in range(LAYERS) if (i + 1) % every == 0]
    grads, count, nbytes = _grads_and_saved(model)
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        assert g is not None and g.abs().max() > 0
        assert torch.equal(grads[name], g), name  # the recompute runs the same ops: bitwise
    assert count < ref_count and nbytes < ref_bytes
    # Checkpointing every other layer drops about half of what checkpointing every layer does.
    if every == 2:
        all_layers = copy.deepcopy(base)
        apply_ac(all_layers, mode, every=1)
        _, count_all, bytes_all = _grads_and_saved(all_layers)
        assert bytes_all < nbytes < ref_bytes
        assert count_all < count


def test_full_keeps_less_than_mlp_only() -> None:
    base = _model()
    saved = {}
    for mode in ("full", "mlp"):
        model = copy.deepcopy(base)
        apply_ac(model, mode)
        saved[mode] = _grads_and_saved(model)[2]
    assert saved["full"] < saved["mlp"]


def test_the_config_takes_the_modes_and_its_former_booleans() -> None:
    assert [ac_mode(v) for v in (True, False, "True", "false", "full", "mlp", "off")] == [
        "full",
        "off",
        "full",
        "off",
        "full",
        "mlp",
        "off",
    ]
    for mode in AC_MODES:
        validate(Config(model=ModelConfig(activation_checkpointing=mode)))
    with pytest.raises(
        ConfigError, match=r"model.activation_checkpointing='attn' is not one of off, full, mlp"
    ):
        validate(Config(model=ModelConfig(activation_checkpointing="attn")))
    with pytest.raises(ConfigError, match="activation_checkpointing_every must be >= 1"):
        validate(Config(model=ModelConfig(activation_checkpointing_every=0)))
