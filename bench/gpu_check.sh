#!/usr/bin/env bash
# One short GPU check for the device machine (torch with CUDA preinstalled, no network):
#   1. the CUDA tests (save and merge on the GPU equal the CPU results; VRAM overhead of the save),
#   2. the save bench on the GPU for the llama3.2-1b shape, and the NF4 dequantization bench.
# torchao is not on that image: carry its wheel in bench/wheels/ (gitignored), e.g.
#   pip download --no-deps -d bench/wheels torchao==0.18.0
# and pass carry=["bench/wheels"] to the device run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torchao" 2>/dev/null; then
  mkdir -p /tmp/slimtune-site
  $PY -m pip install -q --no-deps --no-index --target /tmp/slimtune-site bench/wheels/*.whl
  export PYTHONPATH="/tmp/slimtune-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
$PY -c "import torch, torchao, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'torchao', torchao.__version__, 'transformers', transformers.__version__)"
$PY -m pytest -q -s tests/test_gpu.py -p no:cacheprovider
$PY -m slimtune.bench save --preset llama3.2-1b --out /tmp/slimtune-gpu-bench --device cuda
$PY -m slimtune.bench nf4 --device cuda
