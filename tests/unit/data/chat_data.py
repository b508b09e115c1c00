"""What the data tests share: a small ChatML tokenizer trained in place, the ChatML text a conversation
renders to, verl-schema rows and a parquet writer."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE with ChatML special tokens; trained in milliseconds, so no download."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["user assistant system what is 12 + 30? the answer is 42.", "hello world, answer: 7 plus 5"]
    tok.train_from_iterator(corpus * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML
    )


def chatml(messages: list[dict[str, str]]) -> str:
    """The ChatML text a conversation should render to, written out by hand for the checks."""
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return body + "<|im_start|>assistant\n"


def verl_rows(n: int) -> dict[str, list]:
    return {
        "data_source": ["tiny/add"] * n,
        "prompt": [
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"what is {i} + {i}?"}]
            for i in range(n)
        ],
        "ability": ["math"] * n,
        "reward_model": [{"ground_truth": str(2 * i), "style": "rule"} for i in range(n)],
        "extra_info": [{"index": i, "split": "train"} for i in range(n)],
    }


def write(path: Path, columns: dict[str, list]) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


# ---------------------------------------------------------------- RL prompts
