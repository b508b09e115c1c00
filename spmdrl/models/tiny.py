"""The built-in tiny models: a deterministic, randomly initialised Qwen2 with a locally trained tokenizer,
and a mixture-of-experts sibling (a Qwen3-MoE with the same tokenizer).

``model.path: tiny`` selects the Qwen2, ``model.path: tiny-moe`` the Qwen3-MoE, ``model.path: tiny-vl`` a
vision-language model (spmdrl.models.tiny_vl). It needs no network: the tokenizer is trained here with the
``tokenizers`` library and the weights come from a fixed seed, so every machine builds the same bytes.
It is small enough to train on two CPU cores, yet large enough to learn the tiny arithmetic task
(:mod:`spmdrl.data.tiny_task`), and it loads in transformers and in vLLM like any HF checkpoint.

Built once per cache directory into ``<cache>/tiny-qwen2-v<VERSION>/`` (``tiny-qwen3-moe-v<VERSION>``); concurrent callers (every
torchrun rank) serialize on a file lock and the finished directory appears by an atomic rename.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from spmdrl.data import tiny_task
from spmdrl.models.build_once import build_once

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

# Bump when anything below (corpus, tokenizer, architecture, seed) changes, so cached copies of the
# old model are not mistaken for the new one.
TINY_MODEL_VERSION = 1
TINY_MODEL_DIRNAME = f"tiny-qwen2-v{TINY_MODEL_VERSION}"
TINY_MOE_DIRNAME = f"tiny-qwen3-moe-v{TINY_MODEL_VERSION}"
# What model.path names them by.
TINY = "tiny"
TINY_MOE = "tiny-moe"
# The vision-language model (an Idefics3: spmdrl.models.tiny_vl).
TINY_VL = "tiny-vl"
# On-policy distillation's built-in teacher: a wider Qwen2 on this tokenizer, trained on the tiny task
# (spmdrl.models.tiny_teacher).
TINY_TEACHER = "tiny-teacher"
BUILT_IN_MODELS = (TINY, TINY_MOE, TINY_VL, TINY_TEACHER)
# What the built-in MoE's config.json says of its family (spmdrl.models.families), for checks made before
# it is built.
TINY_MOE_FAMILY_CONFIG = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}
TINY_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
INIT_SEED = 0

VOCAB_SIZE = 512
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
# Ids 0, 1, 2 in this order (the trainer adds special tokens first).
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, EOS_TOKEN)

# Qwen2's pre-tokenization pattern: contractions, words (with one leading non-letter), single digits,
# punctuation runs, newlines, other whitespace.
PRETOKENIZE_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# ChatML, as Qwen writes it, without Qwen's default system prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The architecture. head_dim = hidden / heads = 32: vLLM's CPU attention rejects 16.
MODEL_SHAPE = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=352,
    max_position_embeddings=512,
)

# The mixture of experts: the same attention and width as the Qwen2's, each layer's MLP 4 experts of
# which every token uses 2 (renormalized, as Qwen3-MoE's releases do), untied like them. An expert's width,
# 128, is a multiple of 32, which vLLM's CPU fused-MoE kernel needs (it pads to it otherwise).
MOE_SHAPE = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=352,  # unused: every layer is sparse (mlp_only_layers is empty)
    moe_intermediate_size=128,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=512,
)

_GENERIC_TEXT = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Question: what is the answer? Answer: it is 42. Let's think step by step, then write the result.
First, we add the numbers. Next, we subtract the second from the first. Finally, we check our work.
You are a helpful assistant. Please answer the user's question clearly and briefly.
def add(a, b):\n    return a + b  # sum\nprint(add(3, 4) * (2 - 1) / 5 % 7)
x = [1, 2, 3]; y = {"key": 'value'}; z = (x[0] >= y.get("k", 0)) and not False
Email: name@example.com, web: https://example.org/path?query=1&other=2#frag | pipes ~ tildes ` ^ $
"""


def default_cache_dir(configured: str = "") -> Path:
    """Where the tiny model and generated data live: ``configured``, else $SPMDRL_CACHE, else ~/.cache/spmdrl."""
    if configured:
        return Path(configured).expanduser()
    env = os.environ.get("SPMDRL_CACHE", "")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "spmdrl"


def _tokenizer_corpus() -> list[str]:
    """Fixed text the BPE merges are learned from: the tiny task in chat shape, role names, generic ASCII."""
    lines = [_GENERIC_TEXT, "".join(chr(c) for c in range(32, 127)), "system\n", "tool\n"]
    numbers = [(12, 7), (3, 1), (20, 15), (8, 8), (1, 0)]
    for op, templates in tiny_task.TEMPLATES.items():
        for t in range(len(templates)):
            for n, name in enumerate(tiny_task.NAMES):
                for o in range(len(tiny_task.OBJECTS)):
                    a, b = numbers[(t + o + len(name)) % len(numbers)]
                    question = tiny_task.phrase(((op, a, b), t, n, o))
                    answer = a + b if op == "+" else a - b
                    # "user" / "assistant" as the chat template places them, right after <|im_start|>.
                    lines.append(f"user\n{question} {tiny_task.INSTRUCTION}")
                    lines.append(f"assistant\n{tiny_task.demonstration((op, a, b), answer)}")
    return lines


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with single-digit tokens, trained on :func:`_tokenizer_corpus`."""
    # Imported here, not at the top: importing transformers takes seconds, and callers that only need
    # default_cache_dir or an already built model should not pay for it.
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # The same normalizer and pre-tokenizer as Qwen2's: transformers 5 loads a qwen2 model's tokenizer
    # as Qwen2Tokenizer, which rebuilds this pipeline around the saved vocab and merges, so training
    # with anything else would make tokenizer.json and AutoTokenizer disagree. The pattern puts each
    # digit in a token of its own ("19" is "1", "9": arithmetic is learnable), and byte-level pieces
    # make any text, not only the corpus, encode and decode back.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        # The default would rewrite " ." to "." on decode and break exact round trips.
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )


def build_tiny_model(out_dir: Path, *, moe: bool = False) -> None:
    """Writes the tiny model (``moe``: the Qwen3-MoE) and tokenizer to ``out_dir`` (uncached; use
    :func:`ensure_tiny_model`)."""
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    tokenizer = build_tokenizer()
    pad_id, eos_id = tokenizer.convert_tokens_to_ids([PAD_TOKEN, EOS_TOKEN])
    ids = dict(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id, dtype="float32")
    if moe:
        config = Qwen3MoeConfig(vocab_size=len(tokenizer), **MOE_SHAPE, tie_word_embeddings=False, **ids)
        model_class: type = Qwen3MoeForCausalLM
    else:
        # Tied like Qwen2.5-0.5B, so the tied-embedding path of weight sync and export is exercised.
        config = Qwen2Config(vocab_size=len(tokenizer), **MODEL_SHAPE, tie_word_embeddings=True, **ids)
        model_class = Qwen2ForCausalLM
    config.architectures = [model_class.__name__]
    # A private RNG stream: the same weights every build, and the caller's torch RNG is left untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(INIT_SEED)
        model = model_class(config).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def ensure_tiny_model(cache_dir: Path, name: str = TINY) -> Path:
    """The directory of the built-in model ``name`` (one of BUILT_IN_MODELS) under ``cache_dir``, built on
    first use. Safe to call from every rank."""
    if name not in BUILT_IN_MODELS:
        raise ValueError(f"no built-in model {name!r}; there are {', '.join(BUILT_IN_MODELS)}")
    if name == TINY_VL:
        from spmdrl.models import tiny_vl

        target = Path(cache_dir).expanduser() / tiny_vl.TINY_VL_DIRNAME
        return build_once(
            target, tiny_vl.build_tiny_vl_model, tiny_vl.TINY_VL_FILES, f"built-in {name} model"
        )
    if name == TINY_TEACHER:
        from spmdrl.models.tiny_teacher import ensure_tiny_teacher

        return ensure_tiny_teacher(cache_dir)
    moe = name == TINY_MOE
    dirname = TINY_MOE_DIRNAME if moe else TINY_MODEL_DIRNAME
    target = Path(cache_dir).expanduser() / dirname
    return build_once(
        target, lambda out: build_tiny_model(out, moe=moe), TINY_MODEL_FILES, f"built-in {name} model"
    )
