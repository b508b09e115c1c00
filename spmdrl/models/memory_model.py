"""How many tokens one micro-batch may hold on a GPU: the activation memory of a decoder's passes, per
token, and the token budgets it leaves in a card's free memory (trainer.ppo_max_token_len_per_gpu and
trainer.log_prob_max_token_len_per_gpu at -1; docs/scaling.md, "the memory model behind the automatic
budget"). Pure arithmetic: spmdrl/rl/token_budgets.py measures the card and calls it.

A Llama / Qwen2-style decoder: RMSNorm, grouped-query attention through SDPA, a SwiGLU MLP. Hidden h,
intermediate i, L layers, key/value width kv = kv_heads x head_dim, vocabulary V, compute dtype of b bytes
(2: bf16). Bytes per token:

    layer   = attn + mlp = (8 + 6b) h + 2b kv + 4b i + 4 heads + 8    what autograd saves in one decoder layer
                                          (tests/unit/models/test_memory_model.py counts it on a real layer):
    norm    = (4 + 2b) h + 4              an RMSNorm: HF's upcasts, so its float32 input (4h), 1 / rms (4), the
                                          normed input in the compute dtype (b h) and its product with the
                                          weight (b h, the next matmul's input)
    attn    = norm + b (h + 2 kv) + b h + 4 heads    q, k, v after RoPE and the output, saved by SDPA (the
                                          output is also o_proj's input), its float32 logsumexp per head. SDPA's
                                          flash / memory-efficient kernels keep no T x T matrix.
    mlp     = norm + 4b i                 gate, up, silu(gate) and their product (down_proj's input).
    head    = (4 + 2b) V + b h            training, unfused: the float32 copy of the logits logsumexp keeps for
                                          its backward (4V), the logits (b V; in the backward, their gradient),
                                          a temperature-scaled copy (b V; none at temperature 1, then the margin
                                          for the chunked float32 temporaries of spmdrl/algos/losses.py), the
                                          hidden states of the scored positions (b h).
              2b V                        no-grad, unfused: the logits and their scaled copy (the float32 work
                                          is chunked).
              (b + 4) h, 0                fused head (model.use_fused_kernels): logits exist for C positions at
                                          a time (model.fused_chunk_tokens), a fixed C x head bytes (below);
                                          training keeps the hidden states and their float32 gradient.

    train   = layers + norm + head_train (norm: the final RMSNorm), where layers is
              L layer                             no activation checkpointing
              n b h + (L - n) layer + layer       full checkpointing of n = L // k layers (every k-th): their
                                                  inputs, and one layer's activations, recomputed in its backward
              n (attn + b h) + (L - n) layer + mlp    mlp checkpointing: those layers keep attention and the
                                                  MLP's input, one MLP is recomputed at a time
    no_grad = layer + head_no_grad                  nothing is kept between layers: one layer's working set
                                                    bounds what is alive at once

Fixed bytes (not per token), per rank, the parameters sharded over S ranks (P parameters):

    chunk    = C x the unfused head (fused head only)
    state    = 16 P / S per trained model (float32 parameters 4, gradients 4, AdamW's moments 8); b P / S per
               frozen one (the reference, the reward model: stored in the compute dtype); under LoRA the actor
               is 4 P / S (its frozen base stays a float32 master) + 16 A / S for its A adapter parameters;
               0 for what model.offload_params / offload_ref keep in host memory. A value / reward model's
               P is the backbone with a one-output head instead of the LM head (params_with_head).
    gathered = (2 layer_params + root_params) x (b + 4) training: FSDP2's unsharded compute-dtype parameters
               of the layer being computed and the prefetched one, and of the root (embeddings, LM head),
               which stays gathered from forward to backward, plus their unsharded float32 gradients before
               the reduce-scatter; x b for a no-grad pass. P x (b + 4), P x b when the whole model is one
               unit (model.fsdp_unit: whole_model_unit)

    mask     = (1 + b) per (query, key) pair: a boolean 4-D mask and SDPA's additive copy. Padded rows: max_len
               keys per token; packed rows through the mask (trainer.packed_attention=mask): x^2 for x tokens;
               varlen kernels: none

    budget   = the most tokens x with 1.6 x (bytes per token) + x^2 (pair bytes) <= free - state - gathered - chunk
               - reserve (1.6: HEADROOM below), rounded down to a multiple of 256, at least the longest sequence (a longer one gets a
               micro-batch of its own anyway)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from spmdrl.errors import ConfigError

# Budgets are whole multiples of this many tokens: kernels tile by powers of two, and a budget that
# moves by a few tokens with the free memory would give differently shaped micro-batches from run to run.
BUDGET_MULTIPLE = 256
# The budgets assume this many times the modelled activation bytes per token: the caching allocator's
# fragmentation and temporaries the model does not count (a kernel's workspace, a dtype cast held across a
# call). The one GPU figure so far, grpo_gsm8k at Qwen2.5-0.5B's shape on an H100 before the head kept
# only scored positions, peaked at 2.07 MiB per token where this model gives 1.27 (1.6x); until the
# budgets are measured on GPUs the margin covers that.
HEADROOM = 1.6
# model.fsdp_unit=auto makes the whole model one FSDP2 unit on a one-rank mesh only while its unsharded
# compute-dtype parameters and float32 gradients take at most this share of the card: a 0.5B or 1.5B model
# on an 80 GB card, not a 7B one (whose update is compute-bound anyway, and whose budget that copy would eat).
WHOLE_MODEL_SHARE = 1 / 8
FSDP_UNITS = ("auto", "layer", "model", "none")
# A trained parameter's bytes: its float32 master copy, its float32 gradient, AdamW's two float32 moments.
TRAINED_BYTES = 16
MASTER_BYTES = 4


@dataclass(frozen=True)
class DecoderShape:
    """The dimensions of a decoder that its activation memory depends on (an HF config's fields)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 0  # 0: hidden // heads
    tied_embeddings: bool = False
    qkv_bias: bool = True  # Qwen2's attention projections have biases
    # A mixture of experts (Qwen3-MoE): ``intermediate`` is one expert's width, each layer holds ``experts``
    # of them and a router, and a token runs through ``experts_per_token``. 1 and 1: a dense MLP.
    experts: int = 1
    experts_per_token: int = 1

    @classmethod
    def from_hf(cls, config: Any) -> DecoderShape:
        """From a transformers config (Llama, Qwen2/3, Mistral, Gemma and their kin, Qwen3-MoE; a vision-language
        model's decoder: its text config, the vision tower left out)."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        heads = int(config.num_attention_heads)
        experts = int(getattr(config, "num_experts", None) or 1)
        moe = experts > 1
        return cls(
            hidden=int(config.hidden_size),
            intermediate=int(config.moe_intermediate_size if moe else config.intermediate_size),
            experts=experts,
            experts_per_token=int(config.num_experts_per_tok) if moe else 1,
            layers=int(config.num_hidden_layers),
            heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            vocab=int(config.vocab_size),
            head_dim=int(getattr(config, "head_dim", None) or 0),
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(config, "attention_bias", config.model_type == "qwen2")),
        )

    @property
    def q_width(self) -> int:
        return self.heads * (self.head_dim or self.hidden // self.heads)

    @property
    def kv_width(self) -> int:
        return self.kv_heads * (self.head_dim or self.hidden // self.heads)

    def kv_cache_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        """One token's keys and values in every layer, on one of ``tp`` ranks: each rank holds
        kv_heads / tp heads, or one where tp exceeds kv_heads (vLLM replicates them)."""
        heads = max(1, self.kv_heads // tp)
        return 2 * self.layers * heads * (self.head_dim or self.hidden // self.heads) * dtype_bytes

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.q_width, self.kv_width
        attention = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0)
        router = self.experts * h if self.experts > 1 else 0
        # + the MLP (every expert's) and the two norms
        return attention + 3 * h * self.intermediate * self.experts + router + 2 * h

    @property
    def root_params(self) -> int:
        """The embeddings, the final norm and (untied) the LM head: FSDP2's root unit."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    def params_with_head(self, head: str) -> int:
        """The parameters of this decoder with ``head`` (spmdrl.models.build's ModelSpec.head): "lm", the
        causal LM; "value", the critic's one-output token classifier (with a bias); "reward", the one-output
        sequence classifier (without). The latter two have no LM head, tied or not."""
        if head == "lm":
            return self.params
        backbone = self.layers * self.layer_params + self.vocab * self.hidden + self.hidden
        return backbone + self.hidden + (1 if head == "value" else 0)

    @property
    def linear_widths(self) -> dict[str, tuple[int, int]]:
        """(input, output) width of each linear module of a decoder layer, by name (what LoRA targets)."""
        h, q, kv, i = self.hidden, self.q_width, self.kv_width, self.intermediate
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }


# model.lora.target_modules' name for every linear layer (spmdrl.models.lora.ALL_LINEAR; not imported:
# this module stays torch-free).
ALL_LINEAR = "all-linear"


def lora_adapter_params(shape: DecoderShape, rank: int, target_modules: list[str]) -> int:
    """The parameters LoRA adds: rank x (in + out) per targeted linear module (A: rank x in, B: out x rank)
    of every layer. A name the shape does not know raises ConfigError (its widths are unknown here)."""
    widths = shape.linear_widths
    names = list(widths) if ALL_LINEAR in target_modules else list(target_modules)
    unknown = sorted(set(names) - set(widths))
    if unknown:
        raise ConfigError(
            f"model.lora.target_modules: the memory model behind the automatic token budgets knows the "
            f"linear modules {sorted(widths)} of a Llama/Qwen2-style decoder, not {unknown}; target those, or "
            "set trainer.ppo_max_token_len_per_gpu and trainer.log_prob_max_token_len_per_gpu to token counts"
        )
    return shape.layers * sum(rank * (widths[n][0] + widths[n][1]) for n in set(names))


@dataclass(frozen=True)
class MemoryInputs:
    shape: DecoderShape
    compute_bytes: int = 2  # model.param_dtype: bf16 on CUDA
    activation_checkpointing: str = "off"  # model.activation_checkpointing: off, full or mlp
    checkpoint_every: int = 1  # model.activation_checkpointing_every
    # The fused linear + logprob head's chunk (model.use_fused_kernels, fused_chunk_tokens); 0: unfused.
    fused_chunk_tokens: int = 0
    # How attention sees a micro-batch: "varlen" (packed, no mask), "causal" (rows padded to the longest,
    # causal SDPA and no mask: spmdrl.models.causal_attention), "padded" (rows padded to the longest, with a
    # 4-D mask) or "packed_mask" (packed rows through a block-diagonal mask over all their tokens).
    attention: str = "varlen"
    # The whole model is one FSDP2 unit (model.fsdp_unit, whole_model_unit): all of it gathered in a pass.
    whole_model: bool = False


def whole_model_unit(
    mode: str, *, mesh_ranks: int, params: int, compute_bytes: int, trained: bool, total_bytes: int | None
) -> bool:
    """model.fsdp_unit resolved: whether one FSDP2 unit holds the whole model (True) or each decoder layer
    is a unit of its own (False).

    Per-layer units let a multi-rank mesh gather layer i + 1 while layer i computes and keep one layer's
    parameters unsharded at a time. On a one-rank mesh there is nothing to overlap (the "all-gather" is a
    local copy), and each unit costs host work in every forward and backward (its hooks, the copy, the
    reduce), which a GPU step that the host already bounds pays in full. auto chooses the whole model there
    when its unsharded copy (``compute_bytes`` per parameter, + 4 for the float32 gradients of a
    ``trained`` model) is at most WHOLE_MODEL_SHARE of the card's ``total_bytes`` (None: a CPU, no limit).

    none (no FSDP2: the bare module, spmdrl.models.build.parallelize) is the whole model too, for memory:
    autocast's compute-dtype copies of the weights live through a pass as the whole unit's gathered copy
    does. Only on a one-rank mesh (check_bare_module).
    """
    if mode not in FSDP_UNITS:
        raise ConfigError(f"model.fsdp_unit={mode!r} is not one of {', '.join(FSDP_UNITS)}")
    if mode == "none":
        check_bare_module({"this model": mesh_ranks})
        return True
    if mode != "auto":
        return mode == "model"
    if mesh_ranks != 1:
        return False
    unsharded = params * (compute_bytes + (4 if trained else 0))
    return total_bytes is None or unsharded <= total_bytes * WHOLE_MODEL_SHARE


def check_bare_module(ranks_by_role: dict[str, int]) -> None:
    """model.fsdp_unit=none keeps every model unsharded on its rank: a ConfigError naming the roles whose
    mesh has several ranks (each would train its own copy, the gradients never reduced between them)."""
    wide = {role: n for role, n in ranks_by_role.items() if n != 1}
    if wide:
        listed = ", ".join(f"{role} on {n} ranks" for role, n in wide.items())
        raise ConfigError(
            f"model.fsdp_unit=none (no FSDP2) needs a one-rank mesh for every model, got {listed}: run on one "
            "process per model (a one-GPU job), or use model.fsdp_unit=auto"
        )


def norm_bytes_per_token(m: MemoryInputs) -> int:
    """An RMSNorm: its float32 input, 1 / rms (float32), the normed input before and after the weight."""
    return (4 + 2 * m.compute_bytes) * m.shape.hidden + 4


def attention_bytes_per_token(m: MemoryInputs) -> int:
    """The RMSNorm, q, k, v after RoPE, the attention output (o_proj's input; SDPA keeps it too) and
    SDPA's float32 logsumexp per head."""
    s, b = m.shape, m.compute_bytes
    return norm_bytes_per_token(m) + b * (s.q_width + 2 * s.kv_width) + b * s.q_width + 4 * s.heads


def mlp_bytes_per_token(m: MemoryInputs) -> int:
    """The RMSNorm; gate, up, silu(gate) and their product (down_proj's input), in each expert a token runs
    through (a mixture of experts' routing state is left out: a few numbers per token)."""
    s, b = m.shape, m.compute_bytes
    return norm_bytes_per_token(m) + 4 * b * s.intermediate * s.experts_per_token


def layer_bytes_per_token(m: MemoryInputs) -> int:
    """What one decoder layer's backward needs kept, per token (the module docstring's ``layer``)."""
    return attention_bytes_per_token(m) + mlp_bytes_per_token(m)


def _unfused_head(m: MemoryInputs, grad: bool) -> int:
    b, v = m.compute_bytes, m.shape.vocab
    return (4 + 2 * b) * v + b * m.shape.hidden if grad else 2 * b * v


def head_bytes_per_token(m: MemoryInputs, *, grad: bool) -> int:
    """The LM head and the log-softmax over the vocabulary, per token."""
    if m.fused_chunk_tokens:
        return (m.compute_bytes + 4) * m.shape.hidden if grad else 0
    return _unfused_head(m, grad)


def head_chunk_bytes(m: MemoryInputs, *, grad: bool) -> int:
    """The fused head's one chunk of logits at a time (0 unfused: its head is all per token)."""
    return m.fused_chunk_tokens * _unfused_head(m, grad)


def train_bytes_per_token(m: MemoryInputs) -> int:
    """A forward + backward (the update), per token of the micro-batch."""
    s, b = m.shape, m.compute_bytes
    layer = layer_bytes_per_token(m)
    n = s.layers // m.checkpoint_every if m.activation_checkpointing != "off" else 0
    if m.activation_checkpointing == "full":
        layers = n * b * s.hidden + (s.layers - n) * layer + layer
    elif m.activation_checkpointing == "mlp":
        layers = n * (attention_bytes_per_token(m) + b * s.hidden) + (s.layers - n) * layer
        layers += mlp_bytes_per_token(m)
    else:
        layers = s.layers * layer
    return layers + norm_bytes_per_token(m) + head_bytes_per_token(m, grad=True)


def no_grad_bytes_per_token(m: MemoryInputs) -> int:
    """A no-grad forward (old / reference logprobs, values), per token of the micro-batch."""
    return layer_bytes_per_token(m) + head_bytes_per_token(m, grad=False)


def gathered_param_bytes(m: MemoryInputs, *, grad: bool) -> int:
    """FSDP2's unsharded parameters during a pass (and, training, their float32 gradients)."""
    s = m.shape
    per_param = m.compute_bytes + (4 if grad else 0)
    return (s.params if m.whole_model else 2 * s.layer_params + s.root_params) * per_param


def model_state_bytes(params: int, trained: int, storage_bytes: int, shards: int) -> int:
    """One model's sharded state on a rank at the update (docs/scaling.md's table): ``params`` stored at
    ``storage_bytes`` each (4: a trained model's float32 master copy; a frozen model's compute dtype), of
    which ``trained`` (all, LoRA's adapters, or none) also carry a float32 gradient and AdamW's two float32
    moments, all over ``shards`` ranks."""
    return (params * storage_bytes + trained * (TRAINED_BYTES - MASTER_BYTES)) // shards


def scoring_pass_bytes(m: MemoryInputs, rows: int, row_len: int) -> int:
    """A reward model's no-grad forward over ``rows`` right-padded rows of ``row_len`` tokens (its head has
    one output: no vocabulary term): one layer's working set and the 4-D padding mask per token, times
    HEADROOM, and the gathered parameters."""
    tokens = rows * row_len
    per_token = layer_bytes_per_token(m) + mask_bytes_per_key(m) * row_len
    return math.ceil(tokens * per_token * HEADROOM) + gathered_param_bytes(m, grad=False)


def mask_bytes_per_key(m: MemoryInputs) -> int:
    """A (B, 1, T, T) boolean attention mask and the additive copy SDPA makes of it in the compute dtype,
    per (query, key) pair."""
    return 1 + m.compute_bytes


def token_budget(available_bytes: int, bytes_per_token: int, min_tokens: int, pair_bytes: int = 0) -> int:
    """The most tokens x with x bytes_per_token + x^2 pair_bytes <= ``available_bytes`` (pair_bytes: a mask
    over all of a packed micro-batch's tokens), a multiple of BUDGET_MULTIPLE, at least ``min_tokens``."""
    a = max(available_bytes, 0)
    if pair_bytes:
        x = int((-bytes_per_token + math.sqrt(bytes_per_token**2 + 4 * pair_bytes * a)) / (2 * pair_bytes))
    else:
        x = a // bytes_per_token
    return max(x // BUDGET_MULTIPLE * BUDGET_MULTIPLE, min_tokens)


@dataclass(frozen=True)
class TokenBudgets:
    """Tokens per micro-batch: the update's (forward + backward) and the no-grad passes'."""

    train: int
    no_grad: int
    # What they came from, for the log and derived.json.
    train_bytes_per_token: int
    no_grad_bytes_per_token: int
    available_gib: float
    state_gib: float = 0.0  # the models' state on the busiest rank (spmdrl.rl.token_budgets.rank_states)

    def as_dict(self) -> dict[str, Any]:
        return {f"memory_model_{k}": v for k, v in dataclasses.asdict(self).items()}


def token_budgets(
    m: MemoryInputs, *, free_bytes: int, state_bytes: int, reserve_bytes: int, max_len: int
) -> TokenBudgets:
    """The budgets for ``free_bytes`` of the card (with nothing of the trainer's allocated yet, and the
    engine asleep), of which the models' state takes ``state_bytes`` and ``reserve_bytes`` stay unused.
    ``max_len``: the longest sequence, the least budget, and the widest a padded row's mask gets."""
    available = free_bytes - state_bytes - reserve_bytes
    # The attention mask: none (varlen, or rows without padding), a row of at most max_len keys per token
    # (padded rows), or every pair of a packed micro-batch's tokens (packed, attending through the mask).
    linear_mask = mask_bytes_per_key(m) * max_len if m.attention == "padded" else 0
    pair = mask_bytes_per_key(m) if m.attention == "packed_mask" else 0
    train = train_bytes_per_token(m) + linear_mask
    no_grad = no_grad_bytes_per_token(m) + linear_mask
    fixed_train = gathered_param_bytes(m, grad=True) + head_chunk_bytes(m, grad=True)
    fixed_no_grad = gathered_param_bytes(m, grad=False) + head_chunk_bytes(m, grad=False)

    def budget(fixed: int, per_token: int) -> int:
        return token_budget(available - fixed, math.ceil(per_token * HEADROOM), max_len, pair)

    return TokenBudgets(
        train=budget(fixed_train, train),
        no_grad=budget(fixed_no_grad, no_grad),
        train_bytes_per_token=train,
        no_grad_bytes_per_token=no_grad,
        available_gib=round(available / 2**30, 2),
        state_gib=round(state_bytes / 2**30, 2),
    )
