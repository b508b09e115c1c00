"""adapters_disabled (spmdrl/models/lora.py) and Reference.scoring (spmdrl/rl/reference.py): inside, a LoRA
model computes its base model's logits bitwise, with trained (non-zero) adapters; on leaving, normally or
by an exception, the adapters are on again and the model is in the mode it was."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from spmdrl.config import LoraConfig
from spmdrl.models.lora import LoraLinear, adapters_disabled, apply_lora
from spmdrl.rl.reference import Reference
from spmdrl.testing.models import SMALL_QWEN2


def _base_and_adapted() -> tuple[Qwen2ForCausalLM, Qwen2ForCausalLM]:
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(**SMALL_QWEN2)).eval()
    adapted = Qwen2ForCausalLM(Qwen2Config(**SMALL_QWEN2)).eval()
    adapted.load_state_dict(base.state_dict())
    apply_lora(adapted, LoraConfig(rank=4, alpha=8.0))
    with torch.no_grad():  # B = 0 at start would make the adapters invisible: give them a trained B
        for mod in adapted.modules():
            if isinstance(mod, LoraLinear):
                mod.lora_B.weight.normal_(0, 0.1)
    return base, adapted


IDS = torch.randint(0, SMALL_QWEN2["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))


def test_adapters_off_is_the_base_model_bitwise_and_on_again_after() -> None:
    base, adapted = _base_and_adapted()
    with torch.no_grad():
        want, on_before = base(IDS).logits, adapted(IDS).logits
        assert not torch.equal(on_before, want)  # the adapters change the output: the test can fail
        with adapters_disabled(adapted):
            off = adapted(IDS).logits
            with adapters_disabled(adapted):  # nested: the outer block stays off after the inner one
                pass
            assert torch.equal(adapted(IDS).logits, off)
        assert torch.equal(off, want)
        assert torch.equal(adapted(IDS).logits, on_before)


def test_an_exception_inside_leaves_the_adapters_on() -> None:
    _, adapted = _base_and_adapted()
    with torch.no_grad():
        on_before = adapted(IDS).logits
        with pytest.raises(RuntimeError, match="inside"), adapters_disabled(adapted):
            raise RuntimeError("inside")
        assert all(m.adapter_on for m in adapted.modules() if isinstance(m, LoraLinear))
        assert torch.equal(adapted(IDS).logits, on_before)


def test_reference_scoring_puts_the_actor_in_eval_mode_and_restores_it() -> None:
    base, adapted = _base_and_adapted()
    adapted.train()
    ref = Reference(adapted, adapters_off=True)
    with torch.no_grad(), ref.scoring():
        assert not adapted.training
        assert torch.equal(adapted(IDS).logits, base(IDS).logits)
    assert adapted.training and all(m.training for m in adapted.modules())
    with pytest.raises(RuntimeError), ref.scoring():
        raise RuntimeError
    assert adapted.training
    assert all(m.adapter_on for m in adapted.modules() if isinstance(m, LoraLinear))


def test_a_model_without_adapters_is_refused() -> None:
    base, _ = _base_and_adapted()
    with pytest.raises(ValueError, match="no LoRA adapters"), adapters_disabled(base):
        pass
