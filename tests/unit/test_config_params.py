"""Components take their config sections, not the whole Config (issue 42): a function of spmdrl/ with a
parameter annotated ``Config`` is one of the entry points, planners and builders listed here, or this test
fails naming it. Read the sections a function needs (``algo: AlgorithmConfig``) or a small typed settings
object built once (spmdrl/rl/settings.py) instead."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "spmdrl"

# What may see the whole config, and why.
ALLOWED = {
    # Loading, validating and checking the config itself (cross-section checks).
    "config.py": {"validate", "_check_across_sections", "_check_async", "_check_reward_model_placement"},
    "config_loader.py": {"_to_config", "_with_warmstart_entry", "to_yaml"},
    "preflight.py": {"check_inputs", "_check_actor_as_critic", "check_data_files", "missing_inputs"},
    # What a recipe's start checks, by the kind of recipe, and its plan (plan_job's input).
    "preflight_start.py": {"check_rl_start", "check_plan"},
    "train.py": {"_run", "run_entry", "_plan_lines"},
    "runtime.py": {"choose_output_dir", "start_run"},
    # Planning and building a job: they read many sections to decide, once, and hand each part its own.
    "rl/plan.py": {
        "plan_job",
        "train_rows",
        "describe_plan",
        "describe",
        "check_val_only",
    },  # a cross-section check
    "rl/job.py": {"build_job"},
    "rl/settings.py": {"update_settings", "reward_settings"},
    "rl/model_rewards.py": {"build_model_rewards"},
    "rl/async_queue.py": {"of"},  # PipelineShape.of: the pipeline a checkpoint's queue belongs to
    "rl/async_rows.py": {"check_async_batch"},
    "supervised/model.py": {"build_trained_model"},
    "supervised/sft.py": {"train_sft"},
    "supervised/warmstart.py": {"warmstart_config"},
    "testing/latency_tail.py": {"check"},
    # The GPU memory model: the token budgets are planning (placement, sizes, budgets), as plan_job is; it
    # reads the models', the trainer's, the engine's and the reward model's settings to size one pass.
    "rl/token_budgets.py": {
        "wants_memory_budgets",
        "memory_inputs",
        "actor_whole_model",
        "frozen_bytes_per_param",
        "actor_bytes",
        "critic_bytes",
        "trained_params",
        "rank_states",
        "state_bytes",
        "reward_model_shape",
        "check_reward_model_pass",
        "measure_token_budgets",
    },
}


def _whole_config_functions() -> set[tuple[str, str]]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if any(a.annotation is not None and ast.unparse(a.annotation) == "Config" for a in args):
                    found.add((path.relative_to(PACKAGE).as_posix(), node.name))
    return found


def test_only_entry_points_planners_and_builders_take_the_whole_config() -> None:
    extra = sorted(
        f"spmdrl/{f}:{name}" for f, name in _whole_config_functions() if name not in ALLOWED.get(f, set())
    )
    assert not extra, (
        f"these take the whole Config: {', '.join(extra)}; give them the sections they read (or a settings "
        "object built once, spmdrl/rl/settings.py), or, for an entry point, add them to ALLOWED with why"
    )


def test_the_allowlist_names_only_functions_that_exist() -> None:
    found = _whole_config_functions()
    stale = sorted(f"spmdrl/{f}:{n}" for f, names in ALLOWED.items() for n in names if (f, n) not in found)
    assert not stale, f"no longer take the whole Config, remove from ALLOWED: {', '.join(stale)}"
