#!/usr/bin/env bash
# slimtune and its peers, side by side, on the same shapes in the same run (docs/benchmarks.md).
#
#   bash bench/peers/run_peers.sh [run_peers.py options, e.g. --layers 8 --out bench/peers/out]
#
# Makes the peers' virtualenvs once (torch==2.13.0 installed first in each, so pip never pulls a CUDA build):
#   bench/peers/.venv-torchtune  torchtune 0.6.1 + torchao 0.14.1 (torchtune 0.6.1 predates torchao 0.18's API;
#                                0.14.1 imports with torch 2.13 and only skips its C++ kernels, which NF4 does not use)
#   bench/peers/.venv-peft       peft, transformers, safetensors, accelerate at the main .venv's versions, and
#                                matplotlib for the plot; it also runs the driver (stdlib + matplotlib)
# then runs bench/peers/run_peers.py, which uses the main .venv for slimtune.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
PEERS=bench/peers

make_venv() {  # make_venv DIR PACKAGE...
  local dir=$1 stamp=$1/.peers-installed
  shift
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$*" ]; then return; fi
  test -x "$dir/bin/python" || "$PY" -m venv "$dir"
  "$dir/bin/python" -m pip install -q --upgrade pip
  "$dir/bin/python" -m pip install -q torch==2.13.0
  "$dir/bin/python" -m pip install -q torch==2.13.0 "$@"
  echo "$*" > "$stamp"
}

test -x .venv/bin/python || make .venv/.slimtune-installed
make_venv $PEERS/.venv-torchtune torchtune==0.6.1 torchao==0.14.1
make_venv $PEERS/.venv-peft peft==0.21.2 transformers==5.24.0 safetensors==0.8.0 accelerate==1.15.0 matplotlib==3.11.2

exec $PEERS/.venv-peft/bin/python $PEERS/run_peers.py "$@"
