"""The ``reward`` and ``reward_model`` sections: the rule reward function and its limits, DAPO's overlong
shaping, a reward model and an LLM judge, and the checks of those values alone (spmdrl.config.validate
checks them against the other sections: the trainer's timeout, the placement, the response length)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from spmdrl.config_section import choice, registered
from spmdrl.errors import ConfigError


def _check_finite(values: dict[str, float]) -> None:
    for key, value in values.items():
        if not math.isfinite(
            value
        ):  # it would make every reward it touches NaN or inf, caught only at step 1
            raise ConfigError(f"{key} must be a finite number, got {value}")


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping (verl: reward_model.overlong_buffer): a penalty growing linearly
    over the last ``len`` tokens before data.max_response_length, up to -penalty_factor."""

    enable: bool = False
    len: int = 4
    penalty_factor: float = 1.0


@dataclass
class RewardConfig:
    # "auto" (by data_source), "gsm8k", "tiny", "tiny_tools", "last_number", a user function "pkg.module:fn" /
    # "path/file.py:fn", or one registered with @register_reward_fn (docs/rewards.md).
    fn: str = registered("auto", "spmdrl.rewards.registry", "REWARD_FNS")
    # Seconds a user function may run per sample; past that it scores error_score (counted in reward/errors).
    timeout_s: float = 10.0
    # Seconds one rank's whole batch may take: samples not scored by then score error_score (counted as
    # timeouts). Must stay below trainer.collective_timeout_min, so a slow reward is named as such
    # instead of surfacing as another rank's collective timeout.
    batch_timeout_s: float = 120.0
    error_score: float = 0.0
    # Stop the run (every rank at once, non-zero exit) when more than this fraction of a step's samples
    # failed to score (raised, returned a bad value, timed out). 1.0: never stop.
    max_error_frac: float = 0.5
    # Limits of each reward worker process (0: unlimited): address space and largest file it may write.
    worker_memory_mb: int = 4096
    worker_file_size_mb: int = 64
    overlong_buffer: OverlongBufferConfig = field(default_factory=lambda: OverlongBufferConfig())
    # The rule reward's weight in a step's training reward when a reward model or judge also scores
    # (reward = rule_weight * rule + reward_model.weight * rm + reward_model.judge.weight * judge;
    # docs/rewards.md#reward-models). Validation's accuracy is always the rule's alone.
    rule_weight: float = 1.0

    def check(self) -> None:
        if not 0.0 <= self.max_error_frac <= 1.0:
            raise ConfigError(f"reward.max_error_frac must be in [0, 1], got {self.max_error_frac}")
        _check_finite({"reward.error_score": self.error_score, "reward.rule_weight": self.rule_weight})
        if self.timeout_s <= 0:
            raise ConfigError(f"reward.timeout_s must be > 0, got {self.timeout_s}")


# The judge's default prompt: the policy is asked for a 0-10 grade; the regex below reads it.
JUDGE_TEMPLATE = (
    "Rate the answer to the question from 0 to 10.\nQuestion: {prompt}\nAnswer: {response}\n"
    "Reply with 'Score: <number>'."
)


@dataclass
class JudgeConfig:
    """A generative reward: an LLM judge served by the run's own engine (spmdrl/rewards/judge.py)."""

    enable: bool = False
    # The judge's model. "": the policy itself, served by the run's in-process engine (the only one
    # supported for now; a separate judge engine is refused at config load).
    path: str = ""
    # Rendered as the user turn of the judge's chat: {prompt} (the sample's prompt, its last user
    # message), {response}, and optionally {ground_truth}.
    template: str = JUDGE_TEMPLATE
    # The score is the regex's first group, as a float, in the judge's reply (its first match). A reply
    # without a match scores reward.error_score and is counted in reward/errors.
    score_regex: str = r"[Ss]core:\s*(-?\d+(?:\.\d+)?)"
    temperature: float = 0.0
    max_tokens: int = 16
    weight: float = 1.0

    def check(self) -> None:
        """What is not supported yet, and a template or regex that cannot work."""
        import re
        import string

        if not self.enable:
            return
        if self.path:
            raise ConfigError(
                f"reward_model.judge.path={self.path!r}: a separate judge engine is not supported yet; leave it "
                "empty to judge with the policy's own engine"
            )
        if self.max_tokens <= 0 or self.temperature < 0:
            raise ConfigError(
                f"reward_model.judge.max_tokens must be > 0 and temperature >= 0, got {self.max_tokens}, "
                f"{self.temperature}"
            )
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(self.template) if name is not None}
        except ValueError as e:
            raise ConfigError(f"reward_model.judge.template does not parse as a format string: {e}") from None
        unknown = fields - {"prompt", "response", "ground_truth"}
        if unknown or "response" not in fields:
            raise ConfigError(
                f"reward_model.judge.template must contain {{response}} and may contain {{prompt}} and "
                f"{{ground_truth}} only (double other braces: {{{{ }}}}); it has {sorted(fields)}"
            )
        try:
            groups = re.compile(self.score_regex).groups
        except re.error as e:
            raise ConfigError(
                f"reward_model.judge.score_regex={self.score_regex!r} is not a regex: {e}"
            ) from None
        if groups < 1:
            raise ConfigError(
                f"reward_model.judge.score_regex={self.score_regex!r} needs a group around the number, e.g. "
                r"'Score:\s*(\d+)'"
            )


@dataclass
class RewardModelConfig:
    """A sequence-classification reward model (num_labels=1) scoring every sample, weighted with the rule
    reward (spmdrl/rl/reward_model.py; docs/rewards.md#reward-models). verl's reward_model.enable,
    .model.path (here ``path``), .micro_batch_size_per_gpu and .max_length."""

    enable: bool = False
    # An HF directory of a *ForSequenceClassification model with its tokenizer and chat template (an
    # rm_tiny export, say).
    path: str = ""
    # Sequences per no-grad forward on one rank.
    micro_batch_size_per_gpu: int = 8
    # Tokens of a rendered (prompt, response) the model reads; longer ones keep their end (where the score
    # is read). 0: the model's max_position_embeddings.
    max_length: int = 0
    # Where the reward model lives (the judge always uses the run's own engine, wherever that is).
    # "colocated": every rank holds the model sharded with FSDP2 over the actor's ranks and scores its own
    # samples. "separate": on the rollout ranks of parallel.placement=async (entry grpo_async), sharded
    # over them, next to the engines; refused with any other placement. Under parallel.placement=async the
    # reward model is always there, so "colocated" means the same (docs/rewards.md#reward-models).
    placement: str = choice("colocated", ("colocated", "separate"))
    weight: float = 1.0
    judge: JudgeConfig = field(default_factory=lambda: JudgeConfig())

    def check(self) -> None:
        """Values that cannot work (where the model may live is checked with parallel.placement, in
        spmdrl.config.validate)."""
        if self.enable and not self.path:
            raise ConfigError(
                "reward_model.enable=true needs reward_model.path: an HF sequence-classification model directory "
                "(e.g. the hf_model of a recipe=rm_tiny run)"
            )
        if self.micro_batch_size_per_gpu <= 0 or self.max_length < 0:
            raise ConfigError(
                f"reward_model.micro_batch_size_per_gpu must be > 0 and reward_model.max_length >= 0 (0: the "
                f"model's limit), got {self.micro_batch_size_per_gpu}, {self.max_length}"
            )
        _check_finite({"reward_model.weight": self.weight, "reward_model.judge.weight": self.judge.weight})
        self.judge.check()
