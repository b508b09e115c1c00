"""The two sbatch templates, submitted unchanged to a real one-node Slurm cluster without GPUs.

``slurm_cluster.sh`` starts a munged, slurmctld and slurmd of their own on this machine (Debian's
packages; ``slurm_cluster.sh install`` as root installs them, and CI does). Each template is submitted
as the comments in its header say for a CPU node, ``sbatch --cpus-per-task=2 <template> <overrides>``,
and must: start one rank per allocated CPU (2), finish the run, stop a configuration typo before
torchrun (exit status 2, once, no restart), and append every attempt of a requeued job to the same log,
the second attempt resuming from the first's checkpoint. How the ranks are counted on GPU nodes, which
this cluster does not have, is checked by running the templates outside Slurm with Slurm's variables.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from spmdrl.logging.metrics import read_metrics

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SH = Path(__file__).with_name("slurm_cluster.sh")
SINGLE = REPO / "torchrun_scripts" / "slurm_single_node.sbatch"
MULTI = REPO / "torchrun_scripts" / "slurm_grpo.sbatch"
# Job states after which a job will not run again (a requeued job passes through REQUEUED and PENDING).
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}
JOB_TIMEOUT_S = 600.0

SFT = [
    "recipe=sft_tiny",
    "trainer.total_steps=4",
    "trainer.val_every=0",
    "tiny_task.num_train=128",
    "tiny_task.num_test=16",
    "trainer.global_batch_size=16",
    "trainer.micro_batch_size=8",
    "optim.warmup_steps=1",
]
GRPO = [
    "recipe=grpo_tiny",
    "warmstart.total_steps=8",
    # Enough steps that the requeue lands mid-run: on an idle machine a step takes well under a second.
    "trainer.total_steps=12",
    "trainer.val_every=0",
    "trainer.save_every=1",
    "tiny_task.num_train=256",
    "tiny_task.num_test=32",
    "trainer.global_batch_size=8",
    "rollout.n=4",
    "trainer.micro_batch_size=8",
]


@dataclass(frozen=True)
class Cluster:
    env: dict[str, str]

    def run(self, *cmd: str) -> str:
        return subprocess.run(cmd, env=self.env, check=True, capture_output=True, text=True).stdout

    def submit(self, template: Path, workdir: Path, overrides: list[str]) -> str:
        """As a template's header says for a CPU node: the CPUs on the command line, overrides after."""
        workdir.mkdir(parents=True, exist_ok=True)
        out = self.run(
            "sbatch", "--parsable", f"--chdir={workdir}", "--cpus-per-task=2", str(template), *overrides
        )
        return out.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """scontrol's fields of the job (finished jobs stay listed for slurm.conf's MinJobAge)."""
        line = self.run("scontrol", "show", "job", "-o", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def wait(self, job_id: str, log: Path, timeout_s: float = JOB_TIMEOUT_S) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while (fields := self.job(job_id))["JobState"] not in FINAL_STATES:
            if time.monotonic() > deadline:
                subprocess.run(["scancel", job_id], env=self.env, check=False)
                pytest.fail(f"job {job_id} still {fields['JobState']} after {timeout_s:.0f} s:\n{_tail(log)}")
            time.sleep(2)
        return fields


def _read(log: Path) -> str:
    return log.read_text(errors="replace") if log.exists() else ""


def _tail(log: Path, n: int = 6000) -> str:
    return _read(log)[-n:] or f"(no {log.name} yet)"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if sys.platform != "linux" or shutil.which("bash") is None:
        pytest.skip("the test cluster needs Linux and bash")
    state = tmp_path_factory.mktemp("slurm")
    start = subprocess.run(["bash", str(CLUSTER_SH), "start", str(state)], capture_output=True, text=True)
    # 3: cannot run here (not root, Slurm or munge not installed, a daemon did not start); stderr says which.
    if start.returncode == 3:
        pytest.skip(f"no test Slurm cluster: {start.stderr.strip()}")
    assert start.returncode == 0, start.stdout + start.stderr
    conf = start.stdout.strip().splitlines()[-1].removeprefix("SLURM_CONF=")
    # The job inherits this environment (sbatch's --export=ALL): the templates' `python` and `torchrun`
    # are this interpreter's, as after the `source .venv/bin/activate` their comments suggest.
    env = {
        **os.environ,
        "SLURM_CONF": conf,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}{os.pathsep}/usr/sbin",
        "SPMDRL_CACHE": os.environ.get("SPMDRL_CACHE", str(Path.home() / ".cache" / "spmdrl")),
    }
    for key in ("OMP_NUM_THREADS", "NPROC_PER_NODE", "OUTPUT_DIR", "OUTPUT_ROOT", "CUDA_VISIBLE_DEVICES"):
        env.pop(key, None)  # what the templates derive must come from the allocation
    try:
        yield Cluster(env)
    finally:
        stop = subprocess.run(["bash", str(CLUSTER_SH), "stop", str(state)], capture_output=True, text=True)
        assert stop.returncode == 0, stop.stderr


# What the cluster above cannot show (it has no GPUs): how each template counts its ranks on a GPU node.
# The template runs outside Slurm with the variables Slurm would set, and with stand-ins for the
# commands it launches (python for the config check, torchrun, srun, scontrol) that record their
# arguments; there is no GPU here to run the real ones on.
STUB = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$STUB_CALLS"
if [ "$(basename "$0")" = scontrol ]; then echo node1; fi
if [ "$(basename "$0")" = python ]; then exit "${CHECK_EXIT:-0}"; fi
"""


@pytest.mark.guarantee("slurm:templates")
@pytest.mark.parametrize(
    ("env", "ranks", "threads"),
    [
        ({"SLURM_GPUS_ON_NODE": "4", "SLURM_CPUS_PER_TASK": "64"}, 4, 16),
        ({"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_CPUS_PER_TASK": "16"}, 2, 8),
        ({"SLURM_CPUS_PER_TASK": "3", "SLURM_CPUS_ON_NODE": "32"}, 3, 1),
        ({"SLURM_CPUS_ON_NODE": "2"}, 2, 1),
        ({"NPROC_PER_NODE": "1", "SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_PER_TASK": "8"}, 1, 8),
    ],
    ids=["gpus", "cuda_visible_devices", "cpus_per_task", "cpus_on_node", "override"],
)
@pytest.mark.parametrize("template", [SINGLE, MULTI], ids=["single_node", "multi_node"])
def test_ranks_per_node_follow_the_allocation(
    tmp_path: Path, template: Path, env: dict[str, str], ranks: int, threads: int
) -> None:
    calls = _run_with_stubs(tmp_path, template, env)
    launch = calls[-1]
    assert f"--nproc_per_node={ranks} " in launch, calls
    assert f"OMP_NUM_THREADS={threads}," in (tmp_path / "stdout").read_text()
    if template == MULTI:
        assert launch.startswith("srun ") and "torchrun --nnodes=1 " in launch


@pytest.mark.parametrize("template", [SINGLE, MULTI], ids=["single_node", "multi_node"])
def test_the_config_check_runs_first_with_the_same_arguments(tmp_path: Path, template: Path) -> None:
    calls = [
        c
        for c in _run_with_stubs(tmp_path, template, {"SLURM_CPUS_ON_NODE": "2"})
        if not c.startswith("scontrol")
    ]
    assert len(calls) == 2, calls
    assert (
        calls[0]
        # --world-size: the job's ranks (1 node x 2 CPUs, no GPU), so the RL plan is checked on them too.
        == f"python -m spmdrl.train --check --world-size 2 trainer.output_dir={tmp_path}/outputs/job-7 "
        "recipe=grpo_tiny a.b=1"
    )
    assert calls[-1].endswith(
        f"-m spmdrl.train trainer.output_dir={tmp_path}/outputs/job-7 recipe=grpo_tiny a.b=1"
    )
    # A failed check ends the job with its exit status, and torchrun is never started.
    calls = _run_with_stubs(tmp_path, template, {"SLURM_CPUS_ON_NODE": "2", "CHECK_EXIT": "2"}, expect_rc=2)
    assert [c.split()[0] for c in calls if not c.startswith("scontrol")] == ["python"], calls


def _run_with_stubs(tmp_path: Path, template: Path, env: dict[str, str], expect_rc: int = 0) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("python", "torchrun", "srun", "scontrol"):
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    calls.unlink(missing_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for key in ("OMP_NUM_THREADS", "NPROC_PER_NODE", "OUTPUT_DIR", "OUTPUT_ROOT", "CUDA_VISIBLE_DEVICES"):
        base.pop(key, None)
    slurm = {
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NAME": "job",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": "node1",
    }
    res = subprocess.run(
        ["bash", str(template), "recipe=grpo_tiny", "a.b=1"],
        cwd=tmp_path,
        env={
            **base,
            **slurm,
            **env,
            "PATH": f"{bin_dir}{os.pathsep}{base['PATH']}",
            "STUB_CALLS": str(calls),
        },
        capture_output=True,
        text=True,
    )
    (tmp_path / "stdout").write_text(res.stdout)
    assert res.returncode == expect_rc, res.stdout + res.stderr
    return calls.read_text().splitlines()


@pytest.mark.guarantee("slurm:templates")
def test_single_node_template_runs_on_a_cpu_node(cluster: Cluster, tmp_path: Path) -> None:
    job_id = cluster.submit(SINGLE, tmp_path, SFT)
    log = tmp_path / f"slurm-{job_id}.out"
    fields = cluster.wait(job_id, log)
    text = _read(log)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", text[-6000:]
    out = tmp_path / "outputs" / f"spmdrl-1node-{job_id}"
    # Two ranks because two CPUs were allocated (the node has no GPU), one thread each.
    assert re.search(
        rf"=== spmdrl job {job_id} attempt 1 .*: 2 ranks \(CPUs allocated, no GPU\), OMP_NUM_THREADS=1,", text
    )
    assert "world size 2" in text
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]
    assert (out / "hf_model").is_dir()


@pytest.mark.guarantee("slurm:templates")
@pytest.mark.parametrize("template", [SINGLE, MULTI], ids=["single_node", "multi_node"])
def test_config_typo_fails_once_before_torchrun(cluster: Cluster, tmp_path: Path, template: Path) -> None:
    job_id = cluster.submit(template, tmp_path, ["recipe=sft_tiny", "trainer.totl_steps=3"])
    log = tmp_path / f"slurm-{job_id}.out"
    t0 = time.monotonic()
    fields = cluster.wait(job_id, log, timeout_s=180)
    text = _read(log)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "2:0", (fields, text)
    assert fields["Restarts"] == "0"
    assert text.count("unknown config key 'trainer.totl_steps'") == 1, text
    assert "trainer.total_steps" in text  # the message names the key meant
    # torchrun never started: no agent, no worker, nothing to restart.
    assert "torch.distributed" not in text and "Restarting" not in text, text
    assert time.monotonic() - t0 < 120, "a config typo must fail in seconds, not after restarts"


def test_requeued_multi_node_job_appends_its_log_and_resumes(cluster: Cluster, tmp_path: Path) -> None:
    job_id = cluster.submit(MULTI, tmp_path, GRPO)
    log = tmp_path / f"slurm-{job_id}.out"
    out = tmp_path / "outputs" / f"spmdrl-grpo-{job_id}"
    # Requeue once a first checkpoint is published (its directory appears by one rename, complete). Any
    # step-N: keep_checkpoints=2 may already have removed step-1 by the time this looks.
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not list((out / "checkpoints").glob("step-*")):
        state = cluster.job(job_id)["JobState"]
        assert state not in FINAL_STATES, (
            f"job {job_id} ended ({state}) before its first checkpoint:\n{_tail(log)}"
        )
        assert time.monotonic() < deadline, f"no checkpoint after {JOB_TIMEOUT_S:.0f} s:\n{_tail(log)}"
        time.sleep(0.1)
    first_attempt = _read(log)
    cluster.run("scontrol", "requeue", job_id)

    fields = cluster.wait(job_id, log)
    text = _read(log)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", text[-6000:]
    assert fields["Restarts"] == "1"
    # The first attempt's output is still there, whole, and the second follows it.
    assert text.startswith(first_attempt)
    headers = re.findall(rf"=== spmdrl job {job_id} attempt (\d) on 1 node\(s\) .*: 2 ranks per node", text)
    assert headers == ["1", "2"], text[-6000:]
    second = text[text.index(f"=== spmdrl job {job_id} attempt 2") :]
    assert re.search(r"resumed from \S*step-\d+: step \d+ of 12", second), second[-6000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 13))
