"""Seeded fuzzer of the GGUF export's inputs: ``python -m tests.fuzz_export --seed 0 --cases 240`` prints
one JSON line of figures. Each case is a mutated copy of a tiny merged checkpoint (tests/gguf_inputs.py)
exported by the CLI's entry point in this process; every file written is loaded by one long-lived
llama.cpp process (full load, a few tokens evaluated). What is mutated: tokenizer.json (structure, ids,
merges, added tokens, pre-tokenizers, normalizers, decoders, post-processors), tokenizer_config.json, the
chat template, config.json (every key the export reads) and shard bytes (header and data, with the
manifest kept, so the hash check must catch it, or rewritten, or --no-verify).

Outcome of a case: ok (exit 0, llama.cpp loads the file and evaluates), clean (exit 2, one line, nothing
at --out), internal (exit 3, another exception, or an error of more than one line), crash (llama.cpp's
process died on the file), refused (llama.cpp would not load a file slimtune wrote), hang (over 60 s),
memory (peak RSS growth over 512 MB) or leftover (anything at --out or a temporary after an error, or
other than the GGUF and Modelfile after success). tests/test_fuzz.py asserts every class but ok and
clean is empty."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.gguf_inputs import tiny_merged, with_manifest
from tests.mutate import dumps, mutate_bytes, mutate_json

ROOT = Path(__file__).resolve().parents[1]
TYPES = ["f16", "bf16", "f32", "q8_0", "q4_0", "q5_1"]
CASE_SECONDS = 60
MEMORY_BOUND_MB = 512
_PRE_TOKENIZERS = [
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
    {"type": "Whitespace"},
    {"type": "Split", "pattern": {"Regex": "\\s+|[a-z]+"}, "behavior": "Isolated", "invert": False},
    {"type": "Split", "pattern": {"Regex": "(?i:'s|'t)|\\p{L}+|\\p{N}{1,3}"}, "behavior": "Removed", "invert": False},
    {"type": "Split", "pattern": {"Regex": "(((("}, "behavior": "Isolated", "invert": False},
    {"type": "Digits", "individual_digits": True},
    {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": False}, {"type": "Punctuation", "behavior": "Isolated"}],
    },
    {"type": "Sequence", "pretokenizers": [{"type": "Whitespace"}, {"type": "Nope"}]},
]
_NORMALIZERS = [
    {"type": "NFC"}, {"type": "NFKC"}, {"type": "Lowercase"}, {"type": "Strip", "strip_left": True, "strip_right": True},
    {"type": "Replace", "pattern": {"String": "a"}, "content": "b"}, {"type": "Replace", "pattern": {"Regex": "[[["}, "content": ""},
    {"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "StripAccents"}]}, {"type": "Prepend", "prepend": "\u2581"},
]  # fmt: skip
_DECODERS = [
    {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}, {"type": "Fuse"}, {"type": "ByteFallback"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}, {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always"},
    {"type": "Sequence", "decoders": [{"type": "Fuse"}, 7]}, {"type": "WordPiece", "prefix": "##", "cleanup": True},
]  # fmt: skip
_TEMPLATE_PIECES = ["{%", "%}", "{{", "}}", "{% endfor %}", "{% if x %}", "{{ raise_exception('no') }}", "{#", "'", "\\", "\x00",
                    "{% for m in messages %}", "{{ m['content'] | upper }}", "{{ ''.__class__ }}", "{% set x = 1 %}", '"""']  # fmt: skip


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


# --- mutations: each changes a copy of the good checkpoint in place ---------------------------------------


def _write_json_text(path: Path, text: str) -> None:
    path.write_bytes(text.encode("utf-8", "surrogatepass"))


def _splice(value, key: str, sub_text: str) -> str:
    """``value`` as JSON with ``value[key]`` replaced by ``sub_text`` (which may be invalid JSON)."""
    marker = "\u0001SUB\u0001"
    return dumps({**value, key: marker}).replace(dumps(marker), sub_text, 1)


def _tokenizer_json(d: Path, rng: random.Random) -> str:
    path = d / "tokenizer.json"
    spec = json.loads(path.read_text())
    r = rng.random()
    if r < 0.45:  # a structured mutation of one part
        part = rng.choice(["model", "model", "added_tokens", "pre_tokenizer", "normalizer", "decoder", "post_processor"])
        if part == "model":
            model = spec["model"]
            sub = rng.choice(["vocab", "merges", "merges", "type", "byte_fallback", "unk_token", "fuse_unk"])
            text = _splice(spec, "model", _splice(model, sub, mutate_json(model.get(sub), rng)))
        else:
            text = _splice(spec, part, mutate_json(spec.get(part), rng))
        _write_json_text(path, text)
        return f"tokenizer.json {part}"
    if r < 0.75:  # a valid-looking component the export may or may not take
        key, choices = rng.choice([("pre_tokenizer", _PRE_TOKENIZERS), ("normalizer", _NORMALIZERS), ("decoder", _DECODERS)])
        spec[key] = rng.choice(choices + [None])
        _write_json_text(path, json.dumps(spec))
        return f"tokenizer.json {key} swap"
    if r < 0.92:  # ids and merges changed consistently or not
        vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
        kind = rng.randrange(5)
        if kind == 0 and merges:
            merges.insert(rng.randrange(len(merges)), rng.choice(merges))  # a repeated merge
        elif kind == 1:
            token = rng.choice(list(vocab))
            vocab[token] = rng.choice([len(vocab) - 1 + rng.randint(0, 200), vocab[token]])
        elif kind == 2:
            del vocab[rng.choice(list(vocab))]
        elif kind == 3:
            spec["added_tokens"].append({"id": rng.choice([len(vocab), 3, 2**31]), "content": rng.choice(["<x>", "", "a", "<|im_end|>"]),
                                         "single_word": False, "lstrip": False, "rstrip": False, "normalized": rng.random() < 0.5,
                                         "special": rng.random() < 0.5})  # fmt: skip
        else:
            rng.shuffle(merges)
        _write_json_text(path, json.dumps(spec))
        return "tokenizer.json ids"
    _write_json_text(path, mutate_bytes(path.read_bytes(), rng).decode("utf-8", "surrogateescape"))
    return "tokenizer.json bytes"


def _tokenizer_config(d: Path, rng: random.Random) -> str:
    path = d / "tokenizer_config.json"
    _write_json_text(path, mutate_json(json.loads(path.read_text()), rng))
    return "tokenizer_config.json"


def _chat_template(d: Path, rng: random.Random) -> str:
    path = d / "tokenizer_config.json"
    config = json.loads(path.read_text())
    template = config.get("chat_template") or ""
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(template) + 1)
        if rng.random() < 0.5:
            template = template[:i] + rng.choice(_TEMPLATE_PIECES) + template[i:]
        else:
            template = template[:i] + template[i + rng.randint(1, 6) :]
    config["chat_template"] = template if rng.random() < 0.9 else rng.choice([7, ["x"], [{"name": "default", "template": template}]])
    _write_json_text(path, json.dumps(config))
    return "chat template"


def _config(d: Path, rng: random.Random) -> str:
    path = d / "config.json"
    config = json.loads(path.read_text())
    _write_json_text(path, mutate_json(config, rng))
    return "config.json"


def _shard(d: Path, rng: random.Random) -> tuple[str, bool]:
    """Damaged shard bytes; returns (what, whether the manifest is rewritten to match)."""
    shard = next(d.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    r = rng.random()
    if r < 0.5:  # a data byte: the hash check must see it (the manifest is kept)
        i = rng.randrange(header, len(data))
        data[i] ^= 1 << rng.randrange(8)
        shard.write_bytes(bytes(data))
        return "shard data byte", False
    if r < 0.8:  # header damage, manifest rewritten: the safetensors reader must see it
        shard.write_bytes(mutate_bytes(bytes(data[:header]), rng) + bytes(data[header:]))
        return "shard header", True
    shard.write_bytes(bytes(data[: rng.randrange(len(data))]))
    return "shard truncated", rng.random() < 0.5


def mutate_case(d: Path, rng: random.Random) -> tuple[str, list[str]]:
    """Mutate the checkpoint copy ``d``; returns what was mutated and extra CLI arguments."""
    r = rng.random()
    if r < 0.4:
        what = _tokenizer_json(d, rng)
    elif r < 0.5:
        what = _tokenizer_config(d, rng)
    elif r < 0.62:
        what = _chat_template(d, rng)
    elif r < 0.87:
        what = _config(d, rng)
    else:
        what, rewrite = _shard(d, rng)
        if not rewrite:
            return what, ["--no-verify"] if rng.random() < 0.2 else []
    with_manifest(d)
    return what, []


# --- llama.cpp, in one long-lived process -----------------------------------------------------------------


def llama_worker() -> None:
    """Read GGUF paths on stdin; for each, one JSON line: loaded (full load, a few tokens evaluated) or the error."""
    import llama_cpp
    import numpy as np

    default = llama_cpp.llama_cpp.llama_model_default_params

    def params():  # as tests/test_gguf.py: llama.cpp's CPU weight repacking crashes on this machine's AMX CPU
        p = default()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama.llama_cpp.llama_model_default_params = params
    for line in sys.stdin:
        try:
            llm = llama_cpp.Llama(line.strip(), n_ctx=64, n_threads=1, n_batch=16, verbose=False)
            ids = (llm.tokenize("Hello world, naïve 🦙".encode(), add_bos=True) or [0])[:12]
            llm.eval(ids)
            out = {"loaded": True, "tokens": len(ids), "finite": bool(np.isfinite(llm.scores[len(ids) - 1]).all())}
            llm.close()
        except Exception as e:  # noqa: BLE001 - reported to the fuzzer
            out = {"loaded": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(json.dumps(out), flush=True)


class LlamaProcess:
    def __init__(self):
        self.proc = None

    def _start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        code = "from tests.fuzz_export import llama_worker; llama_worker()"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def load(self, path: Path) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], CASE_SECONDS)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            code = self.proc.wait()
            self.proc = None
            return {"loaded": False, "crash": True, "error": f"llama.cpp process ended ({code})" if ready else "llama.cpp hung"}
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # every case is counted already: a slow exit is not one
                self.proc.kill()
                self.proc.wait()


# --- cases -------------------------------------------------------------------------------------------------


class _Hang(BaseException):
    pass


def _alarm(signum, frame):
    raise _Hang()


def run_case(src: Path, out_dir: Path, typ: str, extra: list[str], src_arg: bool = True) -> tuple[str, str]:
    """One export through the CLI's entry point; (outcome, detail) before llama.cpp sees the file.
    ``src_arg``: SRC is the export's positional argument (else ``extra`` names it, e.g. --adapter)."""
    from slimtune.cli import main as slimtune_main

    err = io.StringIO()
    signal.alarm(CASE_SECONDS)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = slimtune_main(["export", *([str(src)] if src_arg else []), "--type", typ, "--out", str(out_dir / "m.gguf"), *extra])
    except _Hang:
        return "hang", ""
    except BaseException as e:  # noqa: BLE001 - the CLI's main must not raise
        return "internal", f"{type(e).__name__}: {e}"[:300]
    finally:
        signal.alarm(0)
    text = err.getvalue().strip()
    left = sorted(p.name for p in out_dir.iterdir()) + sorted(p.name for p in src.parent.glob(".*tmp*"))
    if code == 0:
        return ("ok", "") if left == ["Modelfile", "m.gguf"] else ("leftover", str(left))
    if code != 2 or len(text.splitlines()) != 1 or "internal error" in text:
        return "internal", text[:300]
    return ("clean", text[:300]) if not left else ("leftover", str(left))


FAILURES = ("internal", "crash", "refused", "hang", "memory", "leftover")  # outcomes a fuzz run must not have


class Tally:
    """A fuzz run's outcomes: counts, counts per kind of input, the first 20 failures (``result``: its record)."""

    def __init__(self) -> None:
        self.counts = dict.fromkeys(("ok", "clean", *FAILURES), 0)
        self.by_input: dict[str, dict[str, int]] = {}
        self.failures: list[str] = []

    def add(self, what: str, outcome: str, detail: str, case: str) -> None:
        self.counts[outcome] += 1
        kind = self.by_input.setdefault(what, {})
        kind[outcome] = kind.get(outcome, 0) + 1
        if outcome in FAILURES and len(self.failures) < 20:
            self.failures.append(f"{case}: {outcome}: {detail}")

    def result(self, seed: int, cases: int, seconds: float) -> dict:
        figures = {"seed": seed, "cases": cases, "seconds": round(seconds, 1), **self.counts}
        return {**figures, "by_input": self.by_input, "failures": self.failures}


def bounded(run) -> tuple[str, str]:
    """``run()`` -> (outcome, detail), with "memory" where this process's VmHWM rose by more than MEMORY_BOUND_MB."""
    Path("/proc/self/clear_refs").write_text("5")
    before = _vm("VmRSS")
    outcome, detail = run()
    return ("memory", detail) if (_vm("VmHWM") - before) / 2**20 > MEMORY_BOUND_MB else (outcome, detail)


def loaded_in(llama: LlamaProcess, files: str | Path, outcome: str, detail: str) -> tuple[str, str]:
    """A written file (``outcome`` "ok") must load in llama.cpp: else "crash" or "refused" with its error."""
    if outcome != "ok":
        return outcome, detail
    loaded = llama.load(files)
    return (outcome, detail) if loaded["loaded"] else ("crash" if loaded.get("crash") else "refused", loaded["error"])


def fuzz_arguments(argv: list[str] | None, cases: int) -> tuple[argparse.Namespace, random.Random]:
    """A fuzz driver's ``--seed`` and ``--cases`` (default ``cases``) and its seeded generator; library logs
    quieted, the case time limit (SIGALRM) armed."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=cases)
    args = parser.parse_args(argv)
    import logging

    import transformers

    from slimtune.cli import quiet_library_logs

    quiet_library_logs()
    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    signal.signal(signal.SIGALRM, _alarm)
    return args, random.Random(args.seed)


def main(argv: list[str] | None = None) -> dict:
    args, rng = fuzz_arguments(argv, cases=240)
    shm = Path("/dev/shm")
    tmp = Path(tempfile.mkdtemp(prefix="slimtune-fuzz-gguf-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None))
    tally = Tally()
    llama = LlamaProcess()
    try:
        good = tiny_merged(tmp / "good")
        run_case(good, _fresh(tmp / "warm"), "f16", [])  # imports and caches: no case pays for them
        start = time.perf_counter()
        for i in range(args.cases):
            src = tmp / f"case-{i}" / "ckpt"
            shutil.copytree(good, src)
            what, extra = mutate_case(src, rng)
            typ = rng.choice(TYPES)
            out_dir = _fresh(tmp / f"case-{i}" / "out")
            outcome, detail = bounded(lambda: run_case(src, out_dir, typ, extra))  # noqa: B023 (called at once)
            tally.add(what, *loaded_in(llama, out_dir / "m.gguf", outcome, detail), f"case {i} ({what}, {typ})")
            shutil.rmtree(tmp / f"case-{i}", ignore_errors=True)
        seconds = time.perf_counter() - start
    finally:
        llama.close()
        shutil.rmtree(tmp, ignore_errors=True)
    result = tally.result(args.seed, args.cases, seconds)
    print(json.dumps(result))
    return result


def _fresh(d: Path) -> Path:
    d.mkdir(parents=True)
    return d


if __name__ == "__main__":
    figures = main()
    sys.exit(0 if all(figures[k] == 0 for k in FAILURES) else 1)
