"""verl's config names on spmdrl's command line (spmdrl/verl_keys.py; the table: spmdrl/verl_key_table.py):
verl's published GSM8K GRPO and PPO example command lines pass ``--check`` and ``--cfg job`` shows spmdrl's
values; a verl key or value spmdrl does not support fails with what to do instead; the table cannot name a
spmdrl key that does not exist, and docs/verl_keys.md is what the table generates.

The ``--check`` / ``--cfg job`` runs are processes forked from the tests' fork server
(spmdrl.testing.prefork.run_train); the rest calls the loader in-process."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from spmdrl.config_loader import check_key, load_config, schema_class
from spmdrl.errors import ConfigError
from spmdrl.testing.prefork import run_train
from spmdrl.verl_key_table import DOC_PATH, VERL_KEYS, entry_for
from spmdrl.verl_keys import translate
from spmdrl.verl_keys_doc import doc_markdown

ROOT = Path(__file__).resolve().parents[2]

# verl's published example overrides (the key=value arguments of python3 -m verl.trainer.main_ppo), as data.
# Copied from volcengine/verl's examples/grpo_trainer/run_qwen2-7b.sh (GRPO, GSM8K) and
# examples/ppo_trainer/run_deepseek7b_llm.sh (PPO with a critic, GSM8K) at the commit nearest verl 0.9.1
# that the copy we read holds (the repository's tags there stop before 0.9). The shell's quoting is kept:
# shlex.split reads it as the shell would.
VERL_GRPO_GSM8K = """
    algorithm.adv_estimator=grpo \\
    data.train_files=$HOME/data/gsm8k/train.parquet \\
    data.val_files=$HOME/data/gsm8k/test.parquet \\
    data.train_batch_size=1024 \\
    data.max_prompt_length=512 \\
    data.max_response_length=1024 \\
    data.filter_overlong_prompts=True \\
    data.truncation='error' \\
    actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct \\
    actor_rollout_ref.actor.optim.lr=1e-6 \\
    actor_rollout_ref.model.use_remove_padding=True \\
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \\
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 \\
    actor_rollout_ref.actor.use_kl_loss=True \\
    actor_rollout_ref.actor.kl_loss_coef=0.001 \\
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \\
    actor_rollout_ref.actor.entropy_coeff=0 \\
    actor_rollout_ref.model.enable_gradient_checkpointing=True \\
    actor_rollout_ref.actor.fsdp_config.param_offload=False \\
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \\
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 \\
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \\
    actor_rollout_ref.rollout.name=vllm \\
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \\
    actor_rollout_ref.rollout.n=5 \\
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 \\
    actor_rollout_ref.ref.fsdp_config.param_offload=True \\
    algorithm.use_kl_in_reward=False \\
    trainer.critic_warmup=0 \\
    trainer.logger='["console","wandb"]' \\
    trainer.project_name='verl_grpo_example_gsm8k' \\
    trainer.experiment_name='qwen2_7b_function_rm' \\
    trainer.n_gpus_per_node=8 \\
    trainer.nnodes=1 \\
    trainer.save_freq=20 \\
    trainer.test_freq=5 \\
    trainer.total_epochs=15
"""

VERL_PPO_GSM8K = """
    algorithm.adv_estimator=gae \\
    data.train_files=$HOME/data/gsm8k/train.parquet \\
    data.val_files=$HOME/data/gsm8k/test.parquet \\
    data.train_batch_size=1024 \\
    data.max_prompt_length=512 \\
    data.max_response_length=512 \\
    data.filter_overlong_prompts=True \\
    data.truncation='error' \\
    actor_rollout_ref.model.path=deepseek-ai/deepseek-llm-7b-chat \\
    actor_rollout_ref.actor.optim.lr=1e-6 \\
    actor_rollout_ref.model.use_remove_padding=True \\
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \\
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \\
    actor_rollout_ref.actor.fsdp_config.param_offload=False \\
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \\
    actor_rollout_ref.actor.use_kl_loss=False \\
    actor_rollout_ref.model.enable_gradient_checkpointing=True \\
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \\
    actor_rollout_ref.rollout.tensor_model_parallel_size=4 \\
    actor_rollout_ref.rollout.name=vllm \\
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \\
    critic.optim.lr=1e-5 \\
    critic.model.use_remove_padding=True \\
    critic.model.path=deepseek-ai/deepseek-llm-7b-chat \\
    critic.model.enable_gradient_checkpointing=True \\
    critic.ppo_micro_batch_size_per_gpu=32 \\
    critic.model.fsdp_config.param_offload=False \\
    critic.model.fsdp_config.optimizer_offload=False \\
    algorithm.use_kl_in_reward=False \\
    trainer.critic_warmup=0 \\
    trainer.logger='["console","wandb"]' \\
    trainer.project_name='verl_example_gsm8k' \\
    trainer.experiment_name='deepseek_llm_7b_function_rm' \\
    trainer.n_gpus_per_node=8 \\
    trainer.nnodes=1 \\
    trainer.save_freq=20 \\
    trainer.test_freq=1 \\
    trainer.use_legacy_worker_impl=auto \\
    trainer.total_epochs=15
"""

# The data and model the examples name (GSM8K files, 7B models) -> the built-in tiny ones, under verl's keys.
_LOCAL = {
    "data.train_files": "tiny:train",
    "data.val_files": "tiny:test",
    "actor_rollout_ref.model.path": "tiny",
    "critic.model.path": "tiny",
}


def _overrides(script: str) -> list[str]:
    args = [a for a in shlex.split(script.replace("\\\n", " ")) if "=" in a]
    return [
        f"{a.split('=', 1)[0]}={_LOCAL[a.split('=', 1)[0]]}" if a.split("=", 1)[0] in _LOCAL else a
        for a in args
    ]


def _job(recipe: str, script: str) -> tuple[dict, str]:
    res = run_train([f"recipe={recipe}", *_overrides(script), "--cfg", "job"])
    assert res.returncode == 0, res.stderr
    return yaml.safe_load(res.stdout), res.stderr


def test_the_grpo_example_passes_check_and_logs_the_mapping_once() -> None:
    res = run_train(["recipe=grpo_tiny", *_overrides(VERL_GRPO_GSM8K), "--check"])
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("spmdrl: config ok: recipe grpo_tiny"), res.stdout
    logs = [line for line in res.stderr.splitlines() if line.startswith("spmdrl: verl keys: ")]
    assert len(logs) == 1, res.stderr
    for pair in (
        "actor_rollout_ref.actor.optim.lr -> optim.lr",
        "data.train_batch_size -> trainer.global_batch_size",
        "trainer.test_freq -> trainer.val_every",
        "trainer.logger -> logging.backends",
        "actor_rollout_ref.rollout.name=vllm (accepted)",
        "trainer.nnodes=1 (accepted)",
    ):
        assert pair in logs[0], logs[0]


def test_the_grpo_example_sets_spmdrls_keys() -> None:
    cfg, _ = _job("grpo_tiny", VERL_GRPO_GSM8K)
    assert cfg["model"]["path"] == "tiny" and cfg["data"]["train_files"] == ["tiny:train"]
    assert cfg["algorithm"]["adv_estimator"] == "grpo"
    assert cfg["trainer"]["global_batch_size"] == 1024
    assert (cfg["data"]["max_prompt_length"], cfg["data"]["max_response_length"]) == (512, 1024)
    assert cfg["data"]["overlong"] == "filter"
    assert cfg["optim"]["lr"] == 1e-6
    assert cfg["trainer"]["pack_sequences"] is True
    assert cfg["algorithm"]["ppo_mini_batch_size"] == 256
    assert cfg["trainer"]["micro_batch_size"] == 40
    assert cfg["algorithm"]["use_kl_loss"] is True and cfg["algorithm"]["kl_loss_coef"] == 0.001
    assert cfg["algorithm"]["kl_loss_type"] == "low_var_kl" and cfg["algorithm"]["entropy_coeff"] == 0
    assert cfg["model"]["activation_checkpointing"] == "full"
    assert (
        cfg["model"]["offload_params"],
        cfg["model"]["offload_optimizer"],
        cfg["model"]["offload_ref"],
    ) == (
        False,
        False,
        True,
    )
    assert cfg["rollout"]["tp"] == 2 and cfg["rollout"]["n"] == 5
    assert cfg["rollout"]["gpu_memory_utilization"] == 0.6
    assert cfg["algorithm"]["use_kl_in_reward"] is False
    assert cfg["logging"]["backends"] == ["console", "wandb"]
    assert cfg["logging"]["project"] == "verl_grpo_example_gsm8k"
    assert cfg["logging"]["experiment"] == "qwen2_7b_function_rm"
    assert (cfg["trainer"]["save_every"], cfg["trainer"]["val_every"], cfg["trainer"]["total_epochs"]) == (
        20,
        5,
        15,
    )


def test_the_ppo_example_passes_check_and_sets_the_critic() -> None:
    res = run_train(["recipe=ppo_tiny", *_overrides(VERL_PPO_GSM8K), "--check"])
    assert res.returncode == 0, res.stderr
    cfg, err = _job("ppo_tiny", VERL_PPO_GSM8K)
    assert "critic.model.path -> critic.model_path" in err
    assert cfg["algorithm"]["adv_estimator"] == "gae"
    assert cfg["critic"]["optim"]["lr"] == 1e-5 and cfg["critic"]["model_path"] == "tiny"
    assert cfg["critic"]["warmup_steps"] == 0
    assert cfg["trainer"]["micro_batch_size"] == 16 and cfg["rollout"]["tp"] == 4
    assert cfg["algorithm"]["use_kl_loss"] is False and cfg["trainer"]["val_every"] == 1


def test_an_unsupported_verl_value_exits_2_with_what_to_do() -> None:
    res = run_train(["recipe=grpo_tiny", "actor_rollout_ref.rollout.name=sglang", "--check"])
    assert res.returncode == 2
    assert (
        "spmdrl: config error: verl's actor_rollout_ref.rollout.name=sglang differs from what spmdrl does"
        in (res.stderr)
    )
    assert "accepted when vllm" in res.stderr


@pytest.mark.parametrize(
    ("override", "message"),
    [
        # verl's quickstart (docs/start/quickstart.rst) skips the step-0 validation; spmdrl cannot.
        ("trainer.val_before_train=False", "trainer.val_every=0 turns validation off"),
        ("actor_rollout_ref.actor.fsdp_config.fsdp_size=4", "model.fsdp_unit"),  # a prefix entry
        ("actor_rollout_ref.rollout.val_kwargs.n=4", "one response per prompt"),
        ("trainer.logger=[console,swanlab]", "no swanlab backend"),
        ("data.truncation=left", "never truncates a prompt"),
        ("actor_rollout_ref.actor.no_such_key=1", "is a verl key spmdrl has no equivalent for"),
        ("custom_reward_function.name=my_score", "give reward.fn="),
        # verl 0.9.1 reads clip_ratio only where the bounds are null (their defaults are 0.2).
        ("actor_rollout_ref.actor.clip_ratio=0.3", "set the bounds instead (algorithm.clip_ratio_low"),
        ("trainer.max_actor_ckpt_to_keep=null", "at least 1"),
        ("algorithm.pf_ppo.weight_pow=2", "has no spmdrl equivalent: spmdrl has no PF-PPO"),
        # A key of a section both have, which the table does not name: maybe verl's.
        ("data.image_key=images", "If it is a verl key, spmdrl has no equivalent for it"),
    ],
)
def test_refused_verl_keys_say_what_to_do(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(["recipe=grpo_tiny", override], import_entry_module=False)


def test_the_world_size_keys_are_checked_against_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    ovs = ["trainer.n_gpus_per_node=8", "trainer.nnodes=1"]
    assert translate(ovs, lambda key: False)[0] == []  # no torchrun (--check): accepted, nothing to set
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("WORLD_SIZE", "16")
    with pytest.raises(ConfigError, match="torchrun --nnodes=<nodes> --nproc_per_node"):
        translate(ovs, lambda key: False)  # two nodes of 8 started, nnodes=1 given
    assert translate(["trainer.n_gpus_per_node=8", "trainer.nnodes=2"], lambda key: False)[0] == []


def test_plus_forms_and_conflicting_verl_keys() -> None:
    out, _ = translate(
        [
            "+actor_rollout_ref.actor.optim.lr=3e-5",
            "++data.max_prompt_length=60",
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "actor_rollout_ref.actor.clip_ratio=0.2",  # verl's default of the bounds: accepted
            "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
            "actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
            "custom_reward_function.path=my_rewards.py",
            "data.train_files=tiny:train",
            "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",  # verl 0.9.1's DAPO form
            "+reward.reward_kwargs.max_resp_len=24",
            "data.max_response_length=24",
        ],
        lambda key: key in ("data.max_prompt_length", "data.train_files", "data.max_response_length"),
    )
    assert out == [
        "optim.lr=3e-05",
        "data.max_prompt_length=60",
        "algorithm.clip_ratio_high=0.28",
        "rollout.val_temperature=0.6",
        "rollout.val_temperature=0.6",
        "reward.fn=my_rewards.py:compute_score",
        "data.train_files=[tiny:train]",
        "reward.overlong_buffer.enable=true",
        "data.max_response_length=24",
    ]
    loaded = load_config(["recipe=grpo_tiny", *out[:4]], import_entry_module=False)
    assert loaded.optim.lr == 3e-5 and loaded.data.max_prompt_length == 60
    assert loaded.algorithm.clip_ratio_high == 0.28 and loaded.rollout.val_temperature == 0.6
    with pytest.raises(ConfigError, match="both set optim.grad_clip here, to different values"):
        translate(
            ["actor_rollout_ref.actor.grad_clip=1.0", "actor_rollout_ref.actor.optim.clip_grad=0.5"],
            lambda key: False,
        )


def test_every_spmdrl_key_of_the_table_exists() -> None:
    schema = schema_class()
    for entry in VERL_KEYS:
        if entry.spmdrl is not None:
            check_key(entry.spmdrl, schema)
        else:
            assert entry.note, f"{entry.verl}: a key spmdrl does not map says why, or what to do instead"
        assert entry_for(entry.verl.removesuffix(".*") + (".x" if entry.is_prefix else "")) is entry
    names = [e.verl for e in VERL_KEYS]
    assert len(names) == len(set(names)), "a verl key is in the table twice"


def test_the_doc_is_what_the_table_generates() -> None:
    committed = (ROOT / DOC_PATH).read_text()
    assert committed == doc_markdown(), (
        f"{DOC_PATH} is stale: regenerate it with python -m spmdrl.verl_keys_doc"
    )


def test_the_no_grad_budgets_of_rollout_and_ref_are_one_setting() -> None:
    same = [f"actor_rollout_ref.{role}.log_prob_max_token_len_per_gpu=24000" for role in ("rollout", "ref")]
    assert translate(same, lambda key: False)[0] == ["trainer.log_prob_max_token_len_per_gpu=24000"] * 2
    with pytest.raises(ConfigError, match="both set trainer.log_prob_max_token_len_per_gpu"):
        translate([same[0], "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=8000"], lambda key: False)
