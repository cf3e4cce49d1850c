"""Seeded fuzzer of the adapter GGUF export (``slimtune export --adapter-only``, slimtune/gguf/adapter.py):
``python -m tests.fuzz_adapter --seed 0 --cases 30`` prints one JSON line of figures. Each case is a copy of a
small PEFT LoRA adapter (written here as PEFT lays it out: adapter_config.json, adapter_model.safetensors)
for a tiny Llama base (tests/gguf_inputs.py), mutated, exported by the CLI's entry point in this process;
every adapter written is applied by llama.cpp to the base's f16 GGUF in one long-lived process
(``Llama(base.gguf, lora_path=adapter.gguf)``, a few tokens evaluated).

What is mutated: adapter_config.json (structured JSON damage, and hostile values of r, lora_alpha,
target_modules, rank_pattern, alpha_pattern, use_rslora, use_dora, fan_in_fan_out, modules_to_save,
peft_type), the tensors of adapter_model.safetensors (names, shapes, dtypes, NaN and huge values, a key
dropped or added), its bytes (header damage, truncation), and the options (--type, --base-gguf).

Outcomes as tests/fuzz_export.py's: ok (exit 0, the adapter GGUF and a Modelfile whose FROM/ADAPTER lines
are one line each, llama.cpp applies it and evaluates), clean (exit 2, one line, nothing at --out), or
internal, crash, refused, hang, memory, leftover (tests/test_fuzz.py asserts none)."""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.fuzz_export import FAILURES, ROOT, LlamaProcess, Tally, _fresh, bounded, fuzz_arguments, loaded_in, run_case
from tests.gguf_inputs import tiny_merged
from tests.mutate import mutate_bytes, mutate_json

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPES = {
    "q_proj": (64, 64),
    "k_proj": (32, 64),
    "v_proj": (32, 64),
    "o_proj": (64, 64),
    "gate_proj": (128, 64),
    "up_proj": (128, 64),
    "down_proj": (64, 128),
}  # fmt: skip  (out, in) of tests/gguf_inputs.tiny_merged's weights
TYPES = ["f16", "f32", "bf16", "q8_0", "q8_0", "q4_k_m", "f8"]
_HOSTILE = [0, -1, 1, 2, 3, 7, 64, 65, 2**31, 2**63, 1e39, -8.0, 0.5, float("nan"), "4", None, True, [], {}, "q_proj", ".*", ""]
_NAMES = ["q_proj", "nope", "", ".*", "model.layers.0.self_attn.q_proj", "lm_head", "embed_tokens", "layers.9.mlp.up_proj", "norm",
          "q_proj\x00", "ü", "rotary_emb", "self_attn"]  # fmt: skip
_BASE_GGUF = ["model-f16.gguf", "../elsewhere/model-f16.gguf", "/abs/base.gguf", "llama3.2", "", "a\nFROM evil", "x\ry", "a b.gguf",
              "\x00", 'q"""', "~/m.gguf", "m" * 300]  # fmt: skip


def write_adapter(d: Path, rank: int = 4, seed: int = 0) -> Path:
    """A PEFT LoRA adapter for tiny_merged's Llama (every linear of both layers), as PEFT saves one."""
    d.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for m in MODULES:
            part = "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            out_f, in_f = SHAPES[m]
            key = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.05
    save_file(tensors, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 8, "target_modules": MODULES, "lora_dropout": 0.0,
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
              "rank_pattern": {}, "alpha_pattern": {}, "base_model_name_or_path": None}  # fmt: skip
    (d / "adapter_config.json").write_text(json.dumps(config))
    return d


def _config(d: Path, rng: random.Random) -> str:
    path = d / "adapter_config.json"
    config = json.loads(path.read_text())
    if rng.random() < 0.35:
        path.write_bytes(mutate_json(config, rng).encode("utf-8", "surrogatepass"))
        return "adapter_config.json structure"
    key = rng.choice(["r", "lora_alpha", "target_modules", "rank_pattern", "alpha_pattern", "use_rslora", "use_dora", "fan_in_fan_out",
                      "modules_to_save", "peft_type", "layers_to_transform"])  # fmt: skip
    if key == "target_modules":
        value = rng.choice([rng.sample(_NAMES, rng.randint(0, 3)), rng.choice(_NAMES), rng.choice(_HOSTILE), MODULES[: rng.randint(0, 7)]])
    elif key in ("rank_pattern", "alpha_pattern"):
        value = rng.choice([{rng.choice(_NAMES): rng.choice(_HOSTILE)}, rng.choice(_HOSTILE), {"down_proj": rng.choice([2, 8, 0])}])
    elif key == "modules_to_save":
        value = rng.choice([["lm_head"], ["embed_tokens"], "q_proj", None, [1]])
    elif key == "peft_type":
        value = rng.choice(["LORA", "lora", "IA3", "LOHA", 7, None])
    else:
        value = rng.choice(_HOSTILE)
    config[key] = value
    path.write_text(json.dumps(config))  # NaN and Infinity as Python's json writes them: not JSON, and one error line
    return f"adapter_config.json {key}"


def _tensors(d: Path, rng: random.Random) -> str:
    path = d / "adapter_model.safetensors"
    tensors = load_file(str(path))
    key = rng.choice(sorted(tensors))
    kind = rng.randrange(8)
    if kind == 0:
        renamed = key.replace("lora_", rng.choice(["lora_", "lora", "LoRA_", ""]), 1)
        tensors[renamed.replace("layers.0", rng.choice(["layers.0", "layers.7"]))] = tensors.pop(key)
    elif kind == 1:
        del tensors[key]
    elif kind == 2:
        t = tensors[key]
        tensors[key] = torch.randn(*[max(0, s + rng.choice([-1, 1, 0])) for s in t.shape] + ([1] if rng.random() < 0.2 else []))
    elif kind == 3:
        dtypes = [torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.bool, torch.float8_e4m3fn]
        tensors[key] = tensors[key].to(rng.choice(dtypes))
    elif kind == 4:
        tensors[key][0, 0] = rng.choice([float("nan"), float("inf"), -float("inf")])
    elif kind == 5:
        tensors[key] = tensors[key] * rng.choice([1e5, 1e30, 1e-45])
    elif kind == 6:
        tensors[f"base_model.model.model.layers.0.self_attn.{rng.choice(_NAMES)}.lora_A.weight"] = torch.randn(4, 64)
    else:
        tensors[key] = tensors[key][:0]
    save_file(tensors, str(path))
    return f"adapter tensors {['renamed', 'dropped', 'shape', 'dtype', 'non-finite', 'scaled', 'extra', 'empty'][kind]}"


def _bytes(d: Path, rng: random.Random) -> str:
    path = d / "adapter_model.safetensors"
    data = path.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    if rng.random() < 0.6:
        path.write_bytes(mutate_bytes(data[:header], rng) + data[header:])
        return "adapter header bytes"
    path.write_bytes(data[: rng.randrange(len(data))])
    return "adapter truncated"


def mutate_case(d: Path, rng: random.Random) -> tuple[str, str, list[str]]:
    """Mutate the adapter copy ``d``: (what, --type, extra CLI arguments)."""
    r = rng.random()
    what = _config(d, rng) if r < 0.45 else _tensors(d, rng) if r < 0.8 else _bytes(d, rng) if r < 0.9 else "options"
    extra = ["--base-gguf", rng.choice(_BASE_GGUF)] if what == "options" or rng.random() < 0.15 else []
    return what, rng.choice(TYPES) if what == "options" or rng.random() < 0.3 else "f16", extra


def adapter_worker() -> None:
    """Read 'BASE_GGUF<tab>ADAPTER_GGUF' lines; for each, one JSON line: applied (a few tokens evaluated) or the error."""
    import llama_cpp
    import numpy as np

    default = llama_cpp.llama_cpp.llama_model_default_params

    def params():  # as tests/fuzz_export.py: no CPU weight repacking (it crashes on this machine's AMX CPU)
        p = default()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama.llama_cpp.llama_model_default_params = params
    for line in sys.stdin:
        base, adapter = line.rstrip("\n").split("\t")
        try:
            llm = llama_cpp.Llama(base, lora_path=adapter, n_ctx=64, n_threads=1, n_batch=16, verbose=False)
            ids = (llm.tokenize(b"Hello world", add_bos=True) or [0])[:8]
            llm.eval(ids)
            out = {"loaded": True, "finite": bool(np.isfinite(llm.scores[len(ids) - 1]).all())}
            llm.close()
        except Exception as e:  # noqa: BLE001 - reported to the fuzzer
            out = {"loaded": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(json.dumps(out), flush=True)


class AdapterLlamaProcess(LlamaProcess):
    def _start(self) -> None:
        import os
        import subprocess

        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        code = "from tests.fuzz_adapter import adapter_worker; adapter_worker()"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def _modelfile_ok(out_dir: Path) -> bool:
    lines = (out_dir / "Modelfile").read_text().splitlines()
    return lines[0].startswith("FROM ") and lines[1] == "ADAPTER ./m.gguf" and sum(x.startswith(("FROM", "ADAPTER")) for x in lines) == 2


def main(argv: list[str] | None = None) -> dict:
    from slimtune.cli import main as slimtune_main

    args, rng = fuzz_arguments(argv, cases=30)
    tmp = Path(tempfile.mkdtemp(prefix="slimtune-fuzz-adapter-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    tally = Tally()
    llama = AdapterLlamaProcess()
    llama._start()  # its imports overlap the base's set-up: the first case's time limit is the case's own
    try:
        base = tiny_merged(tmp / "base")
        base_gguf = tmp / "model-f16.gguf"
        assert slimtune_main(["export", str(base), "--type", "f16", "--out", str(base_gguf)]) == 0
        good = write_adapter(tmp / "good")
        start = time.perf_counter()
        for i in range(args.cases):
            src = tmp / f"case-{i}" / "adapter"
            shutil.copytree(good, src)
            what, typ, extra = mutate_case(src, rng)
            out_dir = _fresh(tmp / f"case-{i}" / "out")
            cli = ["--adapter-only", "--base", str(base), "--adapter", str(src), *extra]
            outcome, detail = bounded(lambda: run_case(src, out_dir, typ, cli, src_arg=False))  # noqa: B023 (called at once)
            if outcome == "ok" and not _modelfile_ok(out_dir):
                outcome, detail = "internal", (out_dir / "Modelfile").read_text()[:200]
            outcome, detail = loaded_in(llama, f"{base_gguf}\t{out_dir / 'm.gguf'}", outcome, detail)
            tally.add(what, outcome, detail, f"case {i} ({what}, {typ}, {extra})")
            shutil.rmtree(tmp / f"case-{i}", ignore_errors=True)
        seconds = time.perf_counter() - start
    finally:
        llama.close()
        shutil.rmtree(tmp, ignore_errors=True)
    result = tally.result(args.seed, args.cases, seconds)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    figures = main()
    sys.exit(0 if all(figures[k] == 0 for k in FAILURES) else 1)
