"""Reward-model training with a pairwise Bradley-Terry loss, as one SPMD program. Read it top to bottom.

    torchrun --nproc_per_node=2 -m spmdrl.train recipe=rm_tiny

The model is model.path's backbone, first fine-tuned on the task's demonstrations when warmstart.enabled
(the library's SFT stage, run in this job: spmdrl/supervised/warmstart.py), with a scalar head
(``*ForSequenceClassification``, num_labels=1; the head starts at 0, so every first score is 0). The data are preference pairs of the tiny
task, rm.pairs of them: ``policy`` (spmdrl/rl/policy_pairs.py) samples rollout.n responses per prompt from
the warm-started policy with the in-process vLLM engine, labels each with the rule reward and pairs a
correct one (chosen) with an incorrect one of the same prompt (rejected), as real pipelines sample their
comparisons from the policy; ``synthetic`` (spmdrl/data/tiny_pairs.py) pairs the correct answer with a
hand-made wrong one; ``both`` trains on the two (held-out pairs are then the policy's). Train pairs come
from the train split, held-out pairs from the test split. Each pair is rendered as the prompt's messages plus the response as the assistant's turn, in the
model's own chat template (spmdrl/rl/reward_model.py, the same rendering the RL step scores with).

The step: each rank takes its shard of trainer.global_batch_size pairs, in micro-batches of
trainer.micro_batch_size pairs (chosen and rejected in one forward), and accumulates
``-logsigmoid(r_chosen - r_rejected)`` summed over its pairs and divided by the step's pairs over all ranks
(spmdrl/algos/pairwise.py); grad-norm clipping, AdamW, the schedule. Every trainer.val_every steps, the
pairwise accuracy (r_chosen > r_rejected, a tie half) and loss on every held-out pair (val/pairwise_accuracy,
val/loss); checkpoints every trainer.save_every steps and after the last (a run resumes from the newest:
the loop is spmdrl/loop.py's, as the other recipes' is; the model's set-up and optimizer step,
spmdrl/supervised/model.py, are the SFT stage's); at the end an HF export (``hf_model``: config.json with
``architectures: [Qwen2ForSequenceClassification]``, num_labels 1, pad_token_id), which
``reward_model.path`` of an RL run reads (configs/recipe/grpo_rm_tiny.yaml; docs/rewards.md).

Deliberately simple: one task (the tiny task), no margin or reward centering terms.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from spmdrl import loop
from spmdrl.algos.pairwise import bradley_terry_loss, pairs_right
from spmdrl.checkpoint.export import export_hf
from spmdrl.config import Config, choice, derive, register_config_section
from spmdrl.data.tiny_pairs import PreferencePair, tiny_pairs
from spmdrl.data.tiny_task import TinyTaskConfig, generate
from spmdrl.distributed.reduce import all_reduce_sum
from spmdrl.errors import ConfigError
from spmdrl.logging.plot import plot_curves
from spmdrl.logging.profiler import check_profile_steps, profile_step
from spmdrl.models.grad_sync import gradient_sync
from spmdrl.models.load import load_tokenizer, resolve_model_path_all_ranks
from spmdrl.rl.policy_pairs import balance_directions, sample_policy_pairs
from spmdrl.rl.reward_model import encode_for_rm, pad_right, sequence_scores
from spmdrl.rollout.engine import SamplingSpec, build_engine, check_engine_config
from spmdrl.runtime import Run, start_run
from spmdrl.supervised.model import build_trained_model
from spmdrl.supervised.warmstart import warm_start
from spmdrl.trainer_config import refuse_val_only

log = logging.getLogger("spmdrl")

CURVE_KEYS = ["train/loss", "val/loss", "val/pairwise_accuracy"]
PAIRS_FILE = "policy_pairs.json"


@register_config_section("rm")
@dataclass
class RMConfig:
    """This recipe's own settings, the config section ``rm`` (``rm.pairs=synthetic``)."""

    # Where the preference pairs come from: the warm-started policy's own samples (policy), hand-made wrong
    # answers (synthetic), or both (train on the two; held-out pairs are the policy's).
    pairs: str = choice("policy", ("policy", "synthetic", "both"))
    # policy: the train prompts sampled (the split's first ones; 0: all of them).
    num_prompts: int = 0
    # policy: at most this many pairs per prompt (distinct right and wrong samples, each used evenly).
    max_pairs_per_prompt: int = 2
    # policy: as many train pairs whose rejected answer is above the chosen one as below it (the policy's
    # systematic mistakes otherwise teach "smaller is better"; spmdrl/rl/policy_pairs.balance_directions).
    balance: bool = True

    def __post_init__(self) -> None:
        if self.num_prompts < 0 or self.max_pairs_per_prompt < 1:
            raise ConfigError(
                f"rm.num_prompts must be >= 0 and rm.max_pairs_per_prompt >= 1, got {self.num_prompts} and "
                f"{self.max_pairs_per_prompt}"
            )


def policy_pairs(
    run: Run, model_dir: Path, tokenizer: object
) -> tuple[list[PreferencePair], list[PreferencePair], dict[str, float]]:
    """(train, held-out) pairs sampled from the policy at ``model_dir`` (the warm-start's export), with the
    engine built for this and closed after; kept in the output directory, where a resumed run reads them."""
    cfg, env, rm = run.cfg, run.env, run.cfg.section(RMConfig)
    path = run.output_dir / PAIRS_FILE
    if path.is_file():
        saved = json.loads(path.read_text())
        log.info("policy pairs from %s", path)
        return (
            [PreferencePair(**p) for p in saved["train"]],
            [PreferencePair(**p) for p in saved["val"]],
            saved["stats"],
        )
    train_rows, test_rows = generate(cfg.section(TinyTaskConfig))
    if rm.num_prompts:
        train_rows = train_rows[: rm.num_prompts]
    t0 = time.perf_counter()
    engine = build_engine(model_dir, cfg.rollout, max_model_len=_max_length(cfg), device_type=env.device.type)
    spec = SamplingSpec.for_training(cfg.rollout, cfg.data.max_response_length, seed=cfg.rollout.seed)
    out, stats = [], {}
    for split, rows in (("train", train_rows), ("val", test_rows)):
        pairs, s = sample_policy_pairs(
            engine,
            tokenizer,
            rows,
            spec,
            max_pairs_per_prompt=rm.max_pairs_per_prompt,
            seed=cfg.data.seed,
            rank=env.rank,
            world_size=env.world_size,
        )
        out.append(pairs)
        stats.update({f"policy_pairs/{split}_{k}": v for k, v in s.items()})
    engine.close()
    stats["policy_pairs/seconds"] = time.perf_counter() - t0
    if not out[0] or not out[1]:
        raise ConfigError(
            f"the policy's samples gave {len(out[0])} train and {len(out[1])} held-out pairs (every prompt's "
            "samples agreed): warm-start the policy (warmstart.enabled=true), raise rollout.n, or use rm.pairs=synthetic"
        )
    if env.is_main:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps({"train": [vars(p) for p in out[0]], "val": [vars(p) for p in out[1]], "stats": stats})
        )
        tmp.replace(path)
    dist.barrier()
    log.info("policy pairs: %s", ", ".join(f"{k}={v:.3g}" for k, v in stats.items()))
    return out[0], out[1], stats


def pair_scores(
    model: torch.nn.Module,
    tokenizer: object,
    pairs: list[PreferencePair],
    max_length: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r_chosen_B, r_rejected_B)``: both sides of the pairs in one forward."""
    messages = [p.messages for p in pairs] * 2
    responses = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    rows, _ = encode_for_rm(tokenizer, messages, responses, max_length)
    s_B = sequence_scores(model, *pad_right(rows, tokenizer.pad_token_id, device))  # type: ignore[attr-defined]
    return s_B[: len(pairs)], s_B[len(pairs) :]


@torch.no_grad()
def validate(
    run: Run, model: torch.nn.Module, tokenizer: object, pairs: list[PreferencePair], micro: int
) -> dict:
    """Pairwise accuracy and loss over every held-out pair, all ranks together. FSDP2 gathers inside each
    forward, so every rank runs as many: a rank with fewer pairs repeats its first, with weight 0."""
    env, max_length = run.env, _max_length(run.cfg)
    mine = pairs[env.rank :: env.world_size]
    per_rank = math.ceil(len(pairs) / env.world_size)
    weights_B = torch.tensor([1.0] * len(mine) + [0.0] * (per_rank - len(mine)))
    mine += [pairs[0]] * (per_rank - len(mine))
    model.eval()
    loss_sum = correct = 0.0
    for i in range(0, per_rank, micro):
        chosen_B, rejected_B = pair_scores(model, tokenizer, mine[i : i + micro], max_length, env.device)
        w_B = weights_B[i : i + micro].to(env.device)
        margin_B = chosen_B - rejected_B
        loss_sum += float((-torch.nn.functional.logsigmoid(margin_B) * w_B).sum())
        correct += float((pairs_right(margin_B) * w_B).sum())
    model.train()
    t = all_reduce_sum({"loss": loss_sum, "correct": correct}, env.device)
    return {"val/loss": t["loss"] / len(pairs), "val/pairwise_accuracy": t["correct"] / len(pairs)}


def _max_length(cfg: Config) -> int:
    return cfg.data.max_prompt_length + cfg.data.max_response_length


def check_config(cfg: Config) -> None:
    """Settings this recipe would not run fail at config load (spmdrl.config_loader calls this)."""
    refuse_val_only(cfg.trainer, cfg.entry, cfg.name)


def main(cfg: Config) -> None:
    run = start_run(cfg)
    env = run.env
    plan = loop.plan_start(run)  # resume or start (spmdrl/loop.py), decided before anything is built

    # Model files, tokenizer (its chat template renders the pairs), pairs, and the batch arithmetic.
    model_dir = resolve_model_path_all_ranks(cfg.model.path, run.cache_dir)
    tokenizer = load_tokenizer(model_dir, cfg.model.trust_remote_code)
    source = cfg.section(RMConfig).pairs
    if source != "synthetic":  # an engine this machine cannot run fails now, not after the SFT
        check_engine_config(cfg.rollout, env.device.type)
    # warmstart.*: the backbone first learns the task by SFT on its demonstrations (a reward model starts
    # from an SFT model, as InstructGPT's did): it has to know the answer to tell a right one from a wrong.
    if cfg.warmstart.enabled:
        model_dir = warm_start(run, plan)
    train_pairs, val_pairs = tiny_pairs(cfg.section(TinyTaskConfig), cfg.data.seed)
    stats: dict[str, float] = {}
    if source != "synthetic":  # the (warm-started) policy's own samples, paired by the rule reward
        sampled_train, val_pairs, stats = policy_pairs(run, model_dir, tokenizer)
        if cfg.section(RMConfig).balance:
            sampled_train = balance_directions(sampled_train, cfg.data.seed)
            stats["policy_pairs/train_pairs_balanced"] = float(len(sampled_train))
        train_pairs = sampled_train + train_pairs if source == "both" else sampled_train
    derived = derive(cfg, env.world_size, len(train_pairs))
    total = derived.total_steps
    check_profile_steps(cfg.logging.profile_steps, total)
    run.log_derived(derived, train_pairs=len(train_pairs), val_pairs=len(val_pairs), **stats)
    sampler = run.train_sampler(len(train_pairs), derived.per_rank_batch_size)

    # The backbone with a scalar head (it starts at 0) on every rank, its optimizer, its checkpoint role.
    rm = build_trained_model(run, cfg, model_dir, tokenizer, total, "reward_model", head="reward")
    rm.model.config.pad_token_id = tokenizer.pad_token_id  # the export's, which transformers' pooling needs
    start = loop.resume_or_start(run, plan, [rm.role], sampler, total)
    micro = derived.micro_batch_size
    if start.step == 0 and loop.validation_due(
        0, cfg.trainer.val_every, total, at_start=cfg.trainer.val_before_train
    ):  # the curve's start
        start.logger.log(0, validate(run, rm.model, tokenizer, val_pairs, micro))

    for step in range(start.step + 1, total + 1):
        t0 = time.perf_counter()
        with profile_step(cfg.logging.profile_steps, run.output_dir, step, env.rank, env.device):
            pairs = [train_pairs[i] for i in sampler.next_batch()]
            num_pairs = all_reduce_sum({"pairs": len(pairs)}, env.device)["pairs"]
            # Loss and accuracy summed on the device and read once (no host-device sync per micro-batch);
            # the gradients reduced per trainer.defer_grad_sync (spmdrl.models.grad_sync).
            sums = {"loss": torch.zeros((), device=env.device), "correct": torch.zeros((), device=env.device)}
            starts = range(0, len(pairs), micro)
            for i in starts:
                gradient_sync(rm.model, rm.defer_grad_sync, last=i == starts[-1])
                chosen_B, rejected_B = pair_scores(
                    rm.model, tokenizer, pairs[i : i + micro], _max_length(cfg), env.device
                )
                loss, right = bradley_terry_loss(chosen_B, rejected_B, num_pairs)
                loss.backward()
                sums["loss"] += loss.detach()
                sums["correct"] += right
            t, grad_norm = rm.optimizer_step(sums, cfg.optim, step)
            step_s = time.perf_counter() - t0  # without the trace's writing
        metrics = {
            "train/loss": t["loss"],
            "train/pairwise_accuracy": t["correct"] / num_pairs,
            "train/grad_norm": grad_norm,
            "train/lr": rm.scheduler.get_last_lr()[0],
            "timing/step_s": step_s,
        }
        validated = loop.validation_due(step, cfg.trainer.val_every, total)
        if validated:
            metrics.update(validate(run, rm.model, tokenizer, val_pairs, micro))
        if validated or loop.due(step, cfg.trainer.log_every, total):
            start.logger.log(step, metrics)
        if loop.due(step, cfg.trainer.save_every, total):  # logged first, saved second (loop.save)
            loop.save(rm.checkpointer, step, sampler, meta={"total_steps": total})

    def export() -> None:
        if cfg.trainer.save_hf:
            export_hf(rm.model, tokenizer, run.output_dir / "hf_model")

    def curves() -> None:
        out = run.output_dir
        plot_curves(out / "metrics.jsonl", out / "curves.png", CURVE_KEYS, title=cfg.name)

    loop.finish(run, rm.checkpointer, start.logger, outputs=export, curves=curves)
    log.info("reward model done: %d steps, outputs in %s", total, run.output_dir)


if __name__ == "__main__":
    # A forked copy runs as a script: torchrun --nproc_per_node=2 my_rm.py recipe=rm_tiny ...
    from spmdrl.train import run_recipe

    run_recipe(main)
