"""The ``model`` section: the trained model, its dtypes, memory settings and LoRA adapters, and the checks
of those values alone (LoRA's target module names are checked against the model, in spmdrl.preflight)."""

from __future__ import annotations

from dataclasses import dataclass, field

from spmdrl.config_section import SWITCH_MODES, choice, switch_mode
from spmdrl.errors import ConfigError

# model.activation_checkpointing's modes (spmdrl.models.parallelize.apply_ac), and its former booleans.
AC_MODES = ("off", "full", "mlp")
_AC_BOOLEANS = {"true": "full", "false": "off"}


def ac_mode(value: str | bool) -> str:
    """model.activation_checkpointing as one of AC_MODES: true / false (a YAML or command-line boolean, which
    the string field holds as "True" / "False") are full / off."""
    return _AC_BOOLEANS.get(str(value).lower(), str(value))


# model.use_fused_kernels=auto fuses the LM head from this vocabulary size on (Llama 3, Qwen2.5, Gemma all
# have 128k-256k; a plain head on N positions keeps N x V float32 logits and their softmax for backward).
# Below it, on a GPU too, the chunked head only adds launches: at 512 tokens and 64 x 160 positions it ran
# 3.7% more ATen ops per update micro-batch than the plain one (docs/performance.md).
FUSED_AUTO_MIN_VOCAB = 32768

# model.router_replay's modes (spmdrl.models.router_replay; verl's actor.router_replay.mode R3).
ROUTER_REPLAY_MODES = ("disabled", "r3")


@dataclass
class LoraConfig:
    """LoRA adapters on the actor (docs/models.md#lora): the base weights frozen, only the adapters trained,
    the engine served the merged weights W + (alpha / rank) B A. verl's actor_rollout_ref.model.lora_rank,
    lora_alpha and target_modules."""

    # The adapters' rank r; 0: no LoRA (every weight trains).
    rank: int = 0
    # The adapter output is scaled by alpha / rank.
    alpha: float = 16.0
    # Linear module names (the last part of their path, e.g. q_proj, down_proj), or ["all-linear"]: every
    # linear layer of the decoder (the LM head excluded, as PEFT does).
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    # Dropout on the adapter's input, in every forward of the trained model (its log-prob passes too, as for
    # the model's own dropout): keep 0 for RL, where the trainer's log-probs must match the engine's.
    dropout: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def check(self) -> None:
        """The values alone; target module names are checked against the model (spmdrl.models.lora)."""
        if self.rank < 0:
            raise ConfigError(f"model.lora.rank must be >= 0 (0: LoRA off), got {self.rank}")
        if not self.enabled:
            return
        if self.alpha <= 0:
            raise ConfigError(
                f"model.lora.alpha must be > 0 (the adapter is scaled by alpha / rank), got {self.alpha}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ConfigError(
                "model.lora.target_modules is empty; name linear modules (q_proj, v_proj, ...) or use [all-linear]"
            )


@dataclass
class ModelConfig:
    # A local directory with an HF causal LM (config.json + safetensors), a hub id, "tiny": the
    # built-in deterministic tiny Qwen2 model, built on first use and cached (no network needed);
    # "tiny-moe": its mixture-of-experts sibling (a Qwen3-MoE, the same tokenizer); or a packaged model
    # ("smollm2-135m": a checkpoint an installed package ships, converted on first use and cached;
    # spmdrl/models/packaged.py).
    path: str = "tiny"
    # Training dtypes (FSDP2 mixed precision). "auto": bfloat16 params on CUDA, float32 on CPU.
    param_dtype: str = choice("auto", ("auto", "float32", "bfloat16", "float16"))
    reduce_dtype: str = choice("float32", ("float32", "bfloat16"))
    # Recompute activations in backward instead of keeping them (memory for compute; docs/performance.md,
    # "Activation checkpointing where memory needs it"): off; full (each checkpointed decoder layer keeps only
    # its input); mlp (only each checkpointed layer's MLP is recomputed: its intermediate activations, the
    # widest a layer keeps, are dropped, attention's kept). true / false: full / off (its former boolean form).
    activation_checkpointing: str = "off"
    # Checkpoint every k-th decoder layer only (the k-th, 2k-th, ...): 1 = every layer.
    activation_checkpointing_every: int = 1
    # torch.compile each decoder block of the trained models (spmdrl.models.parallelize.apply_compile); the
    # frozen reference runs eager. Each new micro-batch shape compiles on first use (docs/performance.md).
    compile: bool = False
    # Host-memory offload (docs/performance.md#memory). offload_params: FSDP2's CPUOffloadPolicy for the
    # trained models (actor, critic): their sharded parameters, gradients and optimizer state live in host
    # memory, each layer's parameters are copied to the GPU for its forward and backward, and AdamW steps on
    # the CPU. offload_optimizer: only the optimizer state, in host memory outside the update phase (implied
    # by offload_params). offload_ref: the frozen reference model's parameters in host memory, streamed to
    # the GPU layer by layer for its log-prob pass (none under LoRA: the reference is the actor with its
    # adapters off). On a CPU trainer the same code runs and moves nothing.
    offload_params: bool = False
    offload_optimizer: bool = False
    offload_ref: bool = False
    # FSDP2's units (spmdrl.models.parallelize.apply_fsdp; docs/performance.md, "One FSDP2 unit on one
    # rank"): layer, one unit per decoder layer plus the root (each layer gathered just before it computes
    # and freed after it); model, the whole model as one unit (one gather per pass: a fraction of the host
    # work per micro-batch, with the whole model's unsharded parameters, and in training their gradients,
    # alive during a pass). auto: model where the model's mesh is one rank and, on a GPU, that unsharded
    # copy (spmdrl.models.memory_model.whole_model_unit) fits in 1/8 of the card; layer otherwise. none: no
    # FSDP2 at all, on a one-rank mesh only (a one-GPU job): the bare module with float32 parameters, its
    # forward under bf16 autocast where param_dtype is bf16, as a one-GPU trainer without a framework runs
    # (TRL); FSDP2's host work per pass (its hooks, the gather's and the reduce's per-tensor bookkeeping)
    # is gone, not moved (spmdrl.models.parallelize.apply_autocast). Not with the offload settings.
    fsdp_unit: str = choice("auto", ("auto", "layer", "model", "none"))
    trust_remote_code: bool = False
    # Where the tiny model and generated data are cached. "": $SPMDRL_CACHE or ~/.cache/spmdrl.
    cache_dir: str = ""
    # LoRA on the actor (rank 0: off). A KL term's reference is then the actor with its adapters off (no
    # model of its own, spmdrl/rl/reference.py); the PPO critic is not adapted: it trains every weight.
    lora: LoraConfig = field(default_factory=LoraConfig)
    # The LM head of the trainer's logprob passes (verl's actor_rollout_ref.model.use_fused_kernels): true
    # computes logprobs, entropy and sum pi^2 fused_chunk_tokens positions at a time, recomputing each
    # chunk's logits in backward (spmdrl/models/fused_logprob.py: memory chunk x V instead of tokens x V);
    # false computes every scored position's logits at once. auto: true where the vocabulary has
    # >= FUSED_AUTO_MIN_VOCAB tokens, on any device; below that the logits are small and the plain head is
    # fewer kernels (no per-chunk loop, no recompute in backward). Either way the head runs on the
    # positions that predict a response token only (docs/performance.md#the-lm-head-on-response-positions).
    use_fused_kernels: str = "auto"
    fused_chunk_tokens: int = 512
    # A mixture of experts only (docs/models.md#router-replay). r3: the trainer's forwards of the policy
    # (old logprobs, the update, the reference) route each token through the experts the rollout engine
    # chose for it, with the router's own softmax weights at those experts (Rollout Routing Replay; verl's
    # actor.router_replay.mode=R3). disabled: the trainer routes by its own top-k.
    router_replay: str = choice("disabled", ROUTER_REPLAY_MODES)
    # transformers' load-balancing loss (router_aux_loss_coef x loss, per micro-batch forward) added to the
    # actor's loss. 0: logged as moe/aux_loss, not trained on (RL recipes leave it out, as verl does).
    router_aux_loss_coef: float = 0.0
    # A vision-language model's vision tower (and its projection into the decoder) kept frozen: only the
    # decoder trains, as most VLM RL recipes do (docs/models.md#vision-language-models). Ignored for a text
    # model. false trains the tower too; the weight sync moves and checks it either way.
    freeze_vision_tower: bool = True

    def fused_head_chunk(self, vocab_size: int) -> int:
        """The chunk policy_forward's head runs in for a model of ``vocab_size`` tokens, on any device:
        fused_chunk_tokens when fused, 0 for the plain head."""
        mode = switch_mode(self.use_fused_kernels)
        on = mode == "true" or (mode == "auto" and vocab_size >= FUSED_AUTO_MIN_VOCAB)
        return self.fused_chunk_tokens if on else 0

    def check(self) -> None:
        self.lora.check()
        if ac_mode(self.activation_checkpointing) not in AC_MODES:
            raise ConfigError(
                f"model.activation_checkpointing={self.activation_checkpointing!r} is not one of "
                f"{', '.join(AC_MODES)} (or true / false, which mean full / off)"
            )
        if self.activation_checkpointing_every < 1:
            raise ConfigError(
                f"model.activation_checkpointing_every must be >= 1 (1: every decoder layer, k: every k-th), got "
                f"{self.activation_checkpointing_every}"
            )
        if switch_mode(self.use_fused_kernels) not in SWITCH_MODES:
            raise ConfigError(
                f"model.use_fused_kernels={self.use_fused_kernels!r} is not one of {', '.join(SWITCH_MODES)}"
            )
        offloads = [k for k in ("offload_params", "offload_optimizer", "offload_ref") if getattr(self, k)]
        if self.fsdp_unit == "none" and offloads:
            raise ConfigError(
                f"model.fsdp_unit=none (no FSDP2) keeps each model whole on its device, but "
                f"{', '.join(f'model.{k}' for k in offloads)} is set: host-memory offload is FSDP2's; use "
                "model.fsdp_unit=auto with it"
            )
        if self.fused_chunk_tokens < 1:
            raise ConfigError(
                f"model.fused_chunk_tokens must be >= 1 (positions per chunk of the fused LM head), got "
                f"{self.fused_chunk_tokens}"
            )
        if self.router_aux_loss_coef < 0:
            raise ConfigError(
                f"model.router_aux_loss_coef must be >= 0 (0: logged, not trained on), got {self.router_aux_loss_coef}"
            )
