"""The actor's update path profiled on one device: MFU, device busy fraction, launches and syncs.

    python benchmarks/update_profile.py --shape tiny                        # CPU, under a minute
    python benchmarks/update_profile.py --shape deep-narrow --variant 'layer=model.fsdp_unit=layer'  # CPU: host work
    python benchmarks/update_profile.py --shape qwen2.5-7b --json p.json    # one GPU (H100: ~1-2 minutes)
    python benchmarks/update_profile.py --shape qwen2.5-0.5b --set trainer.pack_sequences=true
    python benchmarks/update_profile.py --shape qwen2.5-1.5b --variant 'ac=model.activation_checkpointing=full'
    python benchmarks/update_profile.py --shape qwen2.5-0.5b --plain        # against the bare module

A random decoder of a named shape (Qwen2.5's config.json numbers with the real vocabulary; ``tiny`` for CPU)
is built on the meta device, parallelized on one rank as the RL job builds its actor (spmdrl.models.build's
parallelize: activation checkpointing, ``model.compile``, FSDP2) and materialized on the device with random weights (fp32 master weights, bf16
compute on a GPU: ``model.param_dtype=auto``). On a synthetic batch of ``--rows`` rows of ``--length``
tokens (the first ``--prompt`` of each a prompt, the rest sampled), it runs spmdrl's own passes:

- ``update_policy``: the actor's update (one optimizer step over the micro-batches, the configured loss);
- ``logprobs_of``: the no-grad forward the old and reference logprobs take.

Each is timed (median of ``--steps`` after one warm-up, the device synchronized around each), then run once
under torch.profiler and once more counting host-device syncs. Reported per pass:

- MFU: model FLOPs (spmdrl.logging.flops: dense matmuls, causal attention, the LM head on the sampled
  positions; training 3 x forward) / time / the device's dense bf16 peak (its table; ``--peak-tflops`` for
  another device); HFU adds activation checkpointing's recomputation. No peak (CPU): no MFU;
- GPU busy: the union of the device's kernel and copy intervals / the profiled pass's wall time (the
  profiler's own overhead lowers it a little); CUDA only;
- launches per micro-batch: CUDA kernels; on CPU the leaf ATen ops (ops calling no other ATen op), a proxy
  for the kernels the same pass would launch on a GPU, labelled so;
- syncs per micro-batch: on CUDA the synchronizing calls ``torch.cuda.set_sync_debug_mode("warn")``
  reports; on CPU spmdrl.testing.syncs.SyncCounter's model of them;
- host time in FSDP2 and in the optimizer: the union of the host intervals of FSDP2's own profiler ranges
  (``FSDP::*``: its hooks, gathers' copy-in and copy-out, reduces) and of ``Optimizer.step``/``zero_grad``,
  per thread, over the profiled pass, and their share of its wall time (``fsdp_host_share_*``). On a step
  the host bounds, that share is what a one-rank job pays FSDP2 for nothing to shard; 0 for ``--plain``;
- the attention ops the profiler saw (``aten::_scaled_dot_product_flash_attention`` and its kin): which
  SDPA kernel the pass took, e.g. flash for padded rows under causal SDPA (spmdrl.models.causal_attention).

``--plain``: one more column, the same work without a framework: the bare Hugging Face module of the same
shape and weights (float32 parameters under bf16 autocast on a GPU, no FSDP2), the same micro-batches, TRL's
loss path (the LM head on completion positions, a float32 log-softmax, the clipped loss with its k3 KL term,
token-mean), ``clip_grad_norm_`` and Hugging Face Trainer's default optimizer (fused AdamW on a GPU). What
spmdrl's passes cost beyond that floor is the framework's; the run checks the two score the first
micro-batch's tokens alike before any update (``plain/logprob_max_abs_diff``).

Micro-batches as the RL job forms them: on CUDA, with the token budgets left at auto (the default), the
budgets the job would take from the card's free memory (spmdrl.rl.token_budgets, measured before the model
is built; printed, and in the JSON as ``update_token_budget`` / ``no_grad_token_budget``); on CPU the
shape's ``micro`` sequences. ``--micro N``: N sequences per micro-batch on any device (budgets off).

``--ragged``: rows of different lengths (each row's sampled part drawn from 1 to its maximum, right-padded),
so micro-batches carry padding as the RL job's do; the default rows are all ``--length`` long.

The config is ``recipe=grpo_tiny``'s with the batch arithmetic above (one mini-batch, ``rollout.n=1``) and
``--set KEY=VALUE`` overrides (repeatable) on top: any setting of the config (token budgets, fused kernels,
compile, activation checkpointing...) as the RL job reads it. ``--variant 'NAME=KEY=VALUE ...'``
(repeatable) measures the same again with those overrides added, each in its own model, figures
``update_profile/NAME/...`` with the default run's as baseline.

Memory, Qwen2.5-7B on one 80 GB card (7.62B parameters): fp32 master weights 30.5 GB + fp32 gradients
30.5 GB = 61 GB (56.8 GiB). AdamW's two fp32 moments would add 61 GB more: they do not fit, so 7B steps
with stateless SGD (``--optimizer sgd``, its default there; the forward and backward are the same, the step
an elementwise pass). With activation checkpointing (its default there) a micro-batch of 4 x 1024 tokens
keeps the 28 layers' inputs (4096 x 3584 x 2 B x 28 = 0.8 GB) and one layer's activations (~0.8 GB), plus
the bf16 copies FSDP2 gathers (embeddings and LM head 2.2 GB, a layer 0.5 GB) and the LM head's logits over
3072 sampled positions (152064 wide: 0.9 GB in bf16, ~2 GB each in fp32 for the log-softmax and its
gradient): ~66 GiB in all, under the card's 79 GiB.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from bench_report import Figure, write_json
from shapes import SHAPES


@dataclass(frozen=True)
class Workload:
    """A shape's default batch: rows x length tokens (prompt first), rows per micro-batch, checkpointing,
    optimizer. Sized for an H100 (80 GB) in well under a minute of steps; tiny for a CPU. ``budgets``:
    on CUDA the micro-batches are the job's token budgets (else ``micro`` rows everywhere)."""

    rows: int
    length: int
    prompt: int
    micro: int
    ac: str = "off"
    optimizer: str = "adamw"
    budgets: bool = True


WORKLOADS = {
    "tiny": Workload(rows=8, length=64, prompt=16, micro=2),
    "deep-narrow": Workload(rows=8, length=64, prompt=16, micro=2),
    "qwen2.5-0.5b": Workload(rows=32, length=1024, prompt=256, micro=8),
    "qwen2.5-1.5b": Workload(rows=32, length=1024, prompt=256, micro=4),
    # Fixed micro-batches: the job's budget on one GPU counts the whole 7B state (AdamW and a reference,
    # ~128 GiB), which leaves an H100 one row per micro-batch; the job would shard that over several GPUs.
    "qwen2.5-7b": Workload(
        rows=16, length=1024, prompt=256, micro=4, ac="full", optimizer="sgd", budgets=False
    ),
}
PREFIX = "update_profile/"
# The ATen ops that name the SDPA kernel a pass took (flash, memory-efficient, cuDNN, math, CPU flash).
ATTENTION_OPS = ("aten::_scaled_dot_product", "aten::_flash_attention", "aten::_efficient_attention")
VARIANT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--rows", type=int, default=0, help="sequences in the batch (default: the shape's)")
    p.add_argument("--length", type=int, default=0, help="tokens per sequence (default: the shape's)")
    p.add_argument("--prompt", type=int, default=-1, help="prompt tokens per sequence (default: the shape's)")
    p.add_argument(
        "--micro",
        type=int,
        default=0,
        help="N sequences per micro-batch, token budgets off (default: the job's: on CUDA its token budgets)",
    )
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="", help="default: the shape's")
    p.add_argument("--steps", type=int, default=3, help="timed passes of each kind after one warm-up")
    p.add_argument("--ragged", action="store_true", help="rows of different lengths, right-padded")
    p.add_argument(
        "--peak-tflops", type=float, default=0.0, help="the device's dense peak, if not in the table"
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    p.add_argument("--variant", action="append", default=[], metavar="'NAME=KEY=VALUE ...'")
    p.add_argument(
        "--plain",
        action="store_true",
        help="also the same work on the bare Hugging Face module (no FSDP2; column 'plain')",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="build every column first, then time them in turn, step by step (a shared machine's drift "
        "falls on all alike; no peak memory per column)",
    )
    p.add_argument("--json", default="", help="also write the figures to this JSON file")
    a = p.parse_args()
    w = WORKLOADS[a.shape]
    # a.fixed_micro: sequence-count micro-batches asked for; else the job's default (token budgets on CUDA).
    a.fixed_micro = a.micro > 0 or not w.budgets
    a.rows, a.length, a.micro = a.rows or w.rows, a.length or w.length, a.micro or w.micro
    a.prompt = w.prompt if a.prompt < 0 else a.prompt
    a.optimizer = a.optimizer or w.optimizer
    if a.micro < 0:
        p.error(f"--micro {a.micro}: sequences per micro-batch must be > 0 (or leave it out for the job's)")
    if not 0 < a.prompt < a.length:
        p.error(f"--prompt {a.prompt} must be between 0 and --length {a.length} (exclusive)")
    for s in a.set:
        if "=" not in s:
            p.error(f"--set {s!r}: expected KEY=VALUE")
    a.variants = {}
    for text in a.variant:
        name, _, rest = text.partition("=")
        if not VARIANT_NAME.fullmatch(name) or name == "default" or name in a.variants:
            p.error(f"--variant {text!r}: NAME must be a new word (letters, digits, _ or -), not 'default'")
        a.variants[name] = rest.split()
    return a


def config_overrides(a: argparse.Namespace) -> list[str]:
    """The batch arithmetic of one mini-batch of --rows sequences, before --set (which wins)."""
    w = WORKLOADS[a.shape]
    return [
        "recipe=grpo_tiny",
        "rollout.n=1",
        f"trainer.global_batch_size={a.rows}",
        f"algorithm.ppo_mini_batch_size={a.rows}",
        f"trainer.micro_batch_size={a.micro}",
        f"data.max_prompt_length={a.prompt}",
        f"data.max_response_length={a.length - a.prompt}",
        f"model.activation_checkpointing={w.ac}",
        "algorithm.use_kl_loss=true",  # the reference's KL term, as GRPO runs it
        *(
            ["trainer.ppo_max_token_len_per_gpu=0", "trainer.log_prob_max_token_len_per_gpu=0"]
            * a.fixed_micro
        ),
    ]


# ------------------------------------------------------------------------------------------- the model
def shape_config(shape: str) -> Any:
    """The HF config of a named shape (benchmarks/shapes.py)."""
    from transformers import Qwen2Config

    return Qwen2Config(**SHAPES[shape], max_position_embeddings=32768)


def job_token_budgets(shape: str, cfg: Any, device: torch.device, optimizer: str) -> tuple[int, int] | None:
    """The (update, no-grad) token budgets the RL job would take on this device (None: it keeps
    sequence counts), from the shape's config.json: spmdrl.rl.token_budgets, before the model is built.
    The job's memory model counts AdamW's two float32 moments (8 bytes per parameter); under ``--optimizer
    sgd`` (stateless) that memory is left to the micro-batches, as free memory on top of the card's."""
    import tempfile

    from spmdrl.distributed.placement import Placement
    from spmdrl.models.memory_model import DecoderShape
    from spmdrl.rl.token_budgets import measure_token_budgets, wants_memory_budgets

    if not wants_memory_budgets(cfg, device):
        return None
    hf = shape_config(shape)
    no_moments = 0 if optimizer == "adamw" else 8 * DecoderShape.from_hf(hf).params

    def mem_get_info(d: torch.device) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(d)
        return free + no_moments, total

    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        b = measure_token_budgets(
            cfg, Path(tmp), device, Placement.colocated(1), needs_critic=False, mem_get_info=mem_get_info
        )
    print(
        f"token budgets (the job's, from free memory{' + the moments SGD does not keep' * bool(no_moments)}): "
        f"update {b.train}, no-grad {b.no_grad} tokens",
        flush=True,
    )
    return b.train, b.no_grad


def init_random_(model: torch.nn.Module, device: torch.device) -> None:
    """Random weights, drawn in the parameters' order from one generator seeded on ``device`` (where they
    live): norms 1, biases 0, the rest N(0, 0.02). An FSDP2 model draws each local shard, which on one rank
    is the whole tensor, so the bare module (build_plain_model) gets the FSDP2 actor's weights exactly."""
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if name.endswith("norm.weight"):
                local.fill_(1.0)
            elif name.endswith(".bias"):
                local.zero_()
            else:
                local.normal_(0.0, 0.02, generator=g)


def build_random_actor(shape: str, cfg: Any, device: torch.device) -> torch.nn.Module:
    """The RL job's actor build (spmdrl.models.build.build_fsdp_model's steps 1-3: meta, checkpointing and
    FSDP2, materialize) with random weights instead of step 4's checkpoint: no file of 15-30 GB to write."""
    from transformers import AutoModelForCausalLM

    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import _params_on_meta, attention_kwargs, materialize, model_spec, parallelize
    from spmdrl.models.causal_attention import use_causal_sdpa

    spec = model_spec(cfg.model, Path(shape), device, train=True)
    hf = shape_config(shape)
    with _params_on_meta():  # parameters on meta, buffers (rotary frequencies) computed for real
        model = AutoModelForCausalLM.from_config(hf, dtype=torch.float32, **attention_kwargs(hf))
    buffers = [(m, n, b.detach().clone()) for m in model.modules() for n, b in m.named_buffers(recurse=False)]
    parallelize(model, spec, Placement.colocated(1).build_meshes(device.type).fsdp("actor"))
    materialize(model, spec, device, buffers)
    init_random_(model, torch.device("cpu") if spec.offload else device)
    model.config.use_cache = False
    use_causal_sdpa(model)  # as spmdrl.rl.models.build_models does
    model.train()
    return model


def synthetic_batch(a: argparse.Namespace, vocab: int, device: torch.device) -> Any:
    """--rows rows of --length tokens, the last --length - --prompt sampled; random advantages per row."""
    from spmdrl.rl.batch import PolicyBatch

    g = torch.Generator().manual_seed(0)
    B, T = a.rows, a.length
    ids = torch.randint(0, vocab, (B, T), generator=g)
    # --ragged: each row's sampled part from 1 token to all of it; right-padded, as the RL job's rows.
    len_B = (
        a.prompt + torch.randint(1, T - a.prompt + 1, (B,), generator=g) if a.ragged else torch.full((B,), T)
    )
    attn = (torch.arange(T)[None, :] < len_B[:, None]).long()
    resp = torch.zeros(B, T, dtype=torch.bool)
    resp[:, a.prompt :] = True
    resp &= attn.bool()
    engine = -torch.rand(B, T, generator=g) * resp
    adv = torch.randn(B, 1, generator=g) * resp
    ref = engine + 0.05 * torch.randn(B, T, generator=g) * resp
    batch = PolicyBatch(ids, attn, resp, engine, adv, ref_logprobs_BT=ref)
    return batch.to(device)


# -------------------------------------------------------------------------------- the plain baseline
def build_plain_model(shape: str, cfg: Any, device: torch.device) -> torch.nn.Module:
    """The bare Hugging Face module of the shape, as a single-GPU trainer without a framework holds it
    (TRL's GRPOTrainer on one GPU): float32 parameters on the device, no FSDP2, SDPA attention, Hugging
    Face's own activation checkpointing where the config asks for it; build_random_actor's weights
    (init_random_)."""
    from transformers import AutoModelForCausalLM

    from spmdrl.config import ac_mode

    model = AutoModelForCausalLM.from_config(
        shape_config(shape), dtype=torch.float32, attn_implementation="sdpa"
    ).to(device)
    init_random_(model, device)  # build_random_actor's weights
    model.config.use_cache = False
    if ac_mode(cfg.model.activation_checkpointing) != "off":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _autocast(device: torch.device) -> torch.autocast:
    """The plain passes' precision: bf16 autocast over float32 parameters on CUDA (spmdrl's param_dtype=auto
    there), float32 elsewhere."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def _span(rows: torch.Tensor, lengths: Any) -> tuple[int, int]:
    """(width, first sampled column) of a micro-batch of ``rows``, from the rows' host-side lengths."""
    picked = rows.tolist()
    return max(lengths.tokens[i] for i in picked), min(
        lengths.tokens[i] - lengths.response_tokens[i] for i in picked
    )


def _plain_logprobs(model: torch.nn.Module, mb: Any, first: int, temperature: float) -> torch.Tensor:
    """TRL's way: the LM head on the completion positions only (``logits_to_keep``), a float32
    log-softmax, each sampled token's logprob gathered; (rows, width - first), under the caller's
    autocast."""
    ids = mb.input_ids_BT
    keep = ids.shape[1] - first + 1
    logits = model(input_ids=ids, attention_mask=mb.attention_mask_BT, logits_to_keep=keep).logits[:, :-1]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, ids[:, first:, None]).squeeze(-1)


def plain_passes(
    cfg: Any, rl: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any, parts: list
) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The update and the no-grad forward on the bare module, over the micro-batches spmdrl's passes run
    (the update's plan from mini_batches, the no-grad pass's rows from micro_rows): per micro-batch the
    clipped policy loss with its k3 KL term against the reference, summed over sampled tokens and divided
    by the mini-batch's count (token-mean), backward; then clip_grad_norm_ and the optimizer step. bf16
    autocast on CUDA, float32 on CPU, as spmdrl's param_dtype=auto. No metrics, no checks: the floor."""
    from spmdrl.rl.settings import update_settings
    from spmdrl.rl.update import loss_modes, mini_batches

    a = cfg.algorithm
    device = batch.input_ids_BT.device
    autocast = _autocast(device)
    temperature = cfg.rollout.temperature
    plans = list(mini_batches(update_settings(cfg), rl, batch, loss_modes(cfg.algorithm)))
    counts = [int(sum(mb.response_mask_BT.sum() for mb in mbs)) for _, _, _, mbs, _ in plans]  # host, once

    def update() -> None:
        for (_, _, micro_plans, micro_batches, _), count in zip(plans, counts, strict=True):
            for plan, mb in zip(micro_plans, micro_batches, strict=True):
                first = plan.first_column
                with autocast:
                    lp = _plain_logprobs(model, mb, first, temperature)
                mask = mb.response_mask_BT[:, first:]
                adv = mb.advantages_BT[:, first:]
                ratio = torch.exp(lp - mb.engine_logprobs_BT[:, first:])
                clipped = torch.clamp(ratio, 1 - a.clip_ratio_low, 1 + a.clip_ratio_high)
                pg = -torch.min(ratio * adv, clipped * adv)
                d = mb.ref_logprobs_BT[:, first:] - lp
                kl = torch.exp(d) - d - 1
                loss = ((pg + a.kl_loss_coef * kl) * mask).sum() / count
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    lengths = batch.row_lengths()
    # (rows on the device, width, first sampled column), planned once on the host
    forward_parts = [(rows.to(device), *_span(rows, lengths)) for rows in parts]

    @torch.no_grad()
    def forward() -> None:
        for rows, width, first in forward_parts:
            with autocast:
                _plain_logprobs(model, batch.take(rows, width), first, temperature)

    return update, forward


@torch.no_grad()
def first_logprobs(
    model: torch.nn.Module, batch: Any, rows: torch.Tensor, temperature: float, plain: bool
) -> torch.Tensor:
    """The logprobs of the sampled tokens of ``rows`` (one no-grad micro-batch), flat, by spmdrl's pass or
    the plain one: the two runs' must agree (float32 on CPU: to rounding)."""
    from spmdrl.rl.update import logprobs_of

    device = batch.input_ids_BT.device
    width, first = _span(rows, batch.row_lengths())
    mb = batch.take(rows.to(device), width)
    mask = mb.response_mask_BT[:, first:].bool()
    if plain:
        with _autocast(device):
            return _plain_logprobs(model, mb, first, temperature)[mask].float()
    return logprobs_of(model, mb, [torch.arange(mb.num_rows)], temperature)[:, first:][mask].float()


# ------------------------------------------------------------------------------------------ measuring
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(run: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    run()
    _sync(device)
    return time.perf_counter() - t0


def time_pass(run: Callable[[], Any], device: torch.device, steps: int) -> list[float]:
    return [time_once(run, device) for _ in range(steps + 1)][1:]  # one warm-up


@dataclass
class Profiled:
    wall_s: float
    busy_s: float | None  # the device's kernels and copies, merged (CUDA only)
    launches: int  # CUDA kernels, or leaf ATen ops on CPU
    attention: list[str] = field(default_factory=list)  # the SDPA ops that ran (which kernel)
    # Host seconds inside each HOST_PARTS' profiler ranges (host_seconds), for the table's breakdown.
    host_parts: dict[str, float] = field(default_factory=dict)


# Host time by who spends it: profiler ranges (record_function names) by prefix. FSDP2 labels its hooks,
# gathers and reduces FSDP::...; torch.optim labels step and zero_grad.
HOST_PARTS = {"fsdp": ("FSDP::",), "optimizer": ("Optimizer.step#", "Optimizer.zero_grad#")}


def host_seconds(events: Any, prefixes: tuple[str, ...]) -> float:
    """Seconds of host time inside profiler ranges named with ``prefixes``: per thread, the union of their
    intervals (ranges nest: FSDP::pre_forward holds FSDP::all_gather), summed over threads (the autograd
    engine's device threads run the backward hooks)."""
    from torch.autograd import DeviceType

    by_thread: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e.name.startswith(prefixes) and e.device_type == DeviceType.CPU:
            by_thread.setdefault(e.thread, []).append((e.time_range.start, e.time_range.end))
    return sum(union_us(spans) for spans in by_thread.values()) / 1e6


def union_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals, in their unit (the profiler's us): overlapping
    ones (nested ranges, kernels on several streams) count once."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def profile_pass(run: Callable[[], Any], device: torch.device) -> Profiled:
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        run()
        _sync(device)
        wall = time.perf_counter() - t0
    events = prof.events()
    attention = sorted({e.name for e in events if e.name.startswith(ATTENTION_OPS)})
    host = {part: host_seconds(events, prefixes) for part, prefixes in HOST_PARTS.items()}
    if not cuda:
        leaves = [
            e
            for e in events
            if e.name.startswith("aten::") and not any(c.name.startswith("aten::") for c in e.cpu_children)
        ]
        return Profiled(wall, None, len(leaves), attention, host)
    from torch.autograd import DeviceType

    device_events = [e for e in events if e.device_type == DeviceType.CUDA]
    kernels = [e for e in device_events if not e.name.lower().startswith(("memcpy", "memset"))]
    busy = union_us([(e.time_range.start, e.time_range.end) for e in device_events])
    return Profiled(wall, busy / 1e6, len(kernels), attention, host)


def count_syncs(run: Callable[[], Any], device: torch.device, host: list[torch.Tensor]) -> tuple[int, str]:
    """Host-device syncs of one pass, and where (the most frequent places)."""
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                run()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        places = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})
        return len(syncs), ", ".join(places[:8])
    from spmdrl.testing.syncs import SyncCounter

    with SyncCounter() as c:
        c.mark_host(*host)
        run()
    return c.count(), c.summary().replace("\n", "; ")


# ------------------------------------------------------------------------------------------- a run
@dataclass
class Result:
    figures: dict[str, tuple[float, str]] = field(default_factory=dict)  # key -> (value, unit)
    context: dict[str, Any] = field(default_factory=dict)
    # The first no-grad micro-batch's logprobs of its sampled tokens, before any update: the plain run
    # must score what spmdrl's does (the same weights, build_plain_model).
    probe: torch.Tensor | None = None


@dataclass
class Column:
    """One column of the table, built and ready to run: spmdrl's passes with some overrides, or the plain
    ones (plain_passes)."""

    cfg: Any
    rl: Any
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    parts: list
    passes: dict[str, tuple[Callable[[], Any], int]]  # name -> (run it once, its micro-batches)
    flops: dict[str, tuple[float, float]]  # name -> (model FLOPs, hardware FLOPs)
    tokens: int
    probe: torch.Tensor  # first_logprobs, taken before any pass


def build_column(
    a: argparse.Namespace, overrides: list[str], device: torch.device, plain: bool = False
) -> Column:
    """spmdrl's passes with ``overrides``, or (``plain``) the same work on the bare module."""
    from spmdrl.config import ac_mode, derive, derive_rl
    from spmdrl.config_loader import load_config
    from spmdrl.logging.flops import DecoderShape, forward_flops, training_flops
    from spmdrl.optim import build_optimizer
    from spmdrl.rl.settings import update_settings
    from spmdrl.rl.update import logprobs_of, loss_modes, micro_rows, mini_batches, update_policy

    cfg = load_config([*config_overrides(a), *a.set, *overrides])
    budgets = job_token_budgets(a.shape, cfg, device, a.optimizer)
    rl = derive_rl(cfg, derive(cfg, 1, a.rows, samples_per_item=1), memory_budgets=budgets)
    model = build_plain_model(a.shape, cfg, device) if plain else build_random_actor(a.shape, cfg, device)
    if a.optimizer != "adamw":  # stateless: no moments (the 7B arithmetic in the docstring)
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr)
    elif plain:  # Hugging Face Trainer's default (adamw_torch_fused) on a GPU; foreach, as spmdrl's, on CPU
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=cfg.optim.lr,
            weight_decay=cfg.optim.weight_decay,
            fused=device.type == "cuda",
        )
    else:
        optimizer = build_optimizer(model, cfg.optim)
    batch = synthetic_batch(a, model.config.vocab_size, device)
    parts = micro_rows(cfg.trainer, rl, batch)
    lengths = batch.row_lengths()
    shape = DecoderShape.from_hf_config(model.config)
    epochs = cfg.algorithm.ppo_epochs
    # The update's own plan (its token budget, each mini-batch alone), every epoch.
    n_micro_update = sum(
        len(plan)
        for _, _, plan, _, _ in mini_batches(update_settings(cfg), rl, batch, loss_modes(cfg.algorithm))
    )
    if plain:
        update, forward = plain_passes(cfg, rl, model, optimizer, batch, parts)
    else:

        def update() -> Any:
            return update_policy(update_settings(cfg), rl, model, optimizer, batch)

        def forward() -> Any:
            return logprobs_of(model, batch, parts, cfg.rollout.temperature, cfg.trainer.pack_sequences)

    train = training_flops(
        shape,
        lengths.tokens,
        lengths.response_tokens,
        recompute=ac_mode(cfg.model.activation_checkpointing),
        every=cfg.model.activation_checkpointing_every,
    )
    return Column(
        cfg=cfg,
        rl=rl,
        model=model,
        optimizer=optimizer,
        parts=parts,
        passes={"update": (update, n_micro_update), "forward": (forward, len(parts))},
        flops={
            "update": (train.model * epochs, train.hardware * epochs),
            "forward": (forward_flops(shape, lengths.tokens, lengths.response_tokens).model,) * 2,
        },
        tokens=sum(lengths.tokens) * epochs,
        probe=first_logprobs(model, batch, parts[0], cfg.rollout.temperature, plain),
    )


def time_columns(cols: list[Column], device: torch.device, steps: int) -> list[dict[str, list[float]]]:
    """Each column's passes timed in turn, step by step (one warm-up, then ``steps``), so every column
    meets the same moments of a shared machine: ratios between columns hold where absolute times drift."""
    times: list[dict[str, list[float]]] = [{name: [] for name in c.passes} for c in cols]
    for _ in range(steps + 1):
        for c, t in zip(cols, times, strict=True):
            for name, (run, _) in c.passes.items():
                t[name].append(time_once(run, device))
    return [{name: v[1:] for name, v in t.items()} for t in times]


def measure(
    c: Column, times: dict[str, list[float]], device: torch.device, peak: float | None, memory: bool = True
) -> Result:
    """The figures of a built column from its passes' ``times``, then each pass once under the profiler
    and once counting syncs. ``memory``: report the peak (only when this column alone was on the device)."""
    from spmdrl.logging.flops import utilization

    r = Result(probe=c.probe)
    launch_unit = "kernels" if device.type == "cuda" else "aten ops (CPU proxy)"
    # Every pass timed and profiled before any is counted for syncs: on CPU the counter is a dispatch
    # mode, under which torch.compile (model.compile) gives up on the blocks' frame for good, so a pass
    # after it would run eager.
    profiled = {name: profile_pass(run, device) for name, (run, _) in c.passes.items()}
    for name, (run, n_micro) in c.passes.items():
        prof = profiled[name]
        seconds = statistics.median(times[name])
        model_flops, hw_flops = c.flops[name]
        host = [s["step"] for s in c.optimizer.state.values() if "step" in s] + list(c.parts)
        syncs, where = count_syncs(run, device, host)
        f = r.figures
        f[f"{name}_s"] = (seconds, "s")
        tokens = c.tokens if name == "update" else c.tokens // c.cfg.algorithm.ppo_epochs
        f[f"tokens_per_s_{name}"] = (tokens / seconds, "tokens/s")
        f[f"tflops_{name}"] = (model_flops / seconds / 1e12, "TFLOP/s")
        mfu = utilization(model_flops, seconds, 1, peak)
        if mfu is not None:
            f[f"mfu_{name}"] = (mfu, "fraction")
            if name == "update":
                f["hfu_update"] = (utilization(hw_flops, seconds, 1, peak) or 0.0, "fraction")
        if prof.busy_s is not None:
            f[f"gpu_busy_{name}"] = (prof.busy_s / prof.wall_s, "fraction")
        f[f"launches_per_micro_batch_{name}"] = (prof.launches / n_micro, launch_unit)
        for part, seconds_in in prof.host_parts.items():
            f[f"{part}_host_s_{name}"] = (seconds_in, "s (profiled)")
            f[f"{part}_host_share_{name}"] = (seconds_in / prof.wall_s, "fraction")
        f[f"syncs_{name}"] = (float(syncs), "syncs")
        f[f"syncs_per_micro_batch_{name}"] = (syncs / n_micro, "syncs")
        r.context[f"{name}_micro_batches"] = n_micro
        r.context[f"{name}_model_flops"] = model_flops
        r.context[f"{name}_hardware_flops"] = hw_flops
        r.context[f"{name}_sync_places"] = where
        r.context[f"{name}_attention_ops"] = ", ".join(prof.attention)
        print(
            f"{name}: {seconds:.3f} s, {model_flops / seconds / 1e12:.2f} TFLOP/s"
            + (f", MFU {mfu:.3f}" if mfu is not None else "")
            + f", {n_micro} micro-batches, {syncs} syncs, attention: {', '.join(prof.attention) or '-'}",
            flush=True,
        )
    if device.type == "cuda" and memory:
        r.figures["peak_memory_gb"] = (torch.cuda.max_memory_allocated(device) / 2**30, "GiB")
    r.context["params"] = sum(p.numel() for p in c.model.parameters())
    r.context["update_token_budget"] = c.rl.ppo_max_token_len
    r.context["no_grad_token_budget"] = c.rl.log_prob_max_token_len
    r.context["activation_checkpointing"] = str(c.cfg.model.activation_checkpointing)
    return r


def print_table(runs: dict[str, Result]) -> None:
    names = list(runs)
    base = runs["default"].figures
    keys = [k for k in base] + sorted({k for r in runs.values() for k in r.figures} - set(base))
    # Each column at least one space wider than its name (a variant's name may be long).
    wide = {n: max(14, len(n) + 2) for n in names}
    ratio_wide = {n: max(18, len(n) + 10) for n in names}
    header = f"{'figure':<34}" + "".join(f"{n:>{wide[n]}}" for n in names)
    header += "".join(f"{n + '/default':>{ratio_wide[n]}}" for n in names[1:])
    print(header)
    for k in keys:
        cells = "".join(
            f"{runs[n].figures[k][0]:>{wide[n]}.4g}" if k in runs[n].figures else f"{'-':>{wide[n]}}"
            for n in names
        )
        ratios = ""
        for n in names[1:]:
            v, b = runs[n].figures.get(k), base.get(k)
            ratios += f"{v[0] / b[0]:>{ratio_wide[n]}.2f}" if v and b and b[0] else f"{'-':>{ratio_wide[n]}}"
        unit = next(r.figures[k][1] for r in runs.values() if k in r.figures)
        print(f"{k:<34}{cells}{ratios}  {unit}")


def main() -> None:
    a = _args()
    from spmdrl.distributed.env import init_distributed
    from spmdrl.logging.flops import device_peak_flops

    env = init_distributed("auto")
    device = env.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = a.peak_tflops * 1e12 if a.peak_tflops > 0 else device_peak_flops(device)
    peak_note = "--peak-tflops" if a.peak_tflops > 0 else ("table" if peak else "unknown: no MFU")
    print(
        f"update profile: {a.shape}, {a.rows} rows x {a.length} tokens ({a.prompt} prompt), micro-batches "
        f"of {a.micro} sequences{'' if a.fixed_micro else ' or the token budgets'}, {a.optimizer}; device {name}, peak {peak / 1e12 if peak else 0:.1f} TFLOP/s ({peak_note})",
        flush=True,
    )
    runs: dict[str, Result] = {}
    columns = [(vname, overrides, False) for vname, overrides in [("default", []), *a.variants.items()]]
    columns += [("plain", [], True)] * a.plain
    if a.interleave:  # every column built first, then timed in turn (time_columns)
        built = {}
        for vname, overrides, plain in columns:
            print(f"== building {vname}: {' '.join([*a.set, *overrides]) or '(no overrides)'}", flush=True)
            built[vname] = build_column(a, overrides, device, plain)
        times = time_columns(list(built.values()), device, a.steps)
        for (vname, col), t in zip(built.items(), times, strict=True):
            print(f"== {vname}", flush=True)
            runs[vname] = measure(col, t, device, peak, memory=False)
    else:  # one column at a time: each alone on the device (its peak memory its own)
        for vname, overrides, plain in columns:
            print(f"== {vname}: {' '.join([*a.set, *overrides]) or '(no overrides)'}", flush=True)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            col = build_column(a, overrides, device, plain)
            t = {name: time_pass(run, device, a.steps) for name, (run, _) in col.passes.items()}
            runs[vname] = measure(col, t, device, peak)
            del col
            gc.collect()  # the run's model and optimizer, before the next one's
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"\nupdate profile: {a.shape} on {name}")
    print_table(runs)
    if a.plain:
        base, bare = runs["default"].figures, runs["plain"].figures
        for k in ("update_s", "forward_s"):
            print(f"spmdrl / plain, {k.removesuffix('_s')}: {base[k][0] / bare[k][0]:.2f}x the time")
        for k in ("update", "forward"):  # how much of the difference FSDP2's own host work is
            fsdp = base[f"fsdp_host_s_{k}"][0]
            print(
                f"spmdrl's {k}: {fsdp:.4f} s of host time in FSDP2 ({base[f'fsdp_host_share_{k}'][0]:.1%} of "
                f"the profiled pass), against a gap to plain of {base[f'{k}_s'][0] - bare[f'{k}_s'][0]:.4f} s"
            )
        ours, theirs = runs["default"].probe, runs["plain"].probe
        assert ours is not None and theirs is not None
        diff = float((ours - theirs).abs().max()) if ours.shape == theirs.shape else float("inf")
        bare["logprob_max_abs_diff"] = (diff, "nats")
        print(
            f"spmdrl / plain, the first micro-batch's logprobs before any update: max |diff| {diff:.3g} nats"
        )
    if a.json:
        base = runs["default"].figures
        figs = [Figure(f"{PREFIX}{k}", v, u) for k, (v, u) in base.items()]
        for vname, r in runs.items():
            if vname != "default":
                figs += [
                    Figure(f"{PREFIX}{vname}/{k}", v, u, base[k][0] if k in base else None)
                    for k, (v, u) in r.figures.items()
                ]
        write_json(
            a.json,
            "update_profile",
            figs,
            device=device.type,
            device_name=name,
            peak_flops=peak,
            peak_source=peak_note,
            shape=a.shape,
            rows=a.rows,
            length=a.length,
            prompt=a.prompt,
            micro_batch_size=a.micro,
            optimizer=a.optimizer,
            overrides=a.set,
            variants=a.variants,
            **{f"{k}": v for k, v in runs["default"].context.items()},
        )
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
