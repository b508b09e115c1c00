"""No host-device sync inside the micro-batch loops: the actor update, the critic update, the no-grad passes.

On a GPU every read of a device value on the host (``float(loss)``, ``int(mask.sum())``, ``nonzero``) and
every blocking copy of a host tensor to the device stops the CPU until the GPU has done all it was
given, so a loop with one per micro-batch never lets the CPU queue work ahead. A CPU cannot time that,
but spmdrl.testing.syncs.SyncCounter counts those points (its docstring says what it sees and what
not). Here one gloo rank runs the recipe's update_policy, update_critic, logprobs_of and values_of on the
tiny Qwen2 (FSDP2, the real build path) with 2 and with 4 micro-batches per mini-batch, padded and
packed. What is asserted:

- the count does not grow with the number of micro-batches: nothing inside the loops syncs;
- the count is the fixed one per pass the code has on purpose, each by its place: the rows' sizes read
  once (RowLengths.of), the mini-batches' unit counts all-reduced once (a host -> device copy and a
  read), each optimizer step's gradient norm (read for the non-finite check), and the metrics read once.

Before this change the same run counted 35 syncs in the padded update_policy with 2 micro-batches and
63 with 4 (14 per micro-batch), 14 and 28 in logprobs_of; packed, 54 and 87, 33 and 52. Now 5 and 1.
Micro-batches with no padding at all (rows of one length) counted one more per forward, transformers
looking for packed sequences in the position ids, until the RL models attended with causal SDPA
(spmdrl.models.causal_attention); now the same 5 and 1.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from spmdrl.testing.models import padded_rows, save_small_qwen2
from spmdrl.testing.spawn import run_side_by_side

pytestmark = pytest.mark.slow

ROWS = 8  # one mini-batch of 4 prompts x 2 samples on the one rank
MICRO = {2: 4, 4: 2}  # micro-batches per mini-batch -> rows per micro-batch

# Per pass, where each sync the code keeps on purpose is (the file:function of SyncCounter's places).
NO_GRAD = Counter({("tolist", "rl/batch.py", "of"): 1})  # RowLengths.of: the rows' sizes, once
UPDATE = Counter(
    {
        ("tolist", "rl/batch.py", "of"): 1,
        ("h2d", "distributed/reduce.py", "_all_reduce"): 1,  # the unit counts of every mini-batch
        ("tolist", "distributed/reduce.py", "_all_reduce"): 1,
        ("item", "spmdrl/optim.py", "clip_grad_norm"): 1,  # once per optimizer step (one here)
        ("tolist", "distributed/reduce.py", "all_reduce_sum_tensors"): 1,  # the metrics, once
    }
)


def _places(counter: Any) -> Counter:
    """(kind, file, function) of each counted sync."""
    out: Counter = Counter()
    for e in counter.events:
        where, _, fn = e.where.partition(" in ")
        out[(e.kind, where.rsplit(":", 1)[0], fn)] += 1
    return out


def _worker(rank: int, world: int, model_dir: str, micro: int, layout: str) -> dict[str, Any]:
    from spmdrl.config import (
        AlgorithmConfig,
        Config,
        CriticConfig,
        DataConfig,
        OptimConfig,
        RolloutConfig,
        TrainerConfig,
        derive,
        derive_rl,
    )
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.models.causal_attention import use_causal_sdpa
    from spmdrl.optim import build_lr_scheduler, build_optimizer
    from spmdrl.rl.batch import PolicyBatch
    from spmdrl.rl.micro_batches import micro_batch_rows
    from spmdrl.rl.models import Critic
    from spmdrl.rl.settings import update_settings
    from spmdrl.rl.update import logprobs_of, update_critic, update_policy, values_of
    from spmdrl.testing.syncs import SyncCounter

    pack = layout == "packed"
    cfg = Config(
        data=DataConfig(max_prompt_length=8, max_response_length=8),
        trainer=TrainerConfig(global_batch_size=ROWS // 2, micro_batch_size=micro, pack_sequences=pack),
        rollout=RolloutConfig(n=2),
        algorithm=AlgorithmConfig(ppo_mini_batch_size=ROWS // 2, use_kl_loss=True, kl_loss_coef=0.01),
        optim=OptimConfig(lr=1e-3),
        critic=CriticConfig(),
    )
    rl = derive_rl(cfg, derive(cfg, world, 100, samples_per_item=2))
    mesh = Placement.colocated(world).build_meshes("cpu").fsdp("actor")
    cpu, f32 = torch.device("cpu"), torch.float32
    actor = build_fsdp_model(ModelSpec(Path(model_dir), f32, f32), mesh, cpu)
    critic_model = build_fsdp_model(ModelSpec(Path(model_dir), f32, f32, head="value"), mesh, cpu)
    # As spmdrl.rl.models builds them: transformers' SDPA mask building reads the position ids of an
    # unpadded micro-batch (find_packed_sequence_indices), once per forward.
    assert use_causal_sdpa(actor) and use_causal_sdpa(critic_model)
    optimizer = build_optimizer(actor, cfg.optim)
    critic_opt = build_optimizer(critic_model, cfg.critic.optim)
    critic = Critic(critic_model, critic_opt, build_lr_scheduler(critic_opt, cfg.critic.optim, 10))

    g = torch.Generator().manual_seed(0)
    prompt_B, resp_B = torch.randint(2, 6, (ROWS,), generator=g), torch.randint(1, 8, (ROWS,), generator=g)
    if layout == "unpadded":  # every row as long: micro-batches with no padding at all
        prompt_B, resp_B = torch.full((ROWS,), 4), torch.full((ROWS,), 6)
    ids, attn, resp = padded_rows(prompt_B, resp_B, 64, g)
    B, T = ids.shape
    noise = 0.1 * torch.randn(B, T, generator=g) * resp
    batch = PolicyBatch(
        ids, attn, resp, -torch.rand(B, T, generator=g) * resp, torch.randn(B, T, generator=g) * resp
    )
    batch = batch.replace(
        ref_logprobs_BT=batch.engine_logprobs_BT + noise, values_BT=noise, returns_BT=noise + 1
    )
    parts = micro_batch_rows(attn.sum(1), micro_batch_size=micro)
    assert len(parts) == ROWS // micro

    # A first update creates AdamW's state, whose step counters live on the host (capturable=False):
    # the counter is told so, as it is told that the row indices are host tensors.
    update_policy(update_settings(cfg), rl, actor, optimizer, batch)
    update_critic(update_settings(cfg), cfg.critic, rl, critic, batch)
    host = [s["step"] for opt in (optimizer, critic_opt) for s in opt.state.values()]

    counts = {}
    passes = {
        "logprobs_of": lambda: logprobs_of(actor, batch, parts, 1.0, pack),
        "values_of": lambda: values_of(critic.model, batch, parts, pack),
        "update_policy": lambda: update_policy(update_settings(cfg), rl, actor, optimizer, batch),
        "update_critic": lambda: update_critic(update_settings(cfg), cfg.critic, rl, critic, batch),
    }
    for name, run in passes.items():
        with SyncCounter() as c:
            c.mark_host(*parts, *host)
            run()
        counts[name] = (_places(c), c.summary())
    return counts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("syncs") / "m"
    save_small_qwen2(path)
    return path


@pytest.mark.parametrize("layout", ["padded", "packed", "unpadded"])
def test_no_sync_inside_the_micro_batch_loops(model_dir: Path, layout: str) -> None:
    sides = run_side_by_side(_worker, 1, [(str(model_dir), MICRO[n], layout) for n in MICRO])
    runs = {n: run for n, (run,) in zip(MICRO, sides, strict=True)}
    for name, expected in [
        ("logprobs_of", NO_GRAD),
        ("values_of", NO_GRAD),
        ("update_policy", UPDATE),
        ("update_critic", UPDATE),
    ]:
        (two, two_text), (four, four_text) = runs[2][name], runs[4][name]
        assert two == four, (
            f"{name}: syncs grow with the micro-batches (2 micro-batches, then 4):\n{two_text}\n--\n{four_text}"
        )
        assert four == expected, f"{name}: syncs other than the fixed ones per pass:\n{four_text}"
