"""Reward functions that misbehave (hang, exit, kill their group, allocate, write), in a file the sandbox's
workers import, for the reward sandbox's unit and integration tests; the ``rewards`` fixture
(tests/conftest.py) writes it and leaves no worker behind."""

from __future__ import annotations

from pathlib import Path

from spmdrl.rewards.registry import RewardFn, RewardInput, load_reward_fn

REWARDS = """
import math
import os
import signal
import subprocess
import time


def sleeps(response, ground_truth, *, data_source, extra_info):
    time.sleep(1000)


def values(response, ground_truth, *, data_source, extra_info):
    if response == "ok":  # the worker's pid: a sample after a bad value shows whether it was restarted
        return {"score": 1.0, "pid": float(os.getpid())}
    return {
        "big_int": 10**400,  # too large for a float
        "float32_overflow": 1e39,  # finite as a Python float, inf as float32
        "dict_float32_overflow": {"score": -1e39},
        "nan": math.nan,
        "inf": -math.inf,
    }[response]


def exits(response, ground_truth, *, data_source, extra_info):
    if response == "exit":
        os._exit(3)
    return 1.0


def kills_its_group(response, ground_truth, *, data_source, extra_info):
    if response == "killpg":
        os.killpg(os.getpgrp(), signal.SIGKILL)
    return 1.0


def starts_a_child_and_hangs(response, ground_truth, *, data_source, extra_info):
    child = subprocess.Popen(["sleep", "1000"])
    with open(extra_info["pid_file"], "w") as f:
        f.write(str(child.pid))
    time.sleep(1000)


def allocates(response, ground_truth, *, data_source, extra_info):
    if response == "alloc":
        return float(len(bytes(8 << 30)))  # 8 GiB (calloc: not touched, so cheap when it is allowed)
    return {"score": 1.0, "pid": float(os.getpid())}


def writes(response, ground_truth, *, data_source, extra_info):
    if response == "write":
        with open(extra_info["path"], "wb") as f:
            f.write(b"x" * (2 << 20))
    return {"score": 1.0, "pid": float(os.getpid())}


def environment(response, ground_truth, *, data_source, extra_info):
    rendezvous = [k for k in os.environ if k in ("MASTER_ADDR", "MASTER_PORT") or k.startswith("TORCHELASTIC_")]
    return {
        "score": 1.0,
        "rendezvous": float(len(rendezvous)),
        "rank": float(os.environ["RANK"]),
        "nccl": float(os.environ["NCCL_DEBUG"] == "WARN"),
    }
"""


def reward_fn(path: Path, name: str) -> RewardFn:
    return load_reward_fn(f"{path}:{name}")


def reward_inputs(*responses: str, **extra_info: str) -> list[RewardInput]:
    return [RewardInput(r, "19", "spmdrl/tiny_arith", dict(extra_info)) for r in responses]
