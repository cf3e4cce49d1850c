#!/usr/bin/env bash
# One prepared GPU check (issue 17) for the device machine: torch with CUDA preinstalled, no network.
# Sized for about 8-10 minutes on one H200 (not yet run on a GPU: the step limits below are caps, not
# estimates); one JSON line per measurement; exits non-zero if any step failed.
#   (a) the seed's Colab scenario: a synthetic Llama-3-8B (real shapes, random bf16, written on this
#       machine's disk), the shipped llama3-8b_qlora config with device=cuda, 2 optimizer steps, merged
#       save: host peak RSS, peak GPU memory, save seconds and its ratio to the disk's measured speed;
#   (b) training speed and memory at Llama-3.2-1B and Llama-3-8B shapes, seq 2048, batch 2, r=16 on all
#       linears, activation checkpointing, 2 warm-up + 10 timed steps: slimtune eager and compiled (the
#       recipe's step function), PEFT + bitsandbytes QLoRA (NF4, double quant, bf16 compute) and PEFT
#       bf16 LoRA, each in a plain loop: tokens/s and peak VRAM;
#   (c) the save and merge benches at the 8B shape from / on the GPU, with the save's per-stage times;
#   (d) training with background checkpoints against synchronous ones (train-save, 1B shape, 4 layers).
# Usage: bench/gpu_check.sh [--cpu-smoke] [--recipe-checks]
#   --cpu-smoke      the dry run on the CPU with tiny shapes (tests/test_gpu_check.py runs it in make test);
#                    peers whose library cannot run on a CPU (bitsandbytes) print {"skipped": why}
#   --recipe-checks  also the earlier checks: CUDA tests, tiny fine-tune, torchrun on NCCL (+3 minutes)
# What the device lacks comes as wheels in bench/wheels/ (gitignored), installed with --no-deps into
# $SLIMTUNE_SITE only for modules that do not import; fetch them here first:
#   pip download --no-deps -d bench/wheels bitsandbytes torchao==0.18.0 peft accelerate
# and pass carry=["bench/wheels"] to the device run. Outputs go to $SLIMTUNE_GPU_OUT (local disk, ~40 GB
# at most: the 16 GB base and one 16 GB output at a time).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SMOKE=0
RECIPE=0
for arg in "$@"; do
  case $arg in
    --cpu-smoke) SMOKE=1 ;;
    --recipe-checks) RECIPE=1 ;;
    *) echo "unknown option $arg (use --cpu-smoke, --recipe-checks)" >&2; exit 2 ;;
  esac
done
SITE=${SLIMTUNE_SITE:-/tmp/slimtune-site}
export PYTHONPATH="$PWD:$SITE:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 TQDM_DISABLE=1
# the modules that do not import (found without importing them: one interpreter), then their wheels
MISSING=$($PY -c "import importlib.util as u; print(' '.join(m for m in 'torchao bitsandbytes peft accelerate transformers tokenizers safetensors huggingface_hub'.split() if u.find_spec(m) is None))")
for module in $MISSING; do
  found=$(ls bench/wheels/"$module"-*.whl 2>/dev/null | head -n 1)
  if [ -n "$found" ]; then
    $PY -m pip install -q --no-deps --no-index --target "$SITE" "$found" >/dev/null 2>&1 \
      && echo "{\"installed\": \"$(basename "$found")\"}" || echo "{\"install_failed\": \"$(basename "$found")\"}"
  else
    echo "{\"missing\": \"$module\", \"wheel\": \"none in bench/wheels\"}"
  fi
done
FAILED=0
step() {  # step NAME SECONDS CMD...: run with a time limit; one JSON line with its status and wall time
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@"; local rc=$?
  echo "{\"step\": \"$name\", \"rc\": $rc, \"wall_s\": $((SECONDS - t0))}"
  [ $rc -eq 0 ] || FAILED=1
}
$PY - <<'PYEOF'
import json, torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, gpu_mb=round(p.total_memory / 2**20), gpus=torch.cuda.device_count())
for name in ("torchao", "transformers", "peft", "bitsandbytes"):
    try:
        info[name] = __import__(name).__version__
    except Exception as e:  # noqa: BLE001
        info[name] = f"unavailable: {type(e).__name__}"
print(json.dumps({"environment": info}))
PYEOF
if [ $SMOKE -eq 1 ]; then
  OUT=$(mktemp -d /tmp/slimtune-smoke.XXXXXX)
  # ~60 s in all on a quiet 2-core machine; the limits leave room for a loaded one (the test's own timeout governs)
  step "colab scenario (tiny, cpu)" 600 $PY -m bench.gpu_check colab --out "$OUT" --smoke
  step "training speed (tiny, cpu)" 600 $PY -m bench.gpu_check train --out "$OUT" --smoke
  step "save bench (tiny, cpu)" 300 $PY -m bench save --preset tiny --out "$OUT/save" --device cpu
  step "merge bench (tiny, cpu)" 300 $PY -m bench merge --preset tiny --out "$OUT/merge" --device cpu
  rm -rf "$OUT"
  exit $FAILED
fi
OUT=${SLIMTUNE_GPU_OUT:-/tmp/slimtune-gpu-check}
mkdir -p "$OUT"
step "colab scenario (llama3-8b_qlora, cuda)" 360 $PY -m bench.gpu_check colab --out "$OUT"
step "training speed vs peers (1B, 8B)" 330 $PY -m bench.gpu_check train --out "$OUT"
step "save bench llama3-8b from cuda" 240 $PY -m bench save --preset llama3-8b --out "$OUT" --device cuda
step "merge bench llama3-8b on cuda" 200 $PY -m bench merge --preset llama3-8b --out "$OUT" --device cuda
step "nf4 dequantization bench cuda" 60 $PY -m bench nf4 --device cuda
# background checkpoints (issue 19): the 1B shape, 4 decoder layers, trained on the GPU with no / synchronous /
# background merged saves (and the writer as a thread); two merged saves per mode, deleted afterwards
step "train-save bench llama3.2-1b cuda" 180 $PY -m bench train-save --preset llama3.2-1b --layers 4 --steps 12 --save-every 6 --device cuda --out "$OUT/train-save"
if [ $RECIPE -eq 1 ]; then
  bash bench/gpu_recipe_checks.sh || FAILED=1
fi
exit $FAILED
