"""One whole GRPO step at equal work: spmdrl's recipe against TRL's GRPOTrainer, in one run.

    python benchmarks/grpo_step.py                                      # CPU: spmdrl on 2 ranks, TRL on 1
    python benchmarks/grpo_step.py --json grpo_step.json
    python benchmarks/grpo_step.py --model /path/to/hf/model --nproc 1  # one GPU, both sides
    python benchmarks/grpo_step.py --shape qwen2.5-0.5b --nproc 1       # one GPU, a random 0.36B Qwen2

The work of one step, the same on both sides: 16 prompts x 4 samples (the tiny arithmetic task's
prompts, chat-templated), up to 128 new tokens at temperature 1, the rule reward, group-normalized
advantages, one optimizer step (AdamW, lr 2e-4, clip 0.2/0.28, token-mean loss, no KL term, no
activation checkpointing). The model is a random Qwen2 with the tiny tokenizer, made in a temporary folder:
``--shape tiny`` (the default, ~6M parameters) or ``--shape qwen2.5-0.5b`` (Qwen2.5-0.5B's layers, 24 x
896, with the tiny tokenizer's 512-token vocabulary: ~0.36B parameters, for GPUs); random weights rarely
sample the end token, so most responses run to 128 tokens on both sides. Or ``--model``, any HF model
directory. ``--save-model DIR`` only writes the random model (to reuse it with the other benchmarks).

- spmdrl: the real recipe, ``torchrun --nproc_per_node=<nproc> -m spmdrl.train recipe=grpo_tiny`` with
  the overrides above; the step time and its phases are its own ``timing/*`` metrics (metrics.jsonl),
  each the slowest rank's.
- TRL (when ``trl`` is importable; else skipped and the ratios are null): ``GRPOTrainer`` on one process,
  ``use_vllm=False`` (generation with ``model.generate``), ``num_generations=4``, 64 completions per
  device batch, ``max_completion_length=128``; the step from ``on_step_begin`` to ``on_step_end`` of a
  callback, the phases from TRL's own profiling contexts.

Each figure is the median over ``--steps`` steps after ``--warmup`` warm-up steps. The ratio is
spmdrl / TRL: below 1, spmdrl's step is faster. On CPU the two use the same cores differently: spmdrl
one rank per core (torchrun sets one thread each), TRL one process with torch's threads on every core.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_report import Figure, fmt_ratio, write_json

# The ~6M-parameter random Qwen2 (head_dim 32: vLLM's CPU attention rejects 16).
MODEL_SHAPE = dict(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
)
SHAPES = {
    "tiny": MODEL_SHAPE,
    # Qwen2.5-0.5B's decoder (head_dim 64, GQA 14/2); the vocabulary is the tiny tokenizer's.
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
}
LR = 2e-4
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
# Phases timed inside another one: left out of the sum that gives "other".
NESTED = {"actor_update": "update", "critic_update": "update", "weight_sync_check": "weight_sync"}
TRL_GENERATE = "GRPOTrainer.transformers.generate"
TRL_REWARD = "GRPOTrainer._calculate_rewards"
TRL_PREPARE = "GRPOTrainer._prepare_inputs"


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="an HF model directory; default: a random Qwen2 of --shape")
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES), help="the random model's shape")
    p.add_argument("--save-model", default="", help="write the random model of --shape here and exit")
    p.add_argument("--nproc", type=int, default=0, help="spmdrl's ranks; default: 1 with CUDA, else 2")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (global)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=5, help="measured steps (after the warm-up)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-trl", action="store_true", help="measure spmdrl only")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the spmdrl job")
    p.add_argument("--spmdrl-log", default="", help="also keep the spmdrl job's log in this file")
    p.add_argument("--json", default="", help="also write the figures to this JSON file")
    return p.parse_args()


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# ---------------------------------------------------------------------------------------- the model
def save_random_qwen2(out: Path, shape: str = "tiny") -> int:
    """A random Qwen2 of ``SHAPES[shape]`` with the tiny model's tokenizer, saved to ``out``; its parameter count."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from spmdrl.models.tiny import EOS_TOKEN, PAD_TOKEN, build_tokenizer

    tok = build_tokenizer()
    pad_id, eos_id = tok.convert_tokens_to_ids([PAD_TOKEN, EOS_TOKEN])
    cfg = Qwen2Config(
        vocab_size=len(tok),
        **SHAPES[shape],
        tie_word_embeddings=True,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    cfg.architectures = ["Qwen2ForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------- spmdrl
@dataclass
class SideResult:
    """One side's medians: the step, its phases (seconds) and the mean response length (tokens)."""

    step_s: float
    phases: dict[str, float]
    response_len: float
    steps: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def spmdrl_overrides(a: argparse.Namespace, model_dir: Path, out_dir: Path) -> list[str]:
    return [
        "recipe=grpo_tiny",
        "warmstart.enabled=false",
        f"model.path={model_dir}",
        f"trainer.global_batch_size={a.prompts}",
        f"rollout.n={a.n}",
        f"data.max_response_length={a.max_tokens}",
        "data.max_prompt_length=128",
        f"trainer.total_steps={a.warmup + a.steps}",
        f"trainer.micro_batch_size={a.prompts * a.n}",
        f"optim.lr={LR}",
        f"algorithm.clip_ratio_low={CLIP_LOW}",
        f"algorithm.clip_ratio_high={CLIP_HIGH}",
        "algorithm.use_kl_loss=false",
        "trainer.val_every=0",
        "trainer.save_hf=false",
        "trainer.save_every=0",
        "logging.samples_every=0",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        f"trainer.output_dir={out_dir}",
    ]


def run_spmdrl(a: argparse.Namespace, model_dir: Path, work: Path) -> SideResult:
    out_dir = work / "spmdrl-run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={a.nproc}",
        "-m",
        "spmdrl.train",
        *spmdrl_overrides(a, model_dir, out_dir),
    ]
    shown = " ".join(
        o for o in spmdrl_overrides(a, model_dir, out_dir) if not o.startswith("trainer.output_dir")
    )
    print(f"spmdrl: torchrun --nproc_per_node={a.nproc} -m spmdrl.train {shown}", flush=True)
    log_path = work / "spmdrl.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout, check=False)
    wall = time.perf_counter() - t0
    if a.spmdrl_log:
        shutil.copyfile(log_path, a.spmdrl_log)
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-40:])
        raise SystemExit(f"the spmdrl job failed (exit {proc.returncode}); its last lines:\n{tail}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line]
    measured = [r for r in rows if r["step"] > a.warmup]
    result = _spmdrl_medians(measured)
    result.extra["job_wall_s"] = wall
    return result


def _spmdrl_medians(rows: list[dict[str, Any]]) -> SideResult:
    keys = sorted({k for r in rows for k in r if k.startswith("timing/") and k != "timing/step_s"})
    phases = {
        k.removeprefix("timing/").removesuffix("_s"): statistics.median(r.get(k, 0.0) for r in rows)
        for k in keys
    }
    steps = [r["timing/step_s"] for r in rows]
    step = statistics.median(steps)
    phases["other"] = max(step - sum(v for k, v in phases.items() if k not in NESTED), 0.0)
    length = statistics.median(r["rollout/response_len_mean"] for r in rows)
    tps = statistics.median(r["perf/rollout_tokens_per_s"] for r in rows)
    return SideResult(step, phases, length, steps, {"rollout_tokens_per_s": tps})


# ---------------------------------------------------------------------------------------------- TRL
def tiny_prompt_rows(tokenizer: Any) -> list[dict[str, str]]:
    """grpo_tiny's training prompts, chat-templated as spmdrl renders them, with their answers."""
    from spmdrl.config_loader import load_config
    from spmdrl.data import tiny_task
    from spmdrl.data.prompts import render_prompt

    train, _ = tiny_task.generate(load_config(["recipe=grpo_tiny"]).data.tiny)
    return [
        {
            "prompt": render_prompt(tokenizer, r["prompt"], where="tiny task"),
            "ground_truth": r["reward_model"]["ground_truth"],
        }
        for r in train
    ]


def tiny_reward(completions: list[str], ground_truth: list[str], **_: Any) -> list[float]:
    """The recipe's rule reward (spmdrl.rewards.registry.tiny_score), called as TRL calls a reward function."""
    from spmdrl.rewards.registry import tiny_score

    return [
        tiny_score(c, g, data_source="", extra_info={})
        for c, g in zip(completions, ground_truth, strict=True)
    ]


class _Profile:
    """Collects TRL's profiling contexts (name -> seconds) for the current step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {}

    def install(self) -> None:
        from trl.extras import profiling

        def log_metrics(ctx: Any, duration: float) -> None:
            self.current[ctx.name] = self.current.get(ctx.name, 0.0) + duration

        profiling.ProfilingContext._log_metrics = log_metrics  # type: ignore[method-assign]


def _step_callback(profile: _Profile, steps: list[tuple[float, dict[str, float]]]) -> Any:
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        t0 = 0.0

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            profile.current = {}
            self.t0 = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            steps.append((time.perf_counter() - self.t0, dict(profile.current)))

    return StepTimer()


def trl_version() -> str | None:
    try:
        import trl
    except ImportError:
        return None
    return str(trl.__version__)


def trl_status(no_trl: bool) -> tuple[str | None, str]:
    """TRL's version (None: not measured) and why: skipped, not installed, or failing at import."""
    if no_trl:
        return None, "TRL skipped (--no-trl)"
    try:
        version = trl_version()
    except Exception as e:  # a TRL that does not import against this transformers / torch
        traceback.print_exc()
        return None, f"TRL failed to import ({type(e).__name__}: {e}): skipped"
    if version is None:
        return None, "TRL not installed (pip install trl): skipped"
    return version, f"TRL {version} on 1 process"


def run_trl(a: argparse.Namespace, model_dir: Path, work: Path, cuda: bool) -> SideResult:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = GRPOConfig(
        output_dir=str(work / "trl-run"),
        max_steps=a.warmup + a.steps,
        per_device_train_batch_size=a.prompts * a.n,
        gradient_accumulation_steps=1,
        num_generations=a.n,
        max_completion_length=a.max_tokens,
        temperature=1.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=CLIP_LOW,
        epsilon_high=CLIP_HIGH,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        use_vllm=False,
        gradient_checkpointing=False,
        bf16=cuda,
        use_cpu=not cuda,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    profile = _Profile()
    profile.install()
    steps: list[tuple[float, dict[str, float]]] = []
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=[tiny_reward],
        args=args,
        train_dataset=Dataset.from_list(tiny_prompt_rows(tokenizer)),
        processing_class=tokenizer,
        callbacks=[_step_callback(profile, steps)],
    )
    print(f"TRL {trl_version()}: GRPOTrainer, 1 process, use_vllm=False ...", flush=True)
    trainer.train()
    lengths = [
        h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h
    ]
    return _trl_medians(steps[a.warmup :], lengths[a.warmup :], a.prompts * a.n)


def _trl_medians(
    steps: list[tuple[float, dict[str, float]]], lengths: list[float], completions: int
) -> SideResult:
    def med(fn: Any) -> float:
        return statistics.median(fn(s, p) for s, p in steps)

    step = med(lambda s, p: s)
    phases = {
        "rollout": med(lambda s, p: p.get(TRL_GENERATE, 0.0)),
        "reward": med(lambda s, p: p.get(TRL_REWARD, 0.0)),
        # Everything after the batch is ready: the loss's forward, backward, clipping, optimizer step.
        "update": med(lambda s, p: s - p.get(TRL_PREPARE, 0.0)),
    }
    phases["other"] = max(step - phases["rollout"] - phases["reward"] - phases["update"], 0.0)
    # Generated tokens / generate time, per step (TRL logs each step's mean completion length).
    tps = [n * completions / p.get(TRL_GENERATE, math.nan) for (_, p), n in zip(steps, lengths, strict=True)]
    return SideResult(
        step,
        phases,
        statistics.median(lengths) if lengths else math.nan,
        [s for s, _ in steps],
        {"rollout_tokens_per_s": statistics.median(tps) if tps else math.nan},
    )


# ------------------------------------------------------------------------------------------- report
ROWS = ("rollout", "reward", "old_ref", "update", "actor_update", "weight_sync", "weight_sync_check", "other")


def figures(ours: SideResult, trl: SideResult | None) -> list[Figure]:
    out = [Figure("grpo_step/step_s", ours.step_s, "s", trl.step_s if trl else None)]
    for name in [*ROWS, *sorted(set(ours.phases) - set(ROWS))]:
        if name in ours.phases:
            base = trl.phases.get(name) if trl else None
            out.append(Figure(f"grpo_step/{name}_s", ours.phases[name], "s", base))
    out.append(
        Figure(
            "grpo_step/rollout_tokens_per_s",
            ours.extra["rollout_tokens_per_s"],
            "tokens/s",
            trl.extra["rollout_tokens_per_s"] if trl else None,
        )
    )
    out.append(
        Figure("grpo_step/response_len_mean", ours.response_len, "tokens", trl.response_len if trl else None)
    )
    return out


def print_table(a: argparse.Namespace, ours: SideResult, trl: SideResult | None, trl_note: str) -> None:
    print(
        f"\nGRPO step: {a.prompts} prompts x {a.n} samples, <= {a.max_tokens} tokens, one optimizer step; "
        f"median of {a.steps} steps after {a.warmup} warm-up; spmdrl on {a.nproc} rank(s), {trl_note}"
    )
    print(f"{'figure':<26} {'spmdrl':>9} {'TRL':>9} {'spmdrl/TRL':>11}")
    for f in figures(ours, trl):
        name = f.name.removeprefix("grpo_step/")
        name = name.removesuffix("_s") if f.unit == "s" else name
        label = ("  " + name) if name in NESTED else name
        spec = {"s": ".3f", "tokens/s": ".0f"}.get(f.unit, ".1f")
        base = "-" if f.baseline is None else format(f.baseline, spec)
        print(f"{label:<26} {format(f.value, spec):>9} {base:>9} {fmt_ratio(f.ratio):>11}  {f.unit}")
    print(
        f"spmdrl steps: {', '.join(f'{s:.2f}' for s in ours.steps)} s; job wall {ours.extra['job_wall_s']:.0f} s"
    )
    if trl:
        print(f"TRL steps:    {', '.join(f'{s:.2f}' for s in trl.steps)} s")


def save_json(
    a: argparse.Namespace,
    ours: SideResult,
    trl: SideResult | None,
    version: str | None,
    note: str,
    params: int | None,
    cuda: bool,
) -> None:
    write_json(
        a.json,
        "grpo_step",
        figures(ours, trl),
        device="cuda" if cuda else "cpu",
        spmdrl_ranks=a.nproc,
        trl_version=version,
        model=a.model or f"random-qwen2 ({a.shape})",
        model_params=params,
        prompts=a.prompts,
        n=a.n,
        max_tokens=a.max_tokens,
        steps=a.steps,
        warmup=a.warmup,
        spmdrl_steps_s=ours.steps,
        trl_steps_s=trl.steps if trl else None,
        trl_note=note,
    )


def main() -> None:
    a = _args()
    if a.save_model:
        params = save_random_qwen2(Path(a.save_model), a.shape)
        print(
            f"random Qwen2 ({a.shape}) with the tiny tokenizer: {params / 1e6:.2f}M parameters -> {a.save_model}"
        )
        return
    cuda = cuda_available()
    a.nproc = a.nproc or (1 if cuda else 2)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    trl_failed = False
    with tempfile.TemporaryDirectory(prefix="spmdrl-grpo-step-") as tmp:
        work = Path(tmp)
        if a.model:
            model_dir = Path(a.model).resolve()
            params = None
        else:
            model_dir = work / "model"
            params = save_random_qwen2(model_dir, a.shape)
            print(
                f"random Qwen2 ({a.shape}) with the tiny tokenizer: {params / 1e6:.2f}M parameters",
                flush=True,
            )
        ours = run_spmdrl(a, model_dir, work)
        print(
            f"spmdrl: step {ours.step_s:.3f} s (median), job wall {ours.extra['job_wall_s']:.0f} s",
            flush=True,
        )
        version, note = trl_status(a.no_trl)
        if a.json:  # spmdrl's figures now, in case the TRL side never ends
            save_json(a, ours, None, version, "TRL not measured (yet)", params, cuda)
        trl = None
        if version is None:
            print(note)
        else:
            try:
                trl = run_trl(a, model_dir, work, cuda)
            except Exception as e:  # spmdrl's figures are still reported
                traceback.print_exc()
                note = f"TRL {version} failed ({type(e).__name__}: {e}); spmdrl alone"
                trl_failed = True
    print_table(a, ours, trl, note)
    if a.json:
        save_json(a, ours, trl, version, note, params, cuda)
    if trl_failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
