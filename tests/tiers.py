"""The suite's tiers, as data: what the default run guarantees a user, and which tests hold it.

The default run (``torchrun_scripts/test.sh``, and so CI) is the whole unit tier plus the integration
tests marked ``@pytest.mark.guarantee(KEY)``: each holds one of the guarantees below, cheaply, with its key
property asserted. Every other integration test (the deeper variants, the benchmarks' smoke tests, the
long end-to-end runs) runs under ``--all``. docs/testing.md's map lists each key with the test that holds
it; ``tests/unit/test_tiers.py`` checks that the map, this table and the marks agree.

Adding a feature: its unit tests join the default run; an end-to-end test of it joins only if it holds a
guarantee here (or a new one, named here and in the map) and costs at most ~30 s; the rest go to ``--all``.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

GUARANTEES: dict[str, str] = {
    "recipe:grpo_tiny": "recipe=grpo_tiny end to end: warm-start, rollout, update, checked sync, export",
    "recipe:sft_tiny": "recipe=sft_tiny end to end on 2 ranks: the loss falls, the export loads",
    "recipe:dapo_tiny": "recipe=dapo_tiny: dynamic sampling drops and refills groups, overlong shaping",
    "recipe:ppo_tiny": "recipe=ppo_tiny: the critic trains, GAE reaches the policy loss",
    "recipe:grpo_lora_tiny": "recipe=grpo_lora_tiny: merged weights synced, adapters saved, exact resume",
    "recipe:grpo_async_tiny": "recipe=grpo_async_tiny: k=0 is the synchronous run bitwise, k=1 one behind",
    "recipe:grpo_tools_tiny": "grpo_tools_tiny's task and tools: multi-turn rollouts call the tools",
    "recipe:rm_tiny": "recipe=rm_tiny learns and exports; grpo_rm_tiny trains on its score",
    "recipe:opd_tiny": "recipe=opd_tiny: the teacher scores every sampled token, the student's reverse KL to it falls",
    "sync:gemm_paths": "the per-step weight-sync check on every GEMM path this CPU can run",
    "sync:parity": "an fp32 engine matches the fp32 trainer to 1e-6 through updates and syncs",
    "sync:quantized": "at a quantized engine's tolerance the sync check still catches a wrong or missing tensor",
    "model:moe": "a mixture of experts (tiny-moe) is served as trained; the sync check covers every expert",
    "moe:ep": "expert parallelism (parallel.ep=2) trains a mixture of experts as FSDP2 alone does",
    "model:moe-router-replay": "router replay: the engine's routing of every position reaches the trainer in place, and the trainer replays it",
    "moe:router-replay-effect": "with a bf16 engine, replaying its routing narrows the trainer/engine logprob gap",
    "model:vlm": "a vision-language model (tiny-vl) is served with images as trained; the sync check covers its vision tower",
    "resume:kill": "a killed worker restarts and the run resumes exactly, bit for bit",
    "golden:update": "five GRPO update steps match the golden file",
    "fork:recipe": "a forked recipe in another directory runs with its own loss and section",
    "errors:config": "config and data errors: named once, exit 2, before any work",
    "errors:rank_failure": "one rank's exception ends the whole job promptly, the cause printed",
    "eval:val_only": "trainer.val_only validates the checkpoint's weights once, trains and saves nothing",
    "checkpoint:atomic": "a save that fails (a full disk) loses nothing: the last checkpoint stays whole and loads",
    "engine:tp": "the in-process vLLM engine at tp=1 and tp=2 generates and serves synced weights",
    "fsdp:numerics": "FSDP2 on two ranks trains as one process does",
    "slurm:templates": "the sbatch templates run unchanged on a Slurm cluster (where Slurm is installed)",
    "verl:parity": "spmdrl's algorithm functions equal verl 0.9.1's own on random inputs (unit tier)",
}


def in_default_tier(
    path: Path, integration: Path, guarantees: Collection[str], named: Collection[Path]
) -> bool:
    """Whether a test of file ``path`` runs in the default tier: every test outside ``integration`` (the
    unit tier), an integration test that holds a guarantee, and any test of a file named on the command
    line (``pytest tests/integration/test_lora.py`` runs what it says)."""
    return integration not in path.parents or bool(guarantees) or path in named
