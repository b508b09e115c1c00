"""The generative judge on the run's own in-process engine (the policy's): each sample's judge prompt
(spmdrl/rewards/judge.py renders it and parses the reply) generated on every rank, as the rollout is.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from spmdrl.data.prompts import encode
from spmdrl.rewards.config import JudgeConfig
from spmdrl.rewards.judge import last_user_message, parse_score, render_judge_prompt
from spmdrl.rollout.engine import RolloutEngine, SamplingSpec

log = logging.getLogger(__name__)
# A reply is quoted in the warning up to this many characters.
_REPLY_CHARS = 300


class Judge:
    """The judge on this rank: renders, generates on ``engine`` (every rank calls :meth:`score` together,
    as it calls the rollout), parses."""

    def __init__(
        self,
        cfg: JudgeConfig,
        engine: RolloutEngine,
        tokenizer: Any,
        *,
        max_model_len: int,
        error_score: float,
    ) -> None:
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.pattern = re.compile(cfg.score_regex)
        # The judge's prompt keeps its end (the response and the request for a score) within the context.
        self.max_prompt_tokens = max(max_model_len - cfg.max_tokens, 1)
        self.error_score = error_score
        self.last_replies: list[str] = []  # the latest call's replies (samples, tests)

    def prompt_ids(
        self, messages: list[list[dict[str, str]]], responses: list[str], truths: list[str]
    ) -> list[list[int]]:
        out = []
        for m, r, t in zip(messages, responses, truths, strict=True):
            text = render_judge_prompt(
                self.cfg.template, prompt=last_user_message(m), response=r, ground_truth=t
            )
            chat = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            out.append(encode(self.tokenizer, chat)[-self.max_prompt_tokens :])
        return out

    def score(
        self, messages: list[list[dict[str, str]]], responses: list[str], truths: list[str], seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores_B, parsed_B)``: each sample's score (error_score where the reply did not parse) and
        whether it parsed."""
        spec = SamplingSpec(
            n=1, temperature=self.cfg.temperature, max_tokens=self.cfg.max_tokens, seed=seed, logprobs=False
        )
        gens = sorted(
            self.engine.generate(self.prompt_ids(messages, responses, truths), spec),
            key=lambda g: g.prompt_index,
        )
        self.last_replies = self.tokenizer.batch_decode([g.token_ids for g in gens], skip_special_tokens=True)
        parsed = [parse_score(r, self.pattern) for r in self.last_replies]
        failed = [i for i, p in enumerate(parsed) if p is None]
        if failed:
            # What the judge wrote is what tells a template or regex problem from cut-off replies.
            log.warning(
                "judge: %d of %d replies did not parse with reward_model.judge.score_regex=%r "
                "(max_tokens=%d), scored %s; first (sample %d): %r",
                len(failed),
                len(parsed),
                self.cfg.score_regex,
                self.cfg.max_tokens,
                self.error_score,
                failed[0],
                self.last_replies[failed[0]][:_REPLY_CHARS],
            )
        scores_B = torch.tensor([self.error_score if p is None else p for p in parsed], dtype=torch.float32)
        return scores_B, torch.tensor([p is not None for p in parsed])
