"""The table of verl 0.9.1's config keys spmdrl knows (:data:`VERL_KEYS`): each mapped to the spmdrl key
that holds the same setting (with a value transform where the two differ), accepted where its value is
what spmdrl does anyway, or refused with what to do instead. spmdrl.verl_keys applies it to the command
line; spmdrl.verl_keys_doc writes it as docs/verl_keys.md.

Keys verl and spmdrl spell the same (``data.max_prompt_length``) are in the table too, so the document lists
every setting a verl user knows; they are rewritten only where the value needs it (a single
``data.train_files`` path becomes a list).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from spmdrl.errors import ConfigError

# The verl parent sections that spmdrl has no section of its own for: a key under them is verl's.
VERL_ONLY_SECTIONS = (
    "actor_rollout_ref",
    "custom_reward_function",
    "reward_model.reward_manager",
    "sandbox_fusion",
    "ray_kwargs",
    "global_profiler",
    "transfer_queue",
    "distillation",
)
DOC_PATH = "docs/verl_keys.md"

# spmdrl's sections that verl has too (under the same name): an unknown key there may be a verl key.
SHARED_SECTIONS = ("data", "trainer", "algorithm", "critic", "reward", "reward_model")

Given = Mapping[str, Any]  # every verl key of the command line (the table's names) -> its parsed value


@dataclass(frozen=True)
class VerlKey:
    """One verl key (``verl``; ending in ``.*``: every key under that prefix not named by an entry of its
    own). ``spmdrl``: the key that holds the setting; ``convert`` turns verl's value into it (the value as
    it is without one) and raises ConfigError for a value with no equivalent. Without ``spmdrl``, the key
    is accepted where ``accepts(value, given)`` holds (the value is what spmdrl does anyway; logged as such)
    and refused otherwise, with ``note`` saying what to do instead."""

    verl: str
    spmdrl: str | None
    note: str = ""
    convert: Callable[[Any, Given], Any] | None = None
    accepts: Callable[[Any, Given], bool] | None = None

    @property
    def is_prefix(self) -> bool:
        return self.verl.endswith(".*")

    def matches(self, key: str) -> bool:
        return key.startswith(self.verl[:-1]) if self.is_prefix else key == self.verl


# ---------------------------------------------------------------------------------------------- transforms


def _as_list(value: Any, given: Given) -> Any:
    """verl takes one path or a list of them; spmdrl's data files are always a list."""
    return value if isinstance(value, list) else [value]


_BACKENDS = {"console": "console", "wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow"}


def _loggers(value: Any, given: Given) -> list[str]:
    names = value if isinstance(value, list) else [value]
    unknown = [n for n in names if n not in _BACKENDS]
    if unknown:
        raise ConfigError(
            f"trainer.logger={names}: spmdrl has no {', '.join(map(str, unknown))} backend; "
            f"logging.backends takes any of {', '.join(_BACKENDS)}"
        )
    return [_BACKENDS[n] for n in names]


def _overlong(value: Any, given: Given) -> str:
    return "filter" if value else "error"


def _truncation_error(value: Any, given: Given) -> bool:
    return value == "error"


def _save_freq(value: Any, given: Given) -> int:
    return max(int(value), 0)  # verl's -1: never (spmdrl's 0 saves only after the last step)


def _test_freq(value: Any, given: Given) -> int:
    return max(int(value), 0)  # verl's -1: never


def _total_steps(value: Any, given: Given) -> int:
    return 0 if value is None else int(value)  # verl's null: from the epochs (spmdrl's 0)


def _resume_mode(value: Any, given: Given) -> str:
    if value == "resume_path":
        path = given.get("trainer.resume_from_path")
        if not path:
            raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path=<checkpoint>")
        return str(path)
    if value == "disable":
        return "off"
    if value == "auto":
        return "auto"
    raise ConfigError(f"trainer.resume_mode={value!r}: verl's values are auto, disable and resume_path")


def _keep(value: Any, given: Given) -> int:
    if value is None or int(value) < 1:
        raise ConfigError(
            f"trainer.max_actor_ckpt_to_keep={value}: spmdrl keeps the newest trainer.keep_checkpoints "
            "checkpoints, at least 1; give a number"
        )
    return int(value)


def _reward_fn(section: str) -> Callable[[Any, Given], str]:
    """<section>.path -> reward.fn=<path>:<name>, the name from <section>.name (verl's default compute_score)."""
    return lambda value, given: f"{value}:{given.get(f'{section}.name') or 'compute_score'}"


def _val_temperature(value: Any, given: Given) -> float:
    # verl samples validation at val_kwargs.temperature only with do_sample=True (default False: greedy).
    return float(value) if given.get("actor_rollout_ref.rollout.val_kwargs.do_sample", False) else 0.0


def _greedy(value: Any, given: Given) -> float:
    # do_sample=False: greedy whatever the temperature (spmdrl's 0); True: val_kwargs.temperature's.
    if value:
        return float(given.get("actor_rollout_ref.rollout.val_kwargs.temperature", 0.0))
    return 0.0


def _lora_targets(value: Any, given: Given) -> list[str]:
    return value if isinstance(value, list) else [value]


def _strategy(value: Any, given: Given) -> bool:
    return value in ("fsdp", "fsdp2")


def _any(value: Any, given: Given) -> bool:
    return True


def _equals(*values: Any) -> Callable[[Any, Given], bool]:
    return lambda value, given: value in values


def _same_as(key: str, default: Any) -> Callable[[Any, Given], bool]:
    """The value equals that of verl key ``key`` (``default`` when the command line leaves it out)."""
    return lambda value, given: value == given.get(key, default)


def _launch(per_node: bool) -> Callable[[Any, Given], bool]:
    """trainer.n_gpus_per_node / nnodes: what torchrun started (accepted unchecked without torchrun:
    --check and --cfg job run in one process)."""

    def accepts(value: Any, given: Given) -> bool:
        local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
        if local is None or world is None:
            return True
        launched = int(local) if per_node else int(world) // max(int(local), 1)
        return int(value) == launched

    return accepts


# ---------------------------------------------------------------------------------------------- the table

_ACTOR = "actor_rollout_ref.actor"
_ROLLOUT = "actor_rollout_ref.rollout"
_REF = "actor_rollout_ref.ref"
_MODEL = "actor_rollout_ref.model"
_MICRO = (
    "micro-batching does not change the update in spmdrl (losses are normalized over the whole batch); "
    "every pass runs trainer.micro_batch_size sequences or the token budgets trainer.ppo_max_token_len_per_gpu "
    "/ trainer.log_prob_max_token_len_per_gpu"
)
_WORLD = (
    "spmdrl takes the world size from torchrun: torchrun --nnodes=<nodes> --nproc_per_node=<GPUs per node>"
)

VERL_KEYS: tuple[VerlKey, ...] = (
    # ----- actor_rollout_ref.model
    VerlKey(f"{_MODEL}.path", "model.path"),
    VerlKey(
        f"{_MODEL}.enable_gradient_checkpointing",
        "model.activation_checkpointing",
        "True: full; False: off",
        convert=lambda v, g: "full" if v else "off",
    ),
    VerlKey(
        f"{_MODEL}.use_remove_padding", "trainer.pack_sequences", "true: micro-batches packed end to end"
    ),
    VerlKey(f"{_MODEL}.trust_remote_code", "model.trust_remote_code"),
    VerlKey(f"{_MODEL}.use_fused_kernels", "model.use_fused_kernels"),
    VerlKey(f"{_MODEL}.lora_rank", "model.lora.rank"),
    VerlKey(f"{_MODEL}.lora_alpha", "model.lora.alpha"),
    VerlKey(
        f"{_MODEL}.target_modules", "model.lora.target_modules", "one name or a list", convert=_lora_targets
    ),
    VerlKey(
        f"{_MODEL}.external_lib",
        None,
        "accepted when null; spmdrl imports a recipe's code with entry=path/to/recipe.py",
        accepts=_equals(None),
    ),
    VerlKey(
        f"{_MODEL}.enable_activation_offload",
        None,
        "accepted when False; spmdrl has no activation "
        "offload (model.activation_checkpointing saves the memory)",
        accepts=_equals(False),
    ),
    VerlKey(
        f"{_MODEL}.use_shm",
        None,
        "accepted when False: spmdrl loads from model.path (or model.cache_dir)",
        accepts=_equals(False),
    ),
    # ----- actor_rollout_ref.actor
    VerlKey(f"{_ACTOR}.optim.lr", "optim.lr"),
    VerlKey(f"{_ACTOR}.optim.weight_decay", "optim.weight_decay"),
    VerlKey(f"{_ACTOR}.optim.betas", "optim.betas"),
    VerlKey(f"{_ACTOR}.optim.min_lr_ratio", "optim.min_lr_ratio"),
    VerlKey(
        f"{_ACTOR}.optim.lr_warmup_steps",
        "optim.warmup_steps",
        "verl's -1 (use the ratio): 0",
        convert=lambda v, g: max(int(v), 0),
    ),
    VerlKey(
        f"{_ACTOR}.optim.lr_warmup_steps_ratio",
        None,
        "accepted when 0; otherwise give the steps: optim.warmup_steps=N",
        accepts=_equals(0, 0.0),
    ),
    VerlKey(f"{_ACTOR}.optim.warmup_style", "optim.schedule", "constant or cosine (verl's older name)"),
    VerlKey(f"{_ACTOR}.optim.lr_scheduler_type", "optim.schedule", "constant or cosine"),
    VerlKey(f"{_ACTOR}.optim.clip_grad", "optim.grad_clip"),
    VerlKey(f"{_ACTOR}.grad_clip", "optim.grad_clip"),
    VerlKey(
        f"{_ACTOR}.freeze_vision_tower",
        "model.freeze_vision_tower",
        "a vision-language model's tower and connector (spmdrl's default: true)",
    ),
    VerlKey(f"{_ACTOR}.ppo_mini_batch_size", "algorithm.ppo_mini_batch_size", "prompts, as in verl"),
    VerlKey(
        f"{_ACTOR}.ppo_micro_batch_size_per_gpu",
        "trainer.micro_batch_size",
        "sequences per forward/backward on one GPU; spmdrl pads unless trainer.pack_sequences=true "
        "(verl's use_remove_padding), so a padded run may need fewer",
    ),
    VerlKey(f"{_ACTOR}.ppo_max_token_len_per_gpu", "trainer.ppo_max_token_len_per_gpu"),
    VerlKey(f"{_ACTOR}.use_dynamic_bsz", None, "accepted: " + _MICRO, accepts=_any),
    VerlKey(f"{_ACTOR}.ppo_epochs", "algorithm.ppo_epochs"),
    VerlKey(
        f"{_ACTOR}.clip_ratio",
        None,
        "accepted where it changes nothing in verl 0.9.1, which reads it only for a bound that is null: "
        "equal to 0.2 (the bounds' default) unless clip_ratio_low and clip_ratio_high are both given; "
        "set the bounds instead (algorithm.clip_ratio_low, algorithm.clip_ratio_high)",
        accepts=lambda v, g: all(
            v == 0.2 or f"{_ACTOR}.{b}" in g for b in ("clip_ratio_low", "clip_ratio_high")
        ),
    ),
    VerlKey(f"{_ACTOR}.clip_ratio_low", "algorithm.clip_ratio_low"),
    VerlKey(f"{_ACTOR}.clip_ratio_high", "algorithm.clip_ratio_high"),
    VerlKey(f"{_ACTOR}.clip_ratio_c", "algorithm.clip_ratio_c"),
    VerlKey(f"{_ACTOR}.loss_agg_mode", "algorithm.loss_agg_mode"),
    VerlKey(f"{_ACTOR}.entropy_coeff", "algorithm.entropy_coeff"),
    VerlKey(f"{_ACTOR}.use_kl_loss", "algorithm.use_kl_loss"),
    VerlKey(f"{_ACTOR}.kl_loss_coef", "algorithm.kl_loss_coef"),
    VerlKey(f"{_ACTOR}.kl_loss_type", "algorithm.kl_loss_type"),
    VerlKey(f"{_ACTOR}.tau_pos", "algorithm.tau_pos"),
    VerlKey(f"{_ACTOR}.tau_neg", "algorithm.tau_neg"),
    VerlKey(f"{_ACTOR}.policy_loss.loss_mode", "algorithm.policy_loss"),
    VerlKey(f"{_ACTOR}.policy_loss.clip_cov_ratio", "algorithm.clip_cov_ratio"),
    VerlKey(f"{_ACTOR}.policy_loss.clip_cov_lb", "algorithm.clip_cov_lb"),
    VerlKey(f"{_ACTOR}.policy_loss.clip_cov_ub", "algorithm.clip_cov_ub"),
    VerlKey(f"{_ACTOR}.policy_loss.kl_cov_ratio", "algorithm.kl_cov_ratio"),
    VerlKey(f"{_ACTOR}.policy_loss.ppo_kl_coef", "algorithm.ppo_kl_coef"),
    VerlKey(f"{_ACTOR}.policy_loss.dro_beta", "algorithm.dro_beta"),
    VerlKey(
        f"{_ACTOR}.loss_scale_factor",
        "algorithm.loss_scale_factor",
        "verl's null: 0 (unset)",
        convert=lambda v, g: 0.0 if v is None else float(v),
    ),
    VerlKey(
        f"{_ACTOR}.optim.num_cycles",
        None,
        "accepted when 0.5: spmdrl's cosine schedule is half a cycle "
        "(optim.schedule=cosine, optim.min_lr_ratio)",
        accepts=_equals(0.5),
    ),
    VerlKey(f"{_ACTOR}.fsdp_config.param_offload", "model.offload_params"),
    VerlKey(f"{_ACTOR}.fsdp_config.optimizer_offload", "model.offload_optimizer"),
    VerlKey(
        f"{_ACTOR}.strategy", None, "accepted when fsdp or fsdp2: spmdrl trains with FSDP2", accepts=_strategy
    ),
    VerlKey(
        f"{_ACTOR}.fsdp_config.*",
        None,
        "spmdrl's FSDP2 settings are model.fsdp_unit, model.param_dtype, "
        "model.reduce_dtype and parallel.dp_replicate (docs/scaling.md)",
    ),
    VerlKey(
        f"{_ACTOR}.ulysses_sequence_parallel_size",
        None,
        "accepted when 1: spmdrl has no sequence "
        "parallelism; trainer.pack_sequences=true and the token budgets fit long sequences",
        accepts=_equals(1),
    ),
    # ----- actor_rollout_ref.rollout
    VerlKey(
        f"{_ROLLOUT}.name",
        None,
        "accepted when vllm, the engine spmdrl runs in-process (rollout.engine)",
        accepts=_equals("vllm"),
    ),
    VerlKey(
        f"{_ROLLOUT}.mode",
        None,
        "accepted: spmdrl's engine runs in every rank's process; asynchronous "
        "training is parallel.placement=async (docs/async.md)",
        accepts=_equals("sync", "async"),
    ),
    VerlKey(f"{_ROLLOUT}.n", "rollout.n"),
    VerlKey(f"{_ROLLOUT}.temperature", "rollout.temperature"),
    VerlKey(f"{_ROLLOUT}.top_p", "rollout.top_p"),
    VerlKey(f"{_ROLLOUT}.top_k", "rollout.top_k"),
    VerlKey(f"{_ROLLOUT}.tensor_model_parallel_size", "rollout.tp"),
    VerlKey(f"{_ROLLOUT}.gpu_memory_utilization", "rollout.gpu_memory_utilization"),
    VerlKey(f"{_ROLLOUT}.max_num_seqs", "rollout.max_num_seqs"),
    VerlKey(
        f"{_ROLLOUT}.max_model_len",
        "rollout.max_model_len",
        "verl's null: 0 (from the lengths)",
        convert=lambda v, g: 0 if v is None else int(v),
    ),
    VerlKey(f"{_ROLLOUT}.enable_prefix_caching", "rollout.enable_prefix_caching"),
    VerlKey(f"{_ROLLOUT}.enforce_eager", "rollout.enforce_eager"),
    VerlKey(f"{_ROLLOUT}.free_cache_engine", "rollout.free_cache_engine"),
    VerlKey(f"{_ROLLOUT}.dtype", "rollout.dtype"),
    VerlKey(f"{_ROLLOUT}.seed", "rollout.seed"),
    VerlKey(f"{_ROLLOUT}.log_prob_micro_batch_size_per_gpu", None, "accepted: " + _MICRO, accepts=_any),
    VerlKey(f"{_ROLLOUT}.log_prob_max_token_len_per_gpu", "trainer.log_prob_max_token_len_per_gpu"),
    VerlKey(f"{_ROLLOUT}.log_prob_use_dynamic_bsz", None, "accepted: " + _MICRO, accepts=_any),
    VerlKey(
        f"{_ROLLOUT}.val_kwargs.temperature",
        "rollout.val_temperature",
        "with val_kwargs.do_sample=True; without it verl decodes greedily (0)",
        convert=_val_temperature,
    ),
    VerlKey(
        f"{_ROLLOUT}.val_kwargs.do_sample",
        "rollout.val_temperature",
        "False: greedy (0); True: val_kwargs.temperature",
        convert=_greedy,
    ),
    VerlKey(
        f"{_ROLLOUT}.val_kwargs.n",
        None,
        "accepted when 1: spmdrl validates one response per prompt",
        accepts=_equals(1),
    ),
    VerlKey(
        f"{_ROLLOUT}.val_kwargs.top_p",
        None,
        "accepted when 1.0: validation samples the full distribution",
        accepts=_equals(1, 1.0),
    ),
    VerlKey(
        f"{_ROLLOUT}.val_kwargs.top_k",
        None,
        "accepted when -1: validation samples the full distribution",
        accepts=_equals(-1),
    ),
    VerlKey(f"{_ROLLOUT}.val_kwargs.*", None, "spmdrl's validation setting is rollout.val_temperature"),
    VerlKey(
        f"{_ROLLOUT}.do_sample",
        None,
        "accepted when True; greedy training rollouts: rollout.temperature=0",
        accepts=_equals(True),
    ),
    VerlKey(
        f"{_ROLLOUT}.ignore_eos",
        None,
        "accepted when False: a response ends at the end-of-sequence token (rollout.stop adds stop strings)",
        accepts=_equals(False),
    ),
    VerlKey(f"{_ROLLOUT}.multi_turn.enable", "rollout.multi_turn.enable"),
    VerlKey(f"{_ROLLOUT}.multi_turn.max_assistant_turns", "rollout.multi_turn.max_assistant_turns"),
    VerlKey(f"{_ROLLOUT}.multi_turn.max_user_turns", "rollout.multi_turn.max_user_turns"),
    VerlKey(f"{_ROLLOUT}.multi_turn.max_parallel_calls", "rollout.multi_turn.max_parallel_calls"),
    VerlKey(f"{_ROLLOUT}.multi_turn.max_tool_response_length", "rollout.multi_turn.max_tool_response_length"),
    VerlKey(
        f"{_ROLLOUT}.multi_turn.tool_response_truncate_side", "rollout.multi_turn.tool_response_truncate_side"
    ),
    VerlKey(f"{_ROLLOUT}.multi_turn.tool_config_path", "rollout.multi_turn.tool_config_path"),
    VerlKey(f"{_ROLLOUT}.multi_turn.format", "rollout.multi_turn.format"),
    VerlKey(
        f"{_ROLLOUT}.multi_turn.*",
        None,
        "spmdrl's multi-turn settings are rollout.multi_turn.* (docs/multi_turn.md)",
    ),
    VerlKey(
        f"{_ROLLOUT}.data_parallel_size",
        None,
        "accepted when 1; spmdrl runs one engine per rollout.tp ranks",
        accepts=_equals(1),
    ),
    VerlKey(
        f"{_ROLLOUT}.load_format",
        None,
        "accepted: spmdrl's engine starts from the trainer's weights (rollout.weight_load)",
        accepts=_any,
    ),
    # ----- actor_rollout_ref.ref
    VerlKey(f"{_REF}.fsdp_config.param_offload", "model.offload_ref"),
    VerlKey(f"{_REF}.log_prob_micro_batch_size_per_gpu", None, "accepted: " + _MICRO, accepts=_any),
    VerlKey(
        f"{_REF}.log_prob_max_token_len_per_gpu",
        "trainer.log_prob_max_token_len_per_gpu",
        "one budget for every no-grad pass: as the rollout's (a different value is refused)",
    ),
    VerlKey(f"{_REF}.log_prob_use_dynamic_bsz", None, "accepted: " + _MICRO, accepts=_any),
    VerlKey(
        f"{_REF}.fsdp_config.*",
        None,
        "the reference model is sharded as the actor; model.offload_ref keeps its parameters in host memory",
    ),
    # ----- critic
    VerlKey("critic.model.path", "critic.model_path"),
    VerlKey("critic.optim.lr", "critic.optim.lr"),
    VerlKey("critic.optim.weight_decay", "critic.optim.weight_decay"),
    VerlKey("critic.optim.clip_grad", "critic.optim.grad_clip"),
    VerlKey("critic.grad_clip", "critic.optim.grad_clip"),
    VerlKey(
        "critic.optim.lr_warmup_steps",
        "critic.optim.warmup_steps",
        "verl's -1: 0",
        convert=lambda v, g: max(int(v), 0),
    ),
    VerlKey("critic.optim.betas", "critic.optim.betas"),
    VerlKey("critic.optim.min_lr_ratio", "critic.optim.min_lr_ratio"),
    VerlKey("critic.optim.lr_scheduler_type", "critic.optim.schedule", "constant or cosine"),
    VerlKey("critic.optim.warmup_style", "critic.optim.schedule", "constant or cosine (verl's older name)"),
    VerlKey(
        "critic.ppo_epochs",
        None,
        "accepted when equal to the actor's: the critic trains on the actor's "
        "mini-batches and epochs (algorithm.ppo_epochs)",
        accepts=_same_as(f"{_ACTOR}.ppo_epochs", 1),
    ),
    VerlKey(
        "critic.ppo_mini_batch_size",
        None,
        "accepted when equal to the actor's: the critic trains on the "
        "actor's mini-batches (algorithm.ppo_mini_batch_size)",
        accepts=lambda v, g: v == g.get(f"{_ACTOR}.ppo_mini_batch_size", v),
    ),
    VerlKey(
        "critic.loss_agg_mode",
        None,
        "accepted when equal to the actor's (algorithm.loss_agg_mode)",
        accepts=_same_as(f"{_ACTOR}.loss_agg_mode", "token-mean"),
    ),
    VerlKey("critic.cliprange_value", "critic.cliprange_value"),
    VerlKey("critic.ppo_micro_batch_size_per_gpu", None, "accepted: " + _MICRO, accepts=_any),
    VerlKey("critic.ppo_max_token_len_per_gpu", None, "accepted: " + _MICRO, accepts=_any),
    VerlKey("critic.forward_max_token_len_per_gpu", None, "accepted: " + _MICRO, accepts=_any),
    VerlKey("critic.use_dynamic_bsz", None, "accepted: " + _MICRO, accepts=_any),
    VerlKey(
        "critic.model.use_remove_padding",
        None,
        "accepted when equal to the actor's: trainer.pack_sequences packs every model's micro-batches",
        accepts=_same_as(f"{_MODEL}.use_remove_padding", True),
    ),
    VerlKey(
        "critic.model.enable_gradient_checkpointing",
        None,
        "accepted when equal to the actor's: model.activation_checkpointing applies to every trained model",
        accepts=_same_as(f"{_MODEL}.enable_gradient_checkpointing", True),
    ),
    VerlKey(
        "critic.fsdp.param_offload",
        None,
        "accepted when equal to the actor's: model.offload_params offloads every trained model",
        accepts=_same_as(f"{_ACTOR}.fsdp_config.param_offload", False),
    ),
    VerlKey(
        "critic.fsdp.optimizer_offload",
        None,
        "accepted when equal to the actor's: model.offload_optimizer applies to every trained model",
        accepts=_same_as(f"{_ACTOR}.fsdp_config.optimizer_offload", False),
    ),
    VerlKey(
        "critic.model.fsdp_config.param_offload",
        None,
        "verl's name before 0.9 for critic.fsdp.param_offload; accepted when equal to the actor's",
        accepts=_same_as(f"{_ACTOR}.fsdp_config.param_offload", False),
    ),
    VerlKey(
        "critic.model.fsdp_config.optimizer_offload",
        None,
        "verl's name before 0.9 for critic.fsdp.optimizer_offload; accepted when equal to the actor's",
        accepts=_same_as(f"{_ACTOR}.fsdp_config.optimizer_offload", False),
    ),
    VerlKey(
        "critic.strategy", None, "accepted when fsdp or fsdp2: spmdrl trains with FSDP2", accepts=_strategy
    ),
    # ----- data
    VerlKey("data.train_files", "data.train_files", "one path or a list", convert=_as_list),
    VerlKey("data.val_files", "data.val_files", "one path or a list", convert=_as_list),
    VerlKey("data.train_batch_size", "trainer.global_batch_size", "prompts per step, as in verl"),
    VerlKey("data.max_prompt_length", "data.max_prompt_length"),
    VerlKey("data.max_response_length", "data.max_response_length"),
    VerlKey("data.prompt_key", "data.prompt_key"),
    VerlKey("data.shuffle", "data.shuffle"),
    VerlKey("data.seed", "data.seed", "verl's null: 0", convert=lambda v, g: 0 if v is None else int(v)),
    VerlKey("data.filter_overlong_prompts", "data.overlong", "True: filter; False: error", convert=_overlong),
    VerlKey(
        "data.truncation",
        None,
        "accepted when error: a prompt over data.max_prompt_length that "
        "data.overlong=filter does not drop is an error; spmdrl never truncates a prompt",
        accepts=_truncation_error,
    ),
    VerlKey(
        "data.train_max_samples",
        None,
        "accepted when -1 (all rows); a subset: a smaller file",
        accepts=_equals(-1, None),
    ),
    VerlKey(
        "data.val_max_samples",
        None,
        "accepted when -1 (all rows); a subset: a smaller file",
        accepts=_equals(-1, None),
    ),
    VerlKey(
        "data.val_batch_size",
        None,
        "accepted: spmdrl generates the whole validation set at once (the "
        "engine batches it); the value does not change the result",
        accepts=_any,
    ),
    VerlKey(
        "data.custom_cls.path",
        None,
        "accepted when null; spmdrl reads parquet rows in verl's schema (docs/data.md)",
        accepts=_equals(None),
    ),
    VerlKey(
        "data.gen_batch_size",
        None,
        "accepted when equal to data.train_batch_size: spmdrl generates "
        "trainer.global_batch_size prompts per round, also under algorithm.filter_groups",
        accepts=lambda v, g: v is None or v == g.get("data.train_batch_size"),
    ),
    VerlKey(
        "data.validation_shuffle",
        None,
        "accepted when False: spmdrl validates on the files' order",
        accepts=_equals(False),
    ),
    VerlKey(
        "data.tokenizer",
        None,
        "accepted when null: spmdrl uses model.path's tokenizer",
        accepts=_equals(None),
    ),
    VerlKey(
        "data.return_raw_chat",
        None,
        "accepted: spmdrl's rollout applies the chat template itself",
        accepts=_any,
    ),
    VerlKey(
        "data.dataloader_num_workers",
        None,
        "accepted: spmdrl reads and tokenizes the prompts once at start, with no loader workers",
        accepts=_any,
    ),
    VerlKey(
        "data.reward_fn_key",
        None,
        "accepted when data_source: spmdrl picks the reward by the data_source column (reward.fn=auto)",
        accepts=_equals("data_source"),
    ),
    # ----- algorithm
    VerlKey("algorithm.adv_estimator", "algorithm.adv_estimator"),
    VerlKey("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std"),
    VerlKey("algorithm.gamma", "algorithm.gamma"),
    VerlKey("algorithm.lam", "algorithm.lam"),
    VerlKey("algorithm.use_kl_in_reward", "algorithm.use_kl_in_reward"),
    VerlKey("algorithm.kl_penalty", "algorithm.kl_penalty"),
    VerlKey("algorithm.kl_ctrl.type", "algorithm.kl_ctrl.type"),
    VerlKey("algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.kl_coef"),
    VerlKey("algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.target_kl"),
    VerlKey("algorithm.kl_ctrl.horizon", "algorithm.kl_ctrl.horizon"),
    VerlKey("algorithm.filter_groups.enable", "algorithm.filter_groups.enable"),
    VerlKey("algorithm.filter_groups.metric", "algorithm.filter_groups.metric"),
    VerlKey("algorithm.filter_groups.max_num_gen_batches", "algorithm.filter_groups.max_num_gen_batches"),
    VerlKey(
        "algorithm.filter_groups.max_inflight_gen_batches",
        None,
        "accepted when 1: spmdrl generates one batch at a time",
        accepts=_equals(1),
    ),
    VerlKey("algorithm.pf_ppo.*", None, "spmdrl has no PF-PPO reweighting"),
    VerlKey(
        "algorithm.use_pf_ppo",
        None,
        "accepted when False: spmdrl has no PF-PPO reweighting",
        accepts=_equals(False),
    ),
    # ----- reward model and rule reward
    VerlKey("reward_model.model.path", "reward_model.path"),
    VerlKey("reward.reward_kwargs.overlong_buffer_cfg.enable", "reward.overlong_buffer.enable"),
    VerlKey("reward.reward_kwargs.overlong_buffer_cfg.len", "reward.overlong_buffer.len"),
    VerlKey(
        "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor", "reward.overlong_buffer.penalty_factor"
    ),
    VerlKey(
        "reward.reward_kwargs.max_resp_len",
        None,
        "accepted when equal to data.max_response_length, which spmdrl's overlong penalty counts from",
        accepts=_same_as("data.max_response_length", None),
    ),
    VerlKey("reward_model.overlong_buffer.enable", "reward.overlong_buffer.enable", "verl's older name"),
    VerlKey("reward_model.overlong_buffer.len", "reward.overlong_buffer.len", "verl's older name"),
    VerlKey(
        "reward_model.overlong_buffer.penalty_factor",
        "reward.overlong_buffer.penalty_factor",
        "verl's older name",
    ),
    VerlKey(
        "custom_reward_function.path",
        "reward.fn",
        "with custom_reward_function.name (default compute_score): reward.fn=<path>:<name>",
        convert=_reward_fn("custom_reward_function"),
    ),
    VerlKey(
        "custom_reward_function.name",
        None,
        "accepted with custom_reward_function.path (reward.fn=<path>:<name>); alone, give "
        "reward.fn=<module or file>:<name>",
        accepts=lambda v, g: "custom_reward_function.path" in g,
    ),
    VerlKey(
        "reward.custom_reward_function.path",
        "reward.fn",
        "with reward.custom_reward_function.name (default compute_score): reward.fn=<path>:<name>",
        convert=_reward_fn("reward.custom_reward_function"),
    ),
    VerlKey(
        "reward.custom_reward_function.name",
        None,
        "accepted with reward.custom_reward_function.path (reward.fn=<path>:<name>); alone, give "
        "reward.fn=<module or file>:<name>",
        accepts=lambda v, g: "reward.custom_reward_function.path" in g,
    ),
    # ----- trainer
    VerlKey("trainer.total_epochs", "trainer.total_epochs"),
    VerlKey("trainer.val_only", "trainer.val_only", "validate the checkpoint (or model) once and exit"),
    VerlKey(
        "trainer.total_training_steps",
        "trainer.total_steps",
        "verl's null: 0 (from the epochs)",
        convert=_total_steps,
    ),
    VerlKey("trainer.test_freq", "trainer.val_every", "verl's -1 (never): 0", convert=_test_freq),
    VerlKey(
        "trainer.save_freq",
        "trainer.save_every",
        "verl's -1: 0 (spmdrl still saves after the last step)",
        convert=_save_freq,
    ),
    VerlKey(
        "trainer.logger",
        "logging.backends",
        "one name or a list: console, wandb, tensorboard, mlflow",
        convert=_loggers,
    ),
    VerlKey("trainer.project_name", "logging.project"),
    VerlKey("trainer.experiment_name", "logging.experiment"),
    VerlKey("trainer.default_local_dir", "trainer.output_dir"),
    VerlKey(
        "trainer.resume_mode",
        "trainer.resume",
        "auto: auto; disable: off; resume_path: trainer.resume_from_path",
        convert=_resume_mode,
    ),
    VerlKey(
        "trainer.resume_from_path",
        None,
        "accepted with trainer.resume_mode=resume_path (trainer.resume=<checkpoint>)",
        accepts=lambda v, g: g.get("trainer.resume_mode") == "resume_path" or v is None,
    ),
    VerlKey(
        "trainer.max_actor_ckpt_to_keep",
        "trainer.keep_checkpoints",
        "at least 1 (verl's null, every checkpoint, has no equivalent)",
        convert=_keep,
    ),
    VerlKey(
        "trainer.max_critic_ckpt_to_keep",
        None,
        "accepted when equal to max_actor_ckpt_to_keep: one "
        "checkpoint holds every model (trainer.keep_checkpoints)",
        accepts=lambda v, g: v == g.get("trainer.max_actor_ckpt_to_keep"),
    ),
    VerlKey(
        "trainer.default_hdfs_dir",
        None,
        "accepted when null; spmdrl writes to trainer.output_dir",
        accepts=_equals(None),
    ),
    VerlKey(
        "trainer.del_local_ckpt_after_load",
        None,
        "accepted when False: spmdrl keeps the newest trainer.keep_checkpoints",
        accepts=_equals(False),
    ),
    VerlKey(
        "trainer.rollout_data_dir",
        None,
        "accepted when null; spmdrl writes rollout samples to "
        "<trainer.output_dir>/samples.jsonl (logging.samples_every, logging.samples_per_log)",
        accepts=_equals(None),
    ),
    VerlKey(
        "trainer.validation_data_dir",
        None,
        "accepted when null; spmdrl writes validation samples to <trainer.output_dir>/samples.jsonl",
        accepts=_equals(None),
    ),
    VerlKey("trainer.critic_warmup", "critic.warmup_steps"),
    VerlKey("trainer.device", "trainer.device"),
    VerlKey(
        "trainer.n_gpus_per_node",
        None,
        "accepted when equal to torchrun's --nproc_per_node (not checked without torchrun); " + _WORLD,
        accepts=_launch(per_node=True),
    ),
    VerlKey(
        "trainer.nnodes",
        None,
        "accepted when equal to torchrun's --nnodes (not checked without torchrun); " + _WORLD,
        accepts=_launch(per_node=False),
    ),
    VerlKey(
        "trainer.checkpoint_callback_class",
        None,
        "accepted when null; code around a run goes in a "
        "recipe of your own (entry=path/to/recipe.py, docs/configuration.md)",
        accepts=_equals(None),
    ),
    VerlKey(
        "trainer.val_before_train",
        "trainer.val_before_train",
        "the same name: false skips step 0's validation (validation is on when trainer.val_every > 0)",
    ),
    VerlKey(
        "trainer.balance_batch",
        "parallel.balance_tokens",
        "every rank of a role gets about the same number of tokens before each update (verl's default True; "
        "spmdrl's false)",
    ),
    VerlKey(
        "trainer.log_val_generations",
        None,
        "accepted: spmdrl writes validation samples to samples.jsonl (logging.samples_per_log)",
        accepts=_any,
    ),
    VerlKey(
        "trainer.use_legacy_worker_impl",
        None,
        "accepted (verl before 0.9.1): its choice between two implementations of the same workers; spmdrl "
        "has one",
        accepts=_any,
    ),
    VerlKey(
        "trainer.ray_wait_register_center_timeout",
        None,
        "accepted: spmdrl runs no Ray; trainer.collective_timeout_min bounds a wait",
        accepts=_any,
    ),
)


# ---------------------------------------------------------------------------------------------- lookup


def entry_for(key: str) -> VerlKey | None:
    """The table's entry for verl key ``key``: its own, else the longest prefix entry that covers it."""
    exact = [e for e in VERL_KEYS if not e.is_prefix and e.verl == key]
    if exact:
        return exact[0]
    prefixes = [e for e in VERL_KEYS if e.is_prefix and e.matches(key)]
    return max(prefixes, key=lambda e: len(e.verl)) if prefixes else None
