"""algorithm.recompute_old_logprobs=auto skips the old-logprob pass only where it is exact.

With one PPO epoch and one mini-batch, the update's forward runs before any optimizer step, so its
logprobs, detached, are the old policy's: auto skips the no-grad pass (spmdrl.rl.experience.
needs_old_logprobs) and the update takes them from its own forward. This checks, on 1 process and on 2
gloo ranks (FSDP2), that the update is then bitwise the one with the pass run (always, verl's
behaviour): the same losses and metrics, the same gradients at the optimizer step, the same weights
after it, and the same old logprobs handed to the mismatch metrics (UpdateResult.old_logprobs_BT).
Padded micro-batches with the default loss, and packed token-budget micro-batches with kl_cov (which
picks tokens by the old logprobs). And that the skipped pass is the actor's forward: with a
reference (use_kl_loss) old_and_ref_logprobs runs half the forwards it runs with always; without one,
none.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmdrl.testing.models import padded_rows, save_small_qwen2
from spmdrl.testing.spawn import run_distributed

pytestmark = pytest.mark.slow

VOCAB, N, PROMPTS = 64, 2, 4  # save_small_qwen2's vocabulary; rollout.n; prompts: 8 rows
CASES = {"padded": ("vanilla", False), "packed": ("kl_cov", True)}


def _config(world: int, loss: str, pack: bool, recompute: str, kl: bool = True):  # noqa: ANN202
    from spmdrl.config import AlgorithmConfig, Config, DataConfig, OptimConfig, RolloutConfig, TrainerConfig

    return Config(
        data=DataConfig(max_prompt_length=8, max_response_length=8),
        # Several micro-batches per rank: the update's forward is split as the no-grad pass is.
        trainer=TrainerConfig(
            global_batch_size=PROMPTS,
            micro_batch_size=2,
            micro_batch_tokens=16 if pack else 0,
            pack_sequences=pack,
        ),
        rollout=RolloutConfig(n=N),
        optim=OptimConfig(grad_clip=0.0),
        algorithm=AlgorithmConfig(
            policy_loss=loss,
            kl_cov_ratio=0.2,
            use_kl_loss=kl,
            kl_loss_coef=0.1,
            recompute_old_logprobs=recompute,
        ),
    )


def _worker(rank: int, world: int, model_dir: str, ref_dir: str) -> dict:
    from spmdrl.config import derive, derive_rl
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.rl.batch import PolicyBatch
    from spmdrl.rl.experience import needs_old_logprobs, old_and_ref_logprobs
    from spmdrl.rl.reference import Reference
    from spmdrl.rl.settings import update_settings
    from spmdrl.rl.update import update_policy

    cpu, f32 = torch.device("cpu"), torch.float32
    meshes = Placement.colocated(world).build_meshes("cpu")
    g = torch.Generator().manual_seed(0)
    B = PROMPTS * N
    ids, attn, resp = padded_rows(
        torch.randint(2, 6, (B,), generator=g), torch.randint(1, 9, (B,), generator=g), VOCAB, g
    )
    engine_lp = -torch.rand(ids.shape, generator=g) * resp
    adv = torch.randn(ids.shape, generator=g) * resp
    rows = slice(rank * B // world, (rank + 1) * B // world)
    data = PolicyBatch(ids[rows], attn[rows], resp[rows], engine_lp[rows], adv[rows])

    def forwards(model: torch.nn.Module) -> list[int]:
        calls = [0]
        model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        return calls

    out: dict = {}
    for case, (loss, pack) in CASES.items():
        for recompute in ("auto", "always"):
            cfg = _config(world, loss, pack, recompute)
            rl = derive_rl(cfg, derive(cfg, world, 100, samples_per_item=N))
            actor = build_fsdp_model(ModelSpec(Path(model_dir), f32, f32), meshes.fsdp("actor"), cpu)
            optimizer = torch.optim.SGD(actor.parameters(), lr=0.1)
            ref = build_fsdp_model(ModelSpec(Path(ref_dir), f32, f32, train=False), meshes.fsdp("ref"), cpu)
            actor_calls, ref_calls = forwards(actor), forwards(ref)
            recompute_old = needs_old_logprobs(cfg.algorithm, rl)
            reference = Reference(ref)
            batch = old_and_ref_logprobs(
                update_settings(cfg), rl, actor, reference, data, None, recompute_old=recompute_old
            )
            passes = actor_calls[0] + ref_calls[0]
            grads: list[torch.Tensor] = []
            params = optimizer.param_groups[0]["params"]  # the sharded ones (the root is unsharded now)
            optimizer.register_step_pre_hook(
                lambda *_, grads=grads, params=params: grads.extend(
                    p.grad.full_tensor().clone() for p in params
                )
            )
            result = update_policy(update_settings(cfg), rl, actor, optimizer, batch)
            weights = [p.full_tensor().clone() for p in params]
            out[(case, recompute)] = dict(
                recompute_old=recompute_old,
                forwards_before_update=passes,
                metrics=result.metrics,
                grads=grads,
                weights=weights,
                old_logprobs=result.old_logprobs_BT,
            )
            del actor, ref, optimizer
    # Without a reference: auto runs no pass at all, always the old logprobs' alone.
    for recompute in ("auto", "always"):
        cfg = _config(world, "vanilla", False, recompute, kl=False)
        rl = derive_rl(cfg, derive(cfg, world, 100, samples_per_item=N))
        actor = build_fsdp_model(ModelSpec(Path(model_dir), f32, f32), meshes.fsdp("actor"), cpu)
        calls = forwards(actor)
        old_and_ref_logprobs(
            update_settings(cfg),
            rl,
            actor,
            None,
            data,
            None,
            recompute_old=needs_old_logprobs(cfg.algorithm, rl),
        )
        out[("no_ref", recompute)] = calls[0]
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("old_logprobs")
    save_small_qwen2(tmp / "actor")
    save_small_qwen2(tmp / "ref", seed=1)
    return tmp


@pytest.mark.parametrize("world", [1, 2])
def test_skipping_the_pass_gives_the_same_update_bitwise(models: Path, world: int) -> None:
    out = run_distributed(_worker, world, str(models / "actor"), str(models / "ref"), timeout_s=600)
    for rank_out in out[1:]:
        assert rank_out is not None
    res = out[0]
    # 2 micro-batches per rank on 2 ranks: the forwards are micro-batches, so count per pass.
    micro = PROMPTS * N // world // 2
    for case in CASES:
        auto, always = res[(case, "auto")], res[(case, "always")]
        assert not auto["recompute_old"] and always["recompute_old"]
        # The skipped pass is the actor's: half the no-grad forwards (the reference's remain).
        if case == "padded":
            assert always["forwards_before_update"] == 2 * auto["forwards_before_update"] == 2 * micro
        assert auto["metrics"] == always["metrics"], case
        assert auto["metrics"]["actor/pg_loss"] != 0 and auto["metrics"]["actor/kl_loss"] != 0
        assert len(auto["grads"]) == len(always["grads"]) > 0
        for a, b in zip(auto["grads"], always["grads"], strict=True):
            assert torch.equal(a, b), case
            assert a.abs().max() > 0
        for a, b in zip(auto["weights"], always["weights"], strict=True):
            assert torch.equal(a, b), case
        assert torch.equal(auto["old_logprobs"], always["old_logprobs"]), case
        assert auto["old_logprobs"].abs().sum() > 0
    assert res[("no_ref", "auto")] == 0 and res[("no_ref", "always")] == micro
