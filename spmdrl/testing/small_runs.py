"""What the asynchronous and reward-model integration tests share: one small, fast GRPO run's settings, the
cache directory their jobs use, and a random reward model on the tiny backbone."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# A small run with a gradient at every step: no warm-start (an SFT stage on 4 ranks would start from other
# weights than one on 2), an entropy bonus (the untrained model earns no reward), a KL loss to the
# reference, and two mini-batches, so the second one trains off the policy it started from.
SMALL_GRPO: tuple[str, ...] = (
    "warmstart.enabled=false",
    "trainer.total_steps=3",
    "trainer.val_every=3",
    "tiny_task.num_train=256",
    "tiny_task.num_test=32",
    "trainer.global_batch_size=8",
    "rollout.n=4",
    "trainer.micro_batch_size=8",
    "algorithm.ppo_mini_batch_size=4",
    "algorithm.use_kl_loss=true",
    "algorithm.entropy_coeff=0.01",
    "logging.samples_every=0",
    "trainer.save_hf=false",
)


def cache_dir() -> Path:
    """Where the tiny model and generated data are cached ($SPMDRL_CACHE, else ~/.cache/spmdrl)."""
    return Path(os.environ.get("SPMDRL_CACHE", str(Path.home() / ".cache" / "spmdrl")))


def save_random_reward_model(out: Path, *, scale: float = 20.0, seed: int = 0) -> Path:
    """The tiny backbone with a random scalar head (times ``scale``: scores of a few units, clearly not a
    rule's 0/1), saved with its tokenizer as an HF reward model in ``out``."""
    from transformers import AutoModelForSequenceClassification

    from spmdrl.models.load import load_tokenizer
    from spmdrl.models.tiny import ensure_tiny_model

    tiny = ensure_tiny_model(cache_dir())
    tok = load_tokenizer(tiny)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(
            tiny, num_labels=1, pad_token_id=tok.pad_token_id
        )
    with torch.no_grad():
        model.score.weight.mul_(scale)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
