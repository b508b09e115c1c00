"""The start of every GPU job with automatic token budgets (spmdrl.rl.token_budgets.measure_token_budgets),
run end to end on 2 gloo processes: the models' configs read from disk (the actor's and a reward model's,
Qwen2.5-0.5B's shape),
the free memory agreed over the ranks (the least), the engine's share, the state, the budgets, and
derive_rl taking them.

The one stand-in: CUDA's memory query (``torch.cuda.mem_get_info``), which cannot run on a CPU. Each rank
reports an 80 GiB card's figures instead, rank 1 with less free than rank 0, through the function's
``mem_get_info`` argument; everything else is the real code on real files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from spmdrl.testing.models import QWEN2_5_0_5B
from spmdrl.testing.spawn import run_distributed

pytestmark = pytest.mark.slow

GIB = 2**30
TOTAL = 80 * GIB
FREE = {0: 70 * GIB, 1: 60 * GIB}


def _worker(rank: int, world: int, actor_dir: str, rm_dir: str) -> dict[str, Any]:
    from spmdrl.config import derive, derive_rl
    from spmdrl.config_loader import load_config
    from spmdrl.distributed.placement import Placement
    from spmdrl.rl.token_budgets import measure_token_budgets

    def card(free: int) -> Any:
        return lambda device: (free, TOTAL)

    base = ["recipe=grpo_gsm8k", "trainer.global_batch_size=16", "algorithm.ppo_mini_batch_size=16"]
    placement = Placement.colocated(world)
    out: dict[str, Any] = {}
    for name, extra in {
        "default": [],
        "awake_engine": ["rollout.free_cache_engine=false"],
        "reward_model": ["reward_model.enable=true", f"reward_model.path={rm_dir}"],
        "lora": ["model.lora.rank=16", "algorithm.use_kl_loss=true"],
    }.items():
        cfg = load_config([*base, *extra])
        b = measure_token_budgets(
            cfg,
            Path(actor_dir),
            torch.device("cpu"),
            placement,
            needs_critic=False,
            mem_get_info=card(FREE[rank]),
        )
        out[name] = b
        if name == "default":
            rank1 = measure_token_budgets(
                cfg,
                Path(actor_dir),
                torch.device("cpu"),
                placement,
                needs_critic=False,
                mem_get_info=card(FREE[1]),
            )
            out["rank1_alone"] = rank1  # both ranks report rank 1's card: the same least
            rl = derive_rl(
                cfg,
                derive(cfg, world, 64, samples_per_item=cfg.rollout.n),
                memory_budgets=(b.train, b.no_grad),
            )
            out["rl"] = (rl.ppo_max_token_len, rl.log_prob_max_token_len)
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Config files of Qwen2.5-0.5B's shape: the actor's, and a reward model's (the function reads configs
    and no weights; the reward model's path check wants a safetensors file, so an empty one is there)."""
    from transformers import Qwen2Config

    root = tmp_path_factory.mktemp("budgets")
    shape = QWEN2_5_0_5B
    Qwen2Config(**shape, architectures=["Qwen2ForCausalLM"]).save_pretrained(root / "actor")
    Qwen2Config(**shape, architectures=["Qwen2ForSequenceClassification"], num_labels=1).save_pretrained(
        root / "rm"
    )
    (root / "rm" / "model.safetensors").touch()
    return root / "actor", root / "rm"


def test_budgets_from_the_least_free_card_on_every_rank(dirs: tuple[Path, Path]) -> None:
    actor, rm = dirs
    results = run_distributed(_worker, 2, str(actor), str(rm), timeout_s=240)
    r0, r1 = results
    for name in ("default", "awake_engine", "reward_model", "lora", "rl"):
        assert r0[name] == r1[name], f"{name}: the ranks planned differently"
    default = r0["default"]
    # The least free memory over the ranks (rank 1's 60 GiB), whatever this rank's own card says.
    assert default == r0["rank1_alone"]
    assert default.train > 0 and default.no_grad >= default.train
    assert r0["rl"] == (default.train, default.no_grad)
    # An engine that stays awake keeps its share of the card: smaller budgets.
    assert r0["awake_engine"].available_gib < default.available_gib
    assert r0["awake_engine"].no_grad < default.no_grad
    # The reward model's shards are state on these ranks; LoRA's adapters cost less than full training.
    assert r0["reward_model"].state_gib > default.state_gib
    assert r0["lora"].state_gib < default.state_gib
