"""The ``parallel`` section: how the roles are placed on the ranks and how each role's ranks shard."""

from __future__ import annotations

from dataclasses import dataclass

from spmdrl.config_section import choice
from spmdrl.errors import ConfigError


@dataclass
class ParallelConfig:
    # "colocated": every role spans every rank and time-shares it (the hybrid engine).
    # "split": the actor (and its reference) trains on the first ranks, the critic on the last
    # critic_ranks ranks, each with its own mesh; every rank still generates (docs/architecture.md).
    # "async" (entry grpo_async, docs/async.md): the last rollout_ranks ranks only generate and score, the
    # first ones only train; generation runs up to trainer.max_staleness batches ahead of the update.
    placement: str = choice("colocated", ("colocated", "split", "async"))
    # split: how many ranks (the last ones) hold the critic; 0 = half the world.
    critic_ranks: int = 0
    # async: how many ranks (the last ones) hold the rollout engines and the reward function; 0 = half.
    rollout_ranks: int = 0
    # Before each update, give every rank of a role the same number of rows and about the same number of
    # tokens (greedy longest-first per mini-batch; spmdrl/distributed/exchange.py). Logged as
    # balance/<role>_token_imbalance (max / mean tokens per rank) with its value before balancing.
    balance_tokens: bool = False
    # On-policy distillation (teacher.path), placement colocated: 0 shards the teacher over the actor's ranks,
    # like the reference (nothing moves). N > 0 puts it on ranks of its own, the last N, which hold no actor:
    # the actor and its reference train on the first world - N ranks; every rank still generates (the
    # teacher's ranks get the actor's weights by broadcast, as split's critic ranks do); each step's rows go
    # to the teacher's ranks to be scored and to the actor's ranks, with the teacher's logprobs, to be
    # trained on (docs/algorithms.md#the-teacher-on-ranks-of-its-own).
    teacher_ranks: int = 0
    # HSDP: replicate over dp_replicate groups, shard within each (within each role's ranks).
    # 1 means plain FSDP over the role's ranks.
    dp_replicate: int = 1
    # Expert parallelism for a mixture-of-experts actor (torchtitan's ep; Megatron's
    # expert_model_parallel_size): groups of ep consecutive actor ranks each hold num_experts / ep of every
    # MoE layer's experts, tokens reach them by all-to-all, and FSDP2 shards each expert over the actor ranks
    # holding it (spmdrl/models/expert_parallel.py, docs/models.md#expert-parallelism). 1 = none: FSDP2
    # shards every expert over all the actor's ranks. The reference and the critic do not use it. With
    # placement colocated or async (the trainer ranks) and with teacher_ranks (the ranks before the teacher's);
    # refused with split and with dp_replicate > 1.
    ep: int = 1

    def check(self) -> None:
        # rollout_ranks is checked with trainer.max_staleness, in spmdrl.config.validate.
        if self.dp_replicate <= 0:
            raise ConfigError(f"parallel.dp_replicate must be > 0, got {self.dp_replicate}")
        if self.ep < 1:
            raise ConfigError(f"parallel.ep must be >= 1 (1 = no expert parallelism), got {self.ep}")
        if self.teacher_ranks < 0:
            raise ConfigError(
                f"parallel.teacher_ranks must be >= 0 (0: the teacher on the actor's ranks; N: on the last N ranks, "
                f"which hold no actor), got {self.teacher_ranks}"
            )
        if self.critic_ranks < 0:
            raise ConfigError(
                f"parallel.critic_ranks must be >= 0 (0 = half the world), got {self.critic_ranks}"
            )
