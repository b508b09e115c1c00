"""Requests to an in-process vLLM engine and what comes back: sampling parameters, the sampler's seed,
vLLM's outputs as :class:`~spmdrl.rollout.engine.Generation` / ``TurnOutput``, and the stepper a
multi-turn rollout drives (:meth:`spmdrl.rollout.vllm_engine.VLLMEngine.stepper`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from spmdrl.rollout.engine import Generation, SamplingSpec, TurnOutput
from spmdrl.rollout.engine_ranks import EngineWorld


def seed_sampler(seed: int, device_type: str) -> None:
    """``rollout.seed_per_request=false``: what vLLM samples requests without a seed of their own from,
    seeded (inside :func:`spmdrl.rollout.vllm_process.isolated_rng`, which puts the trainer's states
    back): the device's torch generator (V1's batch noise on CUDA; the CPU sampler's) and numpy's (V2
    draws each unseeded request's seed from it). The same calls in the same order then give the same
    samples, on every TP rank of an engine alike."""
    random.seed(seed)
    np.random.seed(seed)
    torch.default_generator.manual_seed(seed)
    if device_type == "cuda":
        torch.cuda.manual_seed(seed)  # the current device's generator


def sampling_params(
    spec: SamplingSpec,
    *,
    final_only: bool = False,
    end_of_turn_ids: Iterable[int] = (),
    seeded: bool = True,
    allowed_token_ids: list[int] | None = None,
) -> Any:
    """vLLM's SamplingParams for a spec whose ``seed`` is the request's own (dropped unless ``seeded``:
    :func:`seed_sampler`); ``end_of_turn_ids`` end a sample too (:func:`spmdrl.data.turns.end_of_turn_ids`)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kwargs: dict[str, Any] = {}
    if final_only:  # the stepper reads only finished requests (LLM.generate sets the same itself)
        kwargs["output_kind"] = RequestOutputKind.FINAL_ONLY
    return SamplingParams(
        n=spec.n,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        max_tokens=spec.max_tokens,
        stop=list(spec.stop) or None,
        stop_token_ids=sorted({*spec.stop_token_ids, *end_of_turn_ids}) or None,
        seed=spec.seed if seeded else None,
        logprobs=0 if spec.logprobs else None,
        flat_logprobs=True,
        # Recipes decode token ids themselves; vLLM's incremental detokenizer is per-token Python work
        # (about 5-10% of CPU rollout time). Stop strings need it.
        detokenize=bool(spec.stop),
        # A vision-language model's: every token but its image tokens (spmdrl.data.vision.image_token_ids).
        allowed_token_ids=allowed_token_ids,
        **kwargs,
    )


class VLLMStepper:
    """One multi-turn rollout's view of the in-process ``LLMEngine`` (see ``VLLMEngine.stepper``)."""

    def __init__(
        self,
        llm_engine: Any,
        end_of_turn_ids: list[int],
        world: EngineWorld,
        *,
        seed_per_request: bool = True,
        device_type: str = "cpu",
        allowed_token_ids: list[int] | None = None,
    ) -> None:
        self.engine = llm_engine
        self.end_of_turn_ids = end_of_turn_ids
        # A vision-language model's: every token but its image tokens (VLLMEngine.allowed_token_ids).
        self.allowed_token_ids = allowed_token_ids
        # rollout.seed_per_request=false: requests carry no seed; the first one's seeds the sampler.
        self.seed_per_request = seed_per_request
        self.device_type = device_type
        self._sampler_seeded = False
        # Each call into vLLM runs in its world; the agent loop between calls in the trainer's.
        self.world = world
        self.unfinished: set[str] = set()
        # track_partial requests: their latest cumulative (token ids, logprobs, whether logprobs are on),
        # as vLLM's output processor hands them out (without detokenizing, references to its own lists,
        # so no copy per step); converted only when read.
        self.progress: dict[str, tuple[Any, Any, bool]] = {}

    def add(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingSpec,
        *,
        track_partial: bool = False,
        images: Sequence[Any] = (),
    ) -> None:
        from vllm.inputs import TokensPrompt

        if params.n != 1:
            raise ValueError(f"EngineStepper.add: one sample per request, got n={params.n}")
        if request_id in self.unfinished:
            raise ValueError(f"EngineStepper.add: request {request_id!r} is already running")
        # Tracked requests report every step (vLLM's cumulative output kind), the others only at the end.
        if not self.seed_per_request and not self._sampler_seeded:
            seed_sampler(params.seed if params.seed is not None else 0, self.device_type)
            self._sampler_seeded = True
        sampling = sampling_params(
            params,
            final_only=not track_partial,
            end_of_turn_ids=self.end_of_turn_ids,
            seeded=self.seed_per_request,
            allowed_token_ids=self.allowed_token_ids,
        )
        prompt = TokensPrompt(prompt_token_ids=prompt_ids)
        if images:  # one placeholder per image in prompt_ids: vLLM expands each to the image's tokens
            prompt["multi_modal_data"] = {"image": list(images)}
        with self.world.vllm():
            self.engine.add_request(request_id, prompt, sampling)
        self.unfinished.add(request_id)

    def partial(self, request_id: str) -> TurnOutput | None:
        seen = self.progress.get(request_id)
        if seen is None:
            return None
        token_ids, lps, want_logprobs = seen
        ids = list(token_ids)
        return TurnOutput(request_id, ids, _sampled_logprobs(lps, ids) if want_logprobs else [], "")

    def step(self) -> list[TurnOutput]:
        done: list[TurnOutput] = []
        with self.world.vllm():
            outputs = self.engine.step()
        for out in outputs:
            if not out.finished:
                (completion,) = out.outputs
                self.progress[out.request_id] = (
                    completion.token_ids,
                    completion.logprobs,
                    completion.logprobs is not None,
                )
                continue
            self.unfinished.discard(out.request_id)
            self.progress.pop(out.request_id, None)
            (completion,) = out.outputs
            gen = to_generation(0, completion, completion.logprobs is not None)
            done.append(TurnOutput(out.request_id, gen.token_ids, gen.logprobs, gen.finish_reason))
        return done

    def abort(self, request_ids: list[str]) -> None:
        ids = [r for r in request_ids if r in self.unfinished]
        if ids:
            with self.world.vllm():
                self.engine.abort_request(ids)
            self.unfinished.difference_update(ids)
            for r in ids:
                self.progress.pop(r, None)

    def abort_all(self) -> None:
        self.abort(sorted(self.unfinished))

    def num_unfinished(self) -> int:
        return len(self.unfinished)


def to_generation(prompt_index: int, completion: Any, want_logprobs: bool) -> Generation:
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a request with {completion.finish_reason!r} (aborted?)")
    token_ids = list(completion.token_ids)
    logprobs: list[float] = []
    if want_logprobs:
        logprobs = _sampled_logprobs(completion.logprobs, token_ids)
    return Generation(prompt_index, token_ids, logprobs, completion.finish_reason)


def _sampled_logprobs(lps: Any, token_ids: list[int]) -> list[float]:
    """The sampled token's logprob at each position (``logprobs=0`` returns exactly that one entry)."""
    from vllm.logprobs import FlatLogprobs

    if lps is None or len(lps) != len(token_ids):
        raise RuntimeError(
            f"vLLM returned {0 if lps is None else len(lps)} logprobs for {len(token_ids)} tokens"
        )
    if isinstance(lps, FlatLogprobs):
        if len(lps.logprobs) == len(token_ids) and lps.token_ids == token_ids:
            return list(lps.logprobs)
        # More than one entry at some position (should not happen with logprobs=0): pick the sampled one.
        out = []
        for pos, tok in enumerate(token_ids):
            span = range(lps.start_indices[pos], lps.end_indices[pos])
            out.append(next(lps.logprobs[j] for j in span if lps.token_ids[j] == tok))
        return out
    return [position[tok].logprob for position, tok in zip(lps, token_ids, strict=True)]
