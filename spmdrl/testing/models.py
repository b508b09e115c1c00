"""Small random checkpoints for tests and benchmarks: Qwen2 without a tokenizer, and one per supported
model family with its tokenizer and chat template (no download)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

# Two layers, two heads of head_dim 32 (vLLM's CPU attention rejects 16), tied embeddings.
SMALL_QWEN2: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    tie_word_embeddings=True,
    max_position_embeddings=64,
)

# Qwen2.5-0.5B's config.json numbers (tied, GQA 14/2, the real vocabulary): a real shape for the memory
# model's tests, which read configs and build nothing of this size.
QWEN2_5_0_5B: dict[str, Any] = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
)


def save_small_qwen2(path: Path, *, seed: int = 0, **overrides: Any) -> None:
    """Saves a deterministic random Qwen2 (``SMALL_QWEN2`` with ``overrides``) as safetensors in ``path``."""
    torch.manual_seed(seed)
    Qwen2ForCausalLM(Qwen2Config(**{**SMALL_QWEN2, **overrides})).save_pretrained(path)


def padded_rows(
    prompt_len_B: torch.Tensor, resp_len_B: torch.Tensor, vocab: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random right-padded prompt + response rows for update tests: ``(ids_BT, attention_BT, response_BT)``.

    Token ids are drawn from ``g`` (pad positions are 0); the response mask marks each row's response.
    """
    B = prompt_len_B.shape[0]
    T = int((prompt_len_B + resp_len_B).max())
    ids = torch.randint(0, vocab, (B, T), generator=g)
    attn = torch.zeros(B, T, dtype=torch.long)
    resp = torch.zeros(B, T, dtype=torch.bool)
    for i in range(B):
        p, r = int(prompt_len_B[i]), int(resp_len_B[i])
        attn[i, : p + r] = 1
        resp[i, p : p + r] = True
    return torch.where(attn.bool(), ids, 0), attn, resp


def rank_policy_batch(rows: int, rank: int, world: int, vocab: int = 64, seed: int = 0) -> Any:
    """This rank's share of ``rows`` random right-padded rows (prompts of 2-6 tokens, responses of 1-9) as a
    ``PolicyBatch`` with random engine logprobs and advantages: the same global batch on every rank, split
    by contiguous rows as the RL job splits its batch."""
    from spmdrl.rl.batch import PolicyBatch

    g = torch.Generator().manual_seed(seed)
    ids, attn, resp = padded_rows(
        torch.randint(2, 7, (rows,), generator=g), torch.randint(1, 10, (rows,), generator=g), vocab, g
    )
    B, T = ids.shape
    mine = slice(rank * B // world, (rank + 1) * B // world)
    engine_lp = -torch.rand(B, T, generator=g) * resp
    adv = torch.randn(B, T, generator=g) * resp
    return PolicyBatch(ids[mine], attn[mine], resp[mine], engine_lp[mine], adv[mine])


# ---- one small random model per supported family (spmdrl.models.families) --------------------------
#
# Each is built from its family's own transformers config class, with that family's attention and norm
# variants (Qwen2's q/k/v biases, Qwen3's q_norm / k_norm, Llama 3's rope scaling, Mistral's sliding
# window, Gemma's (1 + w) norms, scaled embeddings, soft-capping and alternating sliding layers), a
# vocabulary of about a quarter of the real one (the engine, the LM head and the sync's buckets see a
# realistic table; a few tens of MB), and a tokenizer with the family's special tokens and a chat template
# in the family's format that takes a system prompt. The tokenizer is the built-in tiny model's BPE
# (spmdrl.models.tiny) with the family's special tokens in place of ChatML's: the model's rows past it
# are padding, as in real checkpoints (vLLM and the decoder accept their ids).

_LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim "
    "+ '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# Qwen2.5's: a default system prompt when the conversation has none.
_CHATML_DEFAULT_SYSTEM_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Mistral's: the system prompt goes in front of the first user message; an answer ends with eos.
_MISTRAL_TEMPLATE = (
    "{%- set ns = namespace(system='') %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set ns.system = messages[0]['content'] + '\\n\\n' %}"
    "{%- set messages = messages[1:] %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}"
    "{{- '[INST] ' + (ns.system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}"
    "{%- else %}{{- '[TOOL_RESULTS] ' + message['content'] + ' [/TOOL_RESULTS]' }}"
    "{%- endif %}"
    "{%- endfor %}"
)
# Gemma's: the assistant is "model", the system prompt joins the first user turn.
_GEMMA_TEMPLATE = (
    "{%- set ns = namespace(system='') %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set ns.system = messages[0]['content'] + '\\n\\n' %}"
    "{%- set messages = messages[1:] %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{{- '<start_of_turn>' + role + '\\n' + (ns.system if loop.first else '') + message['content'] | trim "
    "+ '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)

# Every family: 2 layers, 2 query heads and 1 KV head of head_dim 32 (vLLM's CPU attention's smallest).
_SMALL_DECODER: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=512,
)
# Narrower than the tests' prompts (150 tokens), so windowed attention differs from full attention.
SLIDING_WINDOW = 32


@dataclass(frozen=True)
class FamilySpec:
    """How to build a small random checkpoint of one family."""

    name: str  # the test id
    config_class: str  # transformers' config class
    model_class: str  # transformers' causal-LM class
    config: dict[str, Any]
    vocab_size: int
    # (pad, bos, eos): they take ids 0, 1, 2 (the tiny BPE's special slots); None leaves pad unset.
    pad: str | None
    bos: str
    eos: str
    extra_special: tuple[str, ...]
    chat_template: str
    # The end-of-turn token the template closes an assistant message with ("" when it is eos).
    end_of_turn: str = ""
    # Whether generation_config.json lists the end-of-turn token as an eos (real Llama 3.1 and Gemma 3
    # instruct checkpoints do; a base tokenizer with an instruct template often does not).
    end_of_turn_in_generation_config: bool = False
    tied_default: bool = True
    untied_ok: bool = True


FAMILY_SPECS: dict[str, FamilySpec] = {
    s.name: s
    for s in (
        FamilySpec(
            "llama3",
            "LlamaConfig",
            "LlamaForCausalLM",
            dict(
                rope_parameters=dict(
                    rope_type="llama3",
                    rope_theta=500000.0,
                    factor=8.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=64,  # 8192 of 131072 in Llama 3.2
                ),
                rms_norm_eps=1e-5,
            ),
            vocab_size=32064,  # Llama 3's 128256 / 4
            pad="<|finetune_right_pad_id|>",
            bos="<|begin_of_text|>",
            eos="<|end_of_text|>",
            extra_special=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"),
            chat_template=_LLAMA3_TEMPLATE,
            end_of_turn="<|eot_id|>",
            tied_default=True,  # Llama 3.2 1B / 3B
        ),
        FamilySpec(
            "qwen2",
            "Qwen2Config",
            "Qwen2ForCausalLM",
            dict(rope_parameters=dict(rope_type="default", rope_theta=1000000.0), rms_norm_eps=1e-6),
            vocab_size=37984,  # Qwen2.5's 151936 / 4
            pad="<|endoftext|>",
            bos="<|im_start|>",
            eos="<|im_end|>",
            extra_special=(),
            chat_template=_CHATML_DEFAULT_SYSTEM_TEMPLATE,
            tied_default=False,  # Qwen2.5 7B (0.5B-3B are tied, like the built-in tiny model)
        ),
        FamilySpec(
            "qwen3",
            "Qwen3Config",
            "Qwen3ForCausalLM",
            dict(rope_parameters=dict(rope_type="default", rope_theta=1000000.0), rms_norm_eps=1e-6),
            vocab_size=37984,
            pad="<|endoftext|>",
            bos="<|im_start|>",
            eos="<|im_end|>",
            extra_special=("<think>", "</think>"),
            chat_template=_CHATML_TEMPLATE,
            tied_default=True,  # Qwen3 0.6B-4B
        ),
        FamilySpec(
            "mistral",
            "MistralConfig",
            "MistralForCausalLM",
            dict(
                sliding_window=SLIDING_WINDOW,
                rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
                rms_norm_eps=1e-5,
            ),
            vocab_size=32768,  # Mistral 7B v0.3's
            pad=None,
            bos="<s>",
            eos="</s>",
            extra_special=("<unk>", "[INST]", "[/INST]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
            chat_template=_MISTRAL_TEMPLATE,
            tied_default=False,
        ),
        FamilySpec(
            "gemma2",
            "Gemma2Config",
            "Gemma2ForCausalLM",
            dict(
                query_pre_attn_scalar=32,
                sliding_window=SLIDING_WINDOW,
                layer_types=["sliding_attention", "full_attention"],
                attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0,
                hidden_activation="gelu_pytorch_tanh",
            ),
            vocab_size=32768,  # Gemma 2's 256000 / 8
            pad="<pad>",
            bos="<bos>",
            eos="<eos>",
            extra_special=("<start_of_turn>", "<end_of_turn>"),
            chat_template=_GEMMA_TEMPLATE,
            end_of_turn="<end_of_turn>",
            untied_ok=False,  # spmdrl.models.families: vLLM's Gemma 2 always ties
        ),
        FamilySpec(
            "gemma3",
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            dict(
                query_pre_attn_scalar=32,
                sliding_window=SLIDING_WINDOW,
                layer_types=["sliding_attention", "full_attention"],
                rope_parameters=dict(
                    sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                    full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1000000.0),
                ),
                hidden_activation="gelu_pytorch_tanh",
            ),
            vocab_size=32768,  # Gemma 3's 262144 / 8
            pad="<pad>",
            bos="<bos>",
            eos="<eos>",
            extra_special=("<start_of_turn>", "<end_of_turn>"),
            chat_template=_GEMMA_TEMPLATE,
            end_of_turn="<end_of_turn>",
            end_of_turn_in_generation_config=True,
        ),
        FamilySpec(
            "qwen3_moe",
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            dict(
                rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
                rms_norm_eps=1e-6,
                # 4 experts of width 64 (vLLM's CPU fused-MoE kernel wants multiples of 32), 2 per token,
                # renormalized as the released Qwen3-MoE models do.
                moe_intermediate_size=64,
                num_experts=4,
                num_experts_per_tok=2,
                norm_topk_prob=True,
            ),
            vocab_size=37984,
            pad="<|endoftext|>",
            bos="<|im_start|>",
            eos="<|im_end|>",
            extra_special=("<think>", "</think>"),
            chat_template=_CHATML_TEMPLATE,
            tied_default=False,  # Qwen3-30B-A3B, 235B-A22B
        ),
    )
}


def family_tokenizer(spec: FamilySpec):  # noqa: ANN201 - a transformers tokenizer
    """The tiny BPE with ``spec``'s special tokens (pad, bos, eos at ids 0-2, the others after the BPE)."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from spmdrl.models.tiny import SPECIAL_TOKENS, build_tokenizer

    first = (spec.pad or "<|pad_unused|>", spec.bos, spec.eos)
    state = json.loads(build_tokenizer().backend_tokenizer.to_str())
    renamed = dict(zip(SPECIAL_TOKENS, first, strict=True))
    for t in state["added_tokens"]:
        t["content"] = renamed.get(t["content"], t["content"])
    state["model"]["vocab"] = {renamed.get(k, k): v for k, v in state["model"]["vocab"].items()}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(state)),
        bos_token=spec.bos,
        eos_token=spec.eos,
        pad_token=spec.pad,
        additional_special_tokens=list(spec.extra_special),
        chat_template=spec.chat_template,
        clean_up_tokenization_spaces=False,
        model_max_length=_SMALL_DECODER["max_position_embeddings"],
    )
    return tok


def save_family_model(path: Path, family: str, *, tied: bool | None = None, seed: int = 0) -> Path:
    """Writes a small random ``family`` checkpoint (``FAMILY_SPECS``) with its tokenizer and generation
    config to ``path``, in float32; ``tied`` (default: the family's usual) ties the LM head to the input
    embedding. Deterministic for a seed. Returns ``path``."""
    import transformers
    from transformers import GenerationConfig

    spec = FAMILY_SPECS[family]
    tied = spec.tied_default if tied is None else tied
    tok = family_tokenizer(spec)
    ids = {t: tok.convert_tokens_to_ids(t) for t in (spec.bos, spec.eos, spec.end_of_turn) if t}
    pad_id = tok.pad_token_id
    config = getattr(transformers, spec.config_class)(
        vocab_size=spec.vocab_size,
        **_SMALL_DECODER,
        **spec.config,
        tie_word_embeddings=tied,
        bos_token_id=ids[spec.bos],
        eos_token_id=ids[spec.eos],
        pad_token_id=pad_id,
        dtype="float32",
    )
    config.architectures = [spec.model_class]
    eos_ids = [ids[spec.eos]]
    if spec.end_of_turn and spec.end_of_turn_in_generation_config:
        eos_ids.append(ids[spec.end_of_turn])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, spec.model_class)(config).to(torch.float32)
        # Gemma's norms compute x * (1 + w) and start at w = 0; random w makes a sync that mixed up w and
        # 1 + w (or skipped a norm) visible.
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.1)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[spec.bos],
        eos_token_id=eos_ids if len(eos_ids) > 1 else eos_ids[0],
        pad_token_id=pad_id,
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path
