"""What the asynchronous and reward-model integration tests share: one small, fast GRPO run's settings, the
cache directory their jobs use, a random reward model on the tiny backbone, and the rescoring of a run's
logged training samples with it."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
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


def cache_env() -> dict[str, str]:
    """The environment a test launches a job with, so that the job shares the tests' cache (cache_dir)."""
    return {"SPMDRL_CACHE": str(cache_dir())}


def comparable(rows: list[dict]) -> list[dict]:
    """Metrics rows without their timings (timing/*, perf/*): what two runs of one job agree on exactly."""
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))} for r in rows]


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


# The user turn inside a rendered tiny-model prompt (its chat template's markers).
USER_TURN = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)


@dataclass(frozen=True)
class Rescored:
    """A run's logged training samples (samples.jsonl, split "train") and their rewards, recomputed."""

    train: list[dict]
    rm_B: torch.Tensor  # the reward model's score of each, computed here
    rule_B: torch.Tensor  # the tiny task's rule score of each
    logged_B: torch.Tensor  # the reward the run logged (and trained on)


def rescore_logged_samples(out: Path, reward_model: Path) -> Rescored:
    """Each training sample the run in ``out`` logged, scored again here by ``reward_model`` (its prompt
    rebuilt as one user turn, checked to render back to the logged prompt) and by the rule."""
    from transformers import AutoModelForSequenceClassification

    from spmdrl.models.load import load_tokenizer
    from spmdrl.rewards.tiny import compute_score
    from spmdrl.rl.reward_model import RewardModel

    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    train = [s for s in samples if s["split"] == "train"]
    tok = load_tokenizer(reward_model)
    scorer = RewardModel(
        AutoModelForSequenceClassification.from_pretrained(reward_model).eval(),
        tok,
        micro_batch_size=len(train),
        max_length=512,
        device=torch.device("cpu"),
    )
    messages = []
    for s in train:
        match = USER_TURN.search(s["prompt"])
        assert match is not None, s["prompt"]
        turn = [{"role": "user", "content": match.group(1)}]
        assert tok.apply_chat_template(turn, tokenize=False, add_generation_prompt=True) == s["prompt"]
        messages.append(turn)
    return Rescored(
        train,
        scorer.score(messages, [s["response"] for s in train]),
        torch.tensor([compute_score(s["response"], s["ground_truth"]) for s in train]),
        torch.tensor([s["reward"] for s in train]),
    )
