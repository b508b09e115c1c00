"""The built-in tiny model (spmdrl/models/tiny.py): loads in transformers, is byte-for-byte reproducible,
tokenizes well (tests/integration/test_tiny_model.py: vLLM)."""

from __future__ import annotations

import hashlib
import json
import random
import string
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from spmdrl.models.tiny import (
    TINY_MODEL_DIRNAME,
    TINY_MODEL_FILES,
    TINY_MOE,
    TINY_MOE_DIRNAME,
    build_tiny_model,
    default_cache_dir,
    ensure_tiny_model,
)
from spmdrl.testing import prefork


def file_hashes(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    build_tiny_model(out)
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


def test_transformers_loads_and_runs(model_dir: Path, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = model.config
    assert cfg.hidden_size // cfg.num_attention_heads >= 32, "vLLM's CPU attention rejects head_dim 16"
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert next(model.parameters()).dtype == torch.float32
    assert cfg.vocab_size == len(tokenizer) <= 512
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tom has 12 apples and gets 7 more."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer.encode(text)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg.vocab_size)
    assert torch.isfinite(logits).all()


def test_special_token_ids_agree_across_files(model_dir: Path, tokenizer):
    cfg = AutoConfig.from_pretrained(model_dir)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert cfg.eos_token_id == gen["eos_token_id"] == tokenizer.eos_token_id
    assert cfg.pad_token_id == gen["pad_token_id"] == tokenizer.pad_token_id
    assert cfg.bos_token_id == gen["bos_token_id"]
    assert (
        len({tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.convert_tokens_to_ids("<|im_start|>")})
        == 3
    )


def test_two_builds_are_byte_identical(model_dir: Path, tmp_path: Path):
    build_tiny_model(tmp_path / "again")
    assert file_hashes(tmp_path / "again") == file_hashes(model_dir)


def test_chat_template_is_chatml(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without == text.removesuffix("<|im_start|>assistant\n")
    # The markers are single special tokens, not spelled out in pieces.
    ids = tokenizer.encode(text)
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    assert ids.count(tokenizer.eos_token_id) == 2


def test_digits_are_single_tokens(tokenizer):
    for text in ["12 + 7 = 19\n#### 19", "x1234567890y", "There are 305 apples, 0.75 of 1000."]:
        pieces = [tokenizer.decode([i]) for i in tokenizer.encode(text)]
        for piece in pieces:
            if any(c.isdigit() for c in piece):
                assert len(piece) == 1, f"{piece!r} in {text!r} holds a digit and more"


def test_arbitrary_ascii_round_trips(model_dir: Path, tokenizer):
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(0)
    texts = ["", " leading and trailing ", "tabs\tand\nnew\r\nlines  ", string.printable]
    texts += ["".join(rng.choice(string.printable) for _ in range(rng.randint(1, 200))) for _ in range(50)]
    for text in texts:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        # tokenizer.json alone (what a tokenizers-only reader sees) agrees with what AutoTokenizer built.
        assert raw.encode(text).ids == ids


def test_ensure_reuses_the_built_directory(tmp_path: Path):
    path = ensure_tiny_model(tmp_path)
    assert path == tmp_path / TINY_MODEL_DIRNAME
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_the_cached_files_are_readable_by_everyone(tmp_path: Path):
    # A cache shared by several users (or read by a container's other uid) must not hold private files.
    path = ensure_tiny_model(tmp_path)
    modes = {f.name: f.stat().st_mode & 0o777 for f in path.iterdir() if f.is_file()}
    assert modes and all(m == 0o644 for m in modes.values()), modes


def test_ensure_refuses_an_incomplete_directory(tmp_path: Path):
    (tmp_path / TINY_MODEL_DIRNAME).mkdir()
    (tmp_path / TINY_MODEL_DIRNAME / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="incomplete.*model.safetensors.*delete it"):
        ensure_tiny_model(tmp_path)


def test_concurrent_ensure_builds_one_valid_directory(model_dir: Path, tmp_path: Path):
    cache = tmp_path / "cache"
    # Separate processes, as torchrun ranks are, forked from the tests' fork server (a process that has
    # only imported), so that they share nothing with this one.
    with prefork.context().Pool(2) as pool:
        paths = pool.map(ensure_tiny_model, [cache, cache])
    assert paths == [cache / TINY_MODEL_DIRNAME] * 2
    leftovers = [
        p.name for p in cache.iterdir() if p.name != TINY_MODEL_DIRNAME and not p.name.endswith(".lock")
    ]
    assert leftovers == [], "temporary build directories left behind"
    assert all((paths[0] / f).is_file() for f in TINY_MODEL_FILES)
    # Built in another process, yet the same bytes as the in-process build.
    assert file_hashes(paths[0]) == file_hashes(model_dir)


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("SPMDRL_CACHE", str(tmp_path / "env"))
    assert default_cache_dir("") == tmp_path / "env"
    assert default_cache_dir(str(tmp_path / "cfg")) == tmp_path / "cfg"
    monkeypatch.delenv("SPMDRL_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "spmdrl"


def test_the_moe_sibling_shares_the_tokenizer_and_is_reproducible(model_dir: Path, tmp_path: Path):
    """model.path=tiny-moe: a Qwen3-MoE (4 experts, 2 per token, renormalized, untied) in a directory of its
    own, with the Qwen2's tokenizer files byte for byte; built the same every time."""
    moe = ensure_tiny_model(tmp_path, TINY_MOE)
    assert moe == tmp_path / TINY_MOE_DIRNAME != tmp_path / TINY_MODEL_DIRNAME
    cfg = AutoConfig.from_pretrained(moe)
    assert (cfg.model_type, cfg.architectures) == ("qwen3_moe", ["Qwen3MoeForCausalLM"])
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (4, 2, True)
    assert not cfg.tie_word_embeddings and cfg.head_dim == 32 and cfg.moe_intermediate_size % 32 == 0
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (moe / f).read_bytes() == (model_dir / f).read_bytes()
    build_tiny_model(tmp_path / "again", moe=True)
    assert file_hashes(tmp_path / "again") == file_hashes(moe)
    with pytest.raises(ValueError, match="no built-in model 'tiny-mo'; there are tiny, tiny-moe"):
        ensure_tiny_model(tmp_path, "tiny-mo")
