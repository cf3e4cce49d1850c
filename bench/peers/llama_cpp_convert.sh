#!/usr/bin/env bash
# The peer of `python -m bench gguf --peer llama.cpp`: llama.cpp's own converter,
# convert_hf_to_gguf.py, on a merged Hugging Face checkpoint directory, in its own venv.
#
#   bash bench/peers/llama_cpp_convert.sh MODEL_DIR OUTFILE [TYPE]   # TYPE: f32, f16, bf16, q8_0 (default q8_0)
#   bash bench/peers/llama_cpp_convert.sh --setup                    # only make the venv and the extraction
#
# Prints one JSON line on stdout (everything else goes to stderr):
#   {"peer": "convert_hf_to_gguf.py", "llama_cpp_commit": ..., "type": ..., "lazy": true,
#    "seconds": ..., "peak_rss_mb": ..., "file_bytes": ...}
# seconds and peak_rss_mb are /usr/bin/time -v's wall clock and maximum resident set size of the converter
# process (interpreter, imports and conversion). The converter runs in its default lazy mode (tensors
# are computed as they are written; no --no-lazy, no --use-temp-file).
#
# Where llama.cpp comes from: its repository is too large to fetch here, so the converter is taken from
# the llama.cpp copy vendored in the PyPI source distribution of llama-cpp-python 0.3.36 (the build the
# tests use as their oracle), pinned by the sdist's sha256; the vendored commit is read from the sdist's
# git metadata and checked against the pinned one. Once, under bench/peers/ (both gitignored):
#   llama.cpp/         convert_hf_to_gguf.py, conversion/, gguf-py/, requirements/, models/templates/, LICENSE
#   .venv-llamacpp/    python3 -m venv; torch==2.13.0 first (this machine's CPU wheel: pip never pulls a
#                      CUDA build; the converter's requirements file pins torch 2.11.0, which is not used),
#                      then the converter's other requirements (requirements/requirements-convert_hf_to_gguf.txt,
#                      pinned to what resolved here) except transformers: 5.24.0, the main .venv's, in place of
#                      its pinned 4.57.6, which cannot load a tokenizer saved by transformers 5 (slimtune's and
#                      the real-model cache's: "Tokenizer class TokenizersBackend does not exist"); the converter
#                      runs with 5.24.0. Last, gguf-py from the extracted folder (the converter imports that copy first).
set -euo pipefail
cd "$(dirname "$0")/../.."
PEERS=bench/peers
SRC=$PEERS/llama.cpp
VENV=$PEERS/.venv-llamacpp
SDIST_VERSION=0.3.36
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LLAMA_CPP_COMMIT=0c1e57098bba43ac29e6e3b677cdceebdd22334f
PACKAGES=(numpy==2.2.6 sentencepiece==0.2.3 transformers==5.24.0 protobuf==4.25.9 safetensors==0.8.0)

make_venv() {
  local stamp=$VENV/.peers-installed want="torch==2.13.0 ${PACKAGES[*]} gguf-py@$LLAMA_CPP_COMMIT"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return; fi
  test -x "$VENV/bin/python" || "${PYTHON:-python3}" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q torch==2.13.0
  "$VENV/bin/python" -m pip install -q torch==2.13.0 "${PACKAGES[@]}" "./$SRC/gguf-py"
  echo "$want" > "$stamp"
}

extract() {
  if [ "$(cat "$SRC/COMMIT" 2>/dev/null)" = "$LLAMA_CPP_COMMIT" ]; then return; fi
  local sdist=$SRC/sdist/llama_cpp_python-$SDIST_VERSION.tar.gz top=llama_cpp_python-$SDIST_VERSION
  local vendor=$top/vendor/llama.cpp
  mkdir -p "$SRC/sdist"
  if [ ! -f "$sdist" ]; then
    test -x "$VENV/bin/python" || "${PYTHON:-python3}" -m venv "$VENV"
    "$VENV/bin/python" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$SDIST_VERSION" -d "$SRC/sdist"
  fi
  if ! echo "$SDIST_SHA256  $sdist" | sha256sum -c --quiet -; then
    echo "llama_cpp_convert.sh: $sdist: sha256 is not the pinned $SDIST_SHA256" >&2
    exit 2
  fi
  tar xzf "$sdist" -C "$SRC" --strip-components=3 --wildcards "$vendor/convert_hf_to_gguf.py" "$vendor/conversion/*" \
    "$vendor/gguf-py/*" "$vendor/requirements/*" "$vendor/models/templates/*" "$vendor/LICENSE"
  local commit
  commit=$(tar xzf "$sdist" -O "$top/.git/modules/vendor/llama.cpp/HEAD")
  if [ "$commit" != "$LLAMA_CPP_COMMIT" ]; then
    echo "llama_cpp_convert.sh: $sdist vendors llama.cpp $commit, expected the pinned $LLAMA_CPP_COMMIT" >&2
    exit 2
  fi
  echo "$commit" > "$SRC/COMMIT"
}

{ extract; make_venv; } >&2
if [ "${1:-}" = "--setup" ]; then exit 0; fi
if [ $# -lt 2 ]; then
  echo "usage: bash $0 MODEL_DIR OUTFILE [f32|f16|bf16|q8_0]" >&2
  exit 2
fi
MODEL=$1 OUTFILE=$2 TYPE=${3:-q8_0}
case $TYPE in f32 | f16 | bf16 | q8_0) ;; *)
  echo "llama_cpp_convert.sh: type $TYPE: convert_hf_to_gguf.py writes f32, f16, bf16 or q8_0" >&2
  exit 2
  ;;
esac
TIMES=$(mktemp)
trap 'rm -f "$TIMES"' EXIT
/usr/bin/time -v -o "$TIMES" "$VENV/bin/python" "$SRC/convert_hf_to_gguf.py" "$MODEL" --outtype "$TYPE" --outfile "$OUTFILE" 1>&2
"$VENV/bin/python" - "$TIMES" "$OUTFILE" "$TYPE" "$LLAMA_CPP_COMMIT" <<'EOF'
import json, os, sys
times, outfile, typ, commit = sys.argv[1:5]
fields = dict(line.strip().rsplit(": ", 1) for line in open(times) if ": " in line)
clock = [float(x) for x in fields["Elapsed (wall clock) time (h:mm:ss or m:ss)"].split(":")]
seconds = sum(x * 60**i for i, x in enumerate(reversed(clock)))
print(json.dumps({"peer": "convert_hf_to_gguf.py", "llama_cpp_commit": commit, "type": typ, "lazy": True,
                  "seconds": round(seconds, 2), "peak_rss_mb": round(int(fields["Maximum resident set size (kbytes)"]) / 1024, 1),
                  "file_bytes": os.path.getsize(outfile)}))
EOF
