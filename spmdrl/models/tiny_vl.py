"""The built-in tiny vision-language model (``model.path: tiny-vl``): an Idefics3, the architecture of
SmolVLM, with a two-layer SigLIP vision tower, the tiny Llama-shaped decoder of :mod:`spmdrl.models.tiny`
(same widths, same tokenizer extended by the image tokens) and an image processor that makes every image
4 tokens.

Why Idefics3 and not Qwen2.5-VL / Qwen3-VL: vLLM's classes for the Qwen-VL family (and LLaVA, Gemma 3,
InternVL, Pixtral) import transformers' torchvision image processors at import time, and the CPU setup
(torchrun_scripts/setup_cpu.sh) removes torchvision, whose PyPI build is CUDA-only and breaks beside a
CPU torch. vLLM's Idefics3 and transformers' PIL image processor for it need no torchvision, so the
built-in VLM runs end to end on the CPU engine. It also keeps 1-D positions (no M-RoPE), so the trainer's
forward and the engine's agree on positions without the image grid.

Deterministic like the text models: a fixed seed, a locally trained tokenizer, built once per cache
directory (spmdrl.models.build_once) into ``<cache>/tiny-idefics3-v<VERSION>/``.
"""

from __future__ import annotations

from pathlib import Path

from spmdrl.models import tiny

TINY_VL_VERSION = 1
TINY_VL_DIRNAME = f"tiny-idefics3-v{TINY_VL_VERSION}"
# What config.json says of its family (spmdrl.models.families), for checks made before it is built.
TINY_VL_FAMILY_CONFIG = {"model_type": "idefics3", "architectures": ["Idefics3ForConditionalGeneration"]}
TINY_VL_FILES = (*tiny.TINY_MODEL_FILES, "processor_config.json")

# The placeholder a prompt writes for each image; the processor expands it to the image's tokens,
# <fake_token_around_image><global-img><image> x IMAGE_TOKENS <fake_token_around_image>.
IMAGE_TOKEN = "<image>"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
# Idefics3's processor looks up row/column tokens for split images (6 x 6 at most) even when, as here,
# images are never split: they must exist in the vocabulary.
ROW_COL_TOKENS = tuple(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))
IMAGE_SPECIAL_TOKENS = (FAKE_IMAGE_TOKEN, IMAGE_TOKEN, END_OF_UTTERANCE, GLOBAL_IMAGE_TOKEN, *ROW_COL_TOKENS)

# Every image is resized to IMAGE_SIZE x IMAGE_SIZE pixels (longest edge, padded), cut in PATCH_SIZE patches
# (4 x 4 = 16), which pixel shuffle (scale_factor 2) merges into 4 tokens for the decoder.
IMAGE_SIZE = 64
PATCH_SIZE = 16
SCALE_FACTOR = 2
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
# head_dim 32 in both towers, as vLLM's CPU attention wants (see spmdrl.models.tiny.MODEL_SHAPE).
VISION_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=IMAGE_SIZE,
    patch_size=PATCH_SIZE,
)

# ChatML like the tiny text model; a message's content is a string or a list of {"type": "image"} and
# {"type": "text", "text": ...} parts (transformers' multimodal chat format), an image part written as
# IMAGE_TOKEN.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '" + IMAGE_TOKEN + "' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tiny_vl_model(out_dir: Path) -> None:
    """Writes the tiny VLM, its tokenizer and its processor to ``out_dir`` (uncached; use
    :func:`spmdrl.models.tiny.ensure_tiny_model` with ``tiny-vl``)."""
    import torch
    from transformers import (
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = tiny.build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_SPECIAL_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE
    pad_id, eos_id, image_id = tokenizer.convert_tokens_to_ids([tiny.PAD_TOKEN, tiny.EOS_TOKEN, IMAGE_TOKEN])
    shape = tiny.MODEL_SHAPE
    text = dict(
        model_type="llama",
        vocab_size=len(tokenizer),
        **shape,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=True,
    )
    config = Idefics3Config(
        text_config=text,
        vision_config=VISION_SHAPE,
        image_token_id=image_id,
        scale_factor=SCALE_FACTOR,
        # Tied like the tiny Qwen2 (and SmolVLM-256M), so the tied path of sync and export is exercised.
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        dtype="float32",
    )
    config.architectures = [Idefics3ForConditionalGeneration.__name__]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.INIT_SEED)
        model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)
    # Never split images into tiles (a tile costs IMAGE_TOKENS more, and row/column tokens): one global image.
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=IMAGE_TOKENS,
        chat_template=CHAT_TEMPLATE,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)  # the tokenizer's files too
