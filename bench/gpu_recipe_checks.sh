#!/usr/bin/env bash
# The recipe's GPU checks (run by `bench/gpu_check.sh --recipe-checks`, or alone), on the device machine:
#   1. the CUDA tests (save and merge on the GPU equal the CPU results; VRAM overhead of the save),
#   2. the save and merge benches on the GPU for the llama3.2-1b shape, the NF4 dequantization bench,
#   3. a tiny fine-tune on the GPU through the recipe (train, periodic save, resume), then its merged
#      output reloaded and compared,
#   4. torchrun with 1 process on NCCL: the tiny config through the recipe (FSDP2 over a 1-rank CUDA
#      mesh: sharded loading, training, DCP training state, the cooperative export of every checkpoint),
#      resumed, and the export of an FSDP2-sharded model compared byte for byte with the plain save;
#      with 2+ GPUs also 2-rank training, resumed on 2 ranks, and the 2-process export.
# torchao is not on that image: carry its wheel in bench/wheels/ (gitignored), e.g.
#   pip download --no-deps -d bench/wheels torchao==0.18.0
# and pass carry=["bench/wheels"] to the device run. Every step runs even if an earlier one failed;
# the script exits non-zero if any did.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torchao" 2>/dev/null; then
  mkdir -p /tmp/slimtune-site
  $PY -m pip install -q --no-deps --no-index --target /tmp/slimtune-site bench/wheels/*.whl
  export PYTHONPATH="/tmp/slimtune-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 TQDM_DISABLE=1
FAILED=0
step() {  # step NAME SECONDS CMD...: run with a time limit, print its status and wall time
  local name=$1 limit=$2; shift 2
  echo "== $name"
  local t0=$SECONDS
  timeout "$limit" "$@"; local rc=$?
  echo "== $name: rc=$rc, $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || FAILED=1
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, torchao, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), 'torchao', torchao.__version__, 'transformers', transformers.__version__)"
step "CUDA tests" 150 $PY -m pytest -q -s tests/test_gpu.py -p no:cacheprovider
step "save bench llama3.2-1b cuda" 120 $PY -m bench save --preset llama3.2-1b --out /tmp/slimtune-gpu-bench --device cuda
step "merge bench llama3.2-1b cuda" 150 $PY -m bench merge --preset llama3.2-1b --out /tmp/slimtune-gpu-merge --device cuda
step "tiny fine-tune cuda" 120 $PY -m slimtune finetune --config tiny output_dir=/tmp/slimtune-gpu-tiny device=cuda
if [ -f /tmp/slimtune-gpu-tiny/metrics.jsonl ]; then tail -n 2 /tmp/slimtune-gpu-tiny/metrics.jsonl; fi
# torchrun, 1 process: the tiny config through the recipe under torchrun's environment, then the
# cooperative export on NCCL (FSDP2 over a 1-rank CUDA mesh; the same files as the plain save?).
TR="$PY -m torch.distributed.run --standalone"
TINY="--config tiny device=cuda training.max_steps=12 checkpoint.save_every_n_steps=6 logging.progress_bar=false"
step "torchrun NCCL 1 process: tiny fine-tune (FSDP2)" 120 $TR --nproc-per-node 1 -m slimtune finetune $TINY output_dir=/tmp/slimtune-gpu-tr1 training.stop_after_steps=6
step "torchrun NCCL 1 process: resumed to step 12" 120 $TR --nproc-per-node 1 -m slimtune finetune $TINY output_dir=/tmp/slimtune-gpu-tr1 resume=true
if [ -f /tmp/slimtune-gpu-tr1/metrics.jsonl ]; then tail -n 1 /tmp/slimtune-gpu-tr1/metrics.jsonl; fi
step "verify the 1-process FSDP2 checkpoint" 60 $PY -m slimtune verify /tmp/slimtune-gpu-tr1/step-000012
$PY -c "from slimtune.tiny import make_tiny_checkpoint as m; m('/tmp/slimtune-gpu-base256', seed=1, hidden_size=256, intermediate_size=512)" >/dev/null
rm -rf /tmp/slimtune-gpu-nccl1 && mkdir -p /tmp/slimtune-gpu-nccl1
step "torchrun NCCL 1 process: FSDP2 export" 120 $TR --nproc-per-node 1 tests/dist_worker.py /tmp/slimtune-gpu-base256 /tmp/slimtune-gpu-nccl1 cuda
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -ge 2 ]; then
  rm -rf /tmp/slimtune-gpu-nccl2 && mkdir -p /tmp/slimtune-gpu-nccl2
  step "torchrun NCCL 2 processes: FSDP2 export" 120 $TR --nproc-per-node 2 tests/dist_worker.py /tmp/slimtune-gpu-base256 /tmp/slimtune-gpu-nccl2 cuda
  step "torchrun NCCL 2 processes: tiny fine-tune" 120 $TR --nproc-per-node 2 -m slimtune finetune $TINY output_dir=/tmp/slimtune-gpu-tr2 training.stop_after_steps=6
  step "torchrun NCCL 2 processes: resumed to step 12" 120 $TR --nproc-per-node 2 -m slimtune finetune $TINY output_dir=/tmp/slimtune-gpu-tr2 resume=true
  if [ -f /tmp/slimtune-gpu-tr2/metrics.jsonl ]; then tail -n 1 /tmp/slimtune-gpu-tr2/metrics.jsonl; fi
else
  echo "== torchrun NCCL 2 processes: skipped, $NGPU GPU on this machine"
fi
exit $FAILED
