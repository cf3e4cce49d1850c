"""Seeded fuzzers for every reader slimtune owns, run in one process so the memory they cost can be
measured: ``python -m tests.fuzz_readers --seed 0`` prints one JSON line of figures (cases per reader,
refusals, unexpected exceptions, slowest case, peak RSS growth). tests/test_fuzz.py asserts on them.

A case passes when the reader accepts the input or raises SlimtuneError; anything else (an exception of
another type, a case slower than 10 s, memory growth beyond 256 MB from files under 1 MB) is a failure."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from slimtune.errors import SlimtuneError
from tests.mutate import mutate_bytes, mutate_json, mutated_safetensors

MODULES = [f"model.layers.{i}.{part}" for i in range(2) for part in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")]
KINDS = {"": "LlamaForCausalLM", "model": "LlamaModel", "model.embed_tokens": "embedding", "lm_head": "linear"}
KINDS.update({m: "linear" for m in MODULES})


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


class Runner:
    def __init__(self):
        self.stats: dict[str, dict[str, int]] = {}
        self.failures: list[str] = []
        self.slowest, self.slowest_reader = 0.0, ""
        self.largest_input = 0

    def case(self, reader: str, fn, size: int = 0, names: tuple[str, ...] = ()) -> None:
        """One input: ``fn`` accepts it or raises SlimtuneError; with ``names``, that error is one line
        naming one of them (the file or tensor), else the case fails."""
        s = self.stats.setdefault(reader, {"cases": 0, "accepted": 0, "refused": 0, "crashed": 0, "ms": 0})
        s["cases"] += 1
        self.largest_input = max(self.largest_input, size)
        t = time.perf_counter()
        try:
            fn()
            s["accepted"] += 1
        except SlimtuneError as e:
            s["refused"] += 1
            message = str(e)
            message.encode("utf-8")  # the message itself must print
            if names and ("\n" in message or not any(n in message for n in names)):
                s["refused"] -= 1
                s["crashed"] += 1
                if len(self.failures) < 20:
                    self.failures.append(f"{reader}: not one line naming {names}: {message[:300]!r}")
        except BaseException as e:  # noqa: BLE001 - that is what a fuzzer looks for
            s["crashed"] += 1
            if len(self.failures) < 20:
                self.failures.append(f"{reader}: {type(e).__name__}: {str(e)[:200]} | {traceback.format_exc().splitlines()[-3][:200]}")
        took = time.perf_counter() - t
        s["ms"] += took * 1000
        if took > self.slowest:
            self.slowest, self.slowest_reader = took, reader


def fuzz_safetensors(run: Runner, rng: random.Random, tmp: Path, n: int) -> None:
    from slimtune.formats.safetensors import SafetensorsReader

    path = tmp / "f.safetensors"
    for _ in range(n):
        data = mutated_safetensors(rng)
        path.write_bytes(data)

        def read():
            with SafetensorsReader(path) as r:  # every accepted tensor is read: allocation is bounded by the file
                for name, e in r.tensors.items():
                    if e.dtype is not None and e.nbytes:
                        r.read(name)

        run.case("safetensors", read, len(data))


def _shards(tmp: Path) -> tuple[Path, dict]:
    d = tmp / "sharded"
    d.mkdir()
    save_file({"a": torch.zeros(2, 2), "b": torch.ones(3)}, d / "model-00001-of-00002.safetensors")
    save_file({"c": torch.zeros(4, dtype=torch.bfloat16)}, d / "model-00002-of-00002.safetensors")
    shard1, shard2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    index = {"metadata": {"total_size": 36}, "weight_map": {"a": shard1, "b": shard1, "c": shard2}}
    return d, index


def fuzz_index(run: Runner, rng: random.Random, tmp: Path, n: int) -> None:
    from slimtune.formats.hf import INDEX_NAME, checkpoint_files
    from slimtune.verify import VerifyReport, check_safetensors_and_index

    d, index = _shards(tmp)
    for i in range(n):
        text = mutate_json(index, rng).encode("utf-8", "surrogatepass")
        if rng.random() < 0.2:
            text = mutate_bytes(text, rng)
        (d / INDEX_NAME).write_bytes(text)
        run.case("index", lambda: checkpoint_files(d), len(text))
        if i % 5 == 0:
            run.case("index", lambda: check_safetensors_and_index(d, VerifyReport()), len(text))


LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
                "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "head_dim": 16,
                "rope_theta": 10000.0, "torch_dtype": "bfloat16"}  # fmt: skip


def fuzz_config(run: Runner, rng: random.Random, tmp: Path, n: int) -> None:
    from slimtune.formats.hf import read_config_dict, read_model_config

    d = tmp / "cfg"
    d.mkdir()
    for i in range(n):
        text = mutate_json(LLAMA_CONFIG, rng).encode("utf-8", "surrogatepass")
        if rng.random() < 0.15:
            text = mutate_bytes(text, rng)
        (d / "config.json").write_bytes(text)
        run.case("config.json", lambda: read_config_dict(d), len(text))
        if i % 25 == 0:  # the full path: transformers' own checks
            run.case("config.json", lambda: read_model_config(d), len(text))
    shutil.rmtree(d / "config.json", ignore_errors=True)
    (d / "config.json").unlink(missing_ok=True)
    (d / "config.json").mkdir()
    run.case("config.json", lambda: read_config_dict(d))


def _adapter_dir(tmp: Path) -> Path:
    from slimtune.formats.peft import lora_key

    d = tmp / "adapter"
    d.mkdir()
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for m in MODULES:
        tensors[lora_key(m, "lora_A")] = torch.randn(4, 64, generator=gen)
        tensors[lora_key(m, "lora_B")] = torch.randn(64, 4, generator=gen)
    tensors["base_model.model.lm_head.weight"] = torch.randn(300, 64, generator=gen)
    save_file(tensors, d / "adapter_model.safetensors")
    return d


ADAPTER_CONFIG = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                  "target_modules": ["q_proj", "v_proj", "down_proj"], "bias": "none", "fan_in_fan_out": False,
                  "use_rslora": False, "use_dora": False, "modules_to_save": ["lm_head"], "rank_pattern": {"q_proj": 4},
                  "alpha_pattern": {"v_proj": 16}, "layers_to_transform": None, "layers_pattern": None,
                  "init_lora_weights": True, "exclude_modules": None}  # fmt: skip


def fuzz_adapter_config(run: Runner, rng: random.Random, tmp: Path, n: int) -> None:
    from slimtune.formats.peft import read_adapter, resolve

    d = _adapter_dir(tmp)
    base_keys = {f"{m}.weight" for m in MODULES} | {"lm_head.weight", "model.embed_tokens.weight"}
    for _ in range(n):
        text = mutate_json(ADAPTER_CONFIG, rng).encode("utf-8", "surrogatepass")
        if rng.random() < 0.15:
            text = mutate_bytes(text, rng)
        (d / "adapter_config.json").write_bytes(text)

        def read():
            adapter = read_adapter(d)
            resolve(adapter, KINDS, "lm_head", base_keys)

        run.case("adapter_config.json", read, len(text))


def _random_object(rng: random.Random, depth: int = 0):
    choice = rng.randrange(9 if depth < 3 else 5)
    if choice == 0:
        return torch.randn(rng.randint(0, 4), rng.randint(1, 8))
    if choice == 1:
        return rng.choice([0, -1, 2**70, 1.5, float("nan"), True, None, "x", b"\x00"])
    if choice == 2:
        return torch.zeros(2, dtype=rng.choice([torch.int64, torch.bool, torch.uint8, torch.float16, torch.complex64]))
    if choice == 3:
        return torch.tensor(float(rng.choice(["nan", "inf", "1.0"])))
    if choice == 4:
        return rng.choice(["base_model.model.m.lora_A.weight", "\ud800", ""])
    if choice == 5:
        return [_random_object(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if choice == 6:
        return (_random_object(rng, depth + 1),)
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    keys = [
        f"{q}.lora_A.weight",
        f"{q}.lora_B.weight",
        f"{q}.lora_magnitude_vector",
        "base_model.model.lm_head.weight",
        "x",
        1,
        ("t",),
        None,
    ]
    return {rng.choice(keys): _random_object(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def fuzz_bin_adapter(run: Runner, rng: random.Random, tmp: Path, n: int) -> None:
    from slimtune.formats.peft import read_adapter

    d = tmp / "bin_adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({**ADAPTER_CONFIG, "target_modules": ["q_proj"], "rank_pattern": {}}))
    valid = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 64),
             "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(64, 4)}  # fmt: skip
    torch.save(valid, d / "adapter_model.bin")
    valid_bytes = (d / "adapter_model.bin").read_bytes()
    for _ in range(n):
        r = rng.random()
        if r < 0.6:
            try:
                torch.save(_random_object(rng, 2) if rng.random() < 0.3 else {**valid, **_random_object(rng, 2)}, d / "adapter_model.bin")
            except Exception:  # noqa: BLE001 - an object torch cannot even save is no test case
                continue
        else:
            (d / "adapter_model.bin").write_bytes(mutate_bytes(valid_bytes, rng))
        run.case("adapter_model.bin", lambda: read_adapter(d), (d / "adapter_model.bin").stat().st_size)


def fuzz_manifest(run: Runner, rng: random.Random, tmp: Path, n: int) -> None:
    from slimtune.formats.manifest import MANIFEST_NAME, manifest_problems, read_manifest, sha256_file

    d = tmp / "ckpt"
    d.mkdir()
    (d / "a.bin").write_bytes(b"hello")
    (d / "sub").mkdir()
    (d / "sub" / "b.json").write_text("{}")
    manifest = {"format": "slimtune-checkpoint/1", "kind": "adapter", "files": [
        {"path": "a.bin", "size": 5, "sha256": sha256_file(d / "a.bin")},
        {"path": "sub/b.json", "size": 2, "sha256": sha256_file(d / "sub" / "b.json")}]}  # fmt: skip
    for _ in range(n):
        text = mutate_json(manifest, rng).encode("utf-8", "surrogatepass")
        if rng.random() < 0.15:
            text = mutate_bytes(text, rng)
        (d / MANIFEST_NAME).write_bytes(text)
        run.case("manifest", lambda: (read_manifest(d), manifest_problems(d)), len(text))


def fuzz_yaml(run: Runner, rng: random.Random, tmp: Path, n: int) -> None:
    from importlib import resources

    from slimtune.config import load_config

    seed = yaml.safe_load((resources.files("slimtune") / "configs" / "tiny.yaml").read_text())
    seed["output_dir"] = str(tmp / "run")
    path = tmp / "c.yaml"
    extras = [
        "a: &x [1, 2]\nb: *x\n",
        "seed: " + "9" * 5000 + "\n",
        "seed: 18446744073709551616\n",
        "x: " + "[" * 500 + "]" * 500 + "\n",
        "output_dir: " + str(path) + "\n",
        "? [a]\n: b\n",
        "\t\x00",
        "seed: !!python/object:os.system ls\n",
        "lora: {rank: 1e400}\n",
    ]
    for _ in range(n):
        r = rng.random()
        if r < 0.6:
            text = _json_as_yaml(seed, rng)
            if rng.random() < 0.5:
                try:
                    text = yaml.safe_dump(json.loads(text))
                except (ValueError, RecursionError, yaml.YAMLError):
                    pass
        elif r < 0.85:
            text = mutate_bytes(yaml.safe_dump(seed).encode(), rng).decode("utf-8", "replace")
        else:
            text = yaml.safe_dump(seed) + rng.choice(extras)
        try:
            path.write_text(text, encoding="utf-8", errors="surrogatepass")
        except (UnicodeError, ValueError):
            continue
        run.case("yaml", lambda: load_config(str(path)), len(text))


def _json_as_yaml(seed: dict, rng: random.Random) -> str:
    try:
        return mutate_json(seed, rng)  # JSON is YAML (mostly): NaN, huge numbers, duplicate keys, deep nesting
    except (ValueError, RecursionError):
        return "{}"


def fuzz_quant_state(run: Runner, rng: random.Random, tmp: Path, n: int) -> None:
    from slimtune.formats.bnb import QUANT_STATE_SUFFIX, load_bnb_weight

    state = {"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [8, 64], "nested_blocksize": 256, "nested_offset": 0.1}
    tensors = {"w.weight.absmax": torch.rand(8), "w.weight.quant_map": torch.linspace(-1, 1, 16)}
    packed = torch.zeros(256, 1, dtype=torch.uint8)
    for _ in range(n):
        text = mutate_json(state, rng).encode("utf-8", "surrogatepass")
        if rng.random() < 0.15:
            text = mutate_bytes(text, rng)
        small = dict(tensors)
        small["w.weight" + QUANT_STATE_SUFFIX] = torch.tensor(list(text), dtype=torch.uint8)
        if rng.random() < 0.2:
            small["w.weight.absmax"] = torch.randint(0, 255, (8,), dtype=torch.uint8)
            small["w.weight.nested_absmax"] = torch.rand(rng.choice([1, 2]))
            small["w.weight.nested_quant_map"] = torch.rand(rng.choice([256, 16]))

        def read_small(key, small=small):
            if key not in small:
                raise SlimtuneError(f"bitsandbytes tensor {key} is missing")
            return small[key]

        def load():
            w = load_bnb_weight("w.weight", read_small, lambda a, b: packed.view(-1)[a:b], "fuzz.safetensors", rng.choice([256, 255, 128]))
            w.rows(0, w.shape[0])

        run.case("bnb quant state", load, len(text))


PAIR_ROWS = [
    {"prompt": "Say red:", "chosen": " red.", "rejected": " blue!"},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say red"}],
     "chosen": [{"role": "assistant", "content": "red"}], "rejected": [{"role": "assistant", "content": "blue"}]},
]  # fmt: skip
PAIR_JUNK = [None, 3, -1.5, True, "", " ", "x" * 20_000, "\ud800", "\x00", [], {}, [None], [[]], [{"role": "user"}],
             [{"role": 1, "content": "a"}], [{"role": "user", "content": ["a"]}], [{"role": "tool", "content": "a"}],
             [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}], [{"content": "a", "x": {"y": [1]}}],
             {"role": "user", "content": "a"}, [{"role": "user", "content": "a"}] * 2000]  # fmt: skip


def _pair_text(rng: random.Random) -> bytes:
    """A few jsonl lines: valid standard/conversational rows, structured mutations of them, hostile values
    put at a key or removed, and byte damage (non-UTF-8 included)."""
    lines = []
    for _ in range(rng.randint(1, 3)):
        row = json.loads(json.dumps(rng.choice(PAIR_ROWS)))
        r = rng.random()
        if r < 0.45:
            text = mutate_json(row, rng)
        elif r < 0.8:
            key = rng.choice(["prompt", "chosen", "rejected", "prompt", "extra"])
            if rng.random() < 0.2:
                row.pop(key, None)
            else:
                row[key] = rng.choice(PAIR_JUNK)
            text = json.dumps(row)
        else:
            text = json.dumps(row)
        lines.append(text.encode("utf-8", "surrogatepass"))
    data = b"\n".join(lines) + b"\n"
    if rng.random() < 0.15:
        data = mutate_bytes(data, rng)
    if rng.random() < 0.05:
        data = data.replace(b"red", b"r\xff\xfed", 1)  # not UTF-8
    return data


def fuzz_preference(run: Runner, rng: random.Random, tmp: Path, n: int) -> None:
    """The preference-row reader (data/pairs.py through ``load_data``, as a preference run reads its
    file): a refusal must be one line naming the file (``Runner.case``'s names)."""
    from slimtune.data import DataSpec, PairOptions, load_data
    from slimtune.prompts import FALLBACK_CHAT_TEMPLATE
    from slimtune.tiny import byte_tokenizer

    tokenizer = byte_tokenizer()
    tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    path = tmp / "pairs.jsonl"
    for _ in range(n):
        data = _pair_text(rng)
        path.write_bytes(data)
        options = PairOptions(max_length=rng.choice([8, 64, 512]), truncation_mode=rng.choice(["keep_start", "keep_end"]))
        spec = DataSpec([str(path)], pairs=options, drop_bad_pairs=rng.random() < 0.2, eval_fraction=rng.choice([0.0, 0.5]))

        def read(spec=spec):
            load_data(spec, tokenizer, vocab_size=259)

        run.case("preference rows", read, len(data), (str(path),))


BNB_QUANTIZATION = {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False, "bnb_4bit_quant_type": "nf4",
                    "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8",
                    "llm_int8_skip_modules": ["lm_head"], "llm_int8_threshold": 6.0}  # fmt: skip


def fuzz_quantization_config(run: Runner, rng: random.Random, tmp: Path, n: int) -> None:
    """config.json's ``quantization_config`` as a training base's load reads it (read_config_dict, then
    formats.bnb.bnb_4bit_settings): refusals are one line naming config.json."""
    from slimtune.formats.bnb import bnb_4bit_settings
    from slimtune.formats.hf import read_config_dict

    d = tmp / "bnbcfg"
    d.mkdir()
    head = json.dumps(LLAMA_CONFIG)[:-1]
    for _ in range(n):
        text = head + ', "quantization_config": ' + mutate_json(BNB_QUANTIZATION, rng) + "}"
        data = text.encode("utf-8", "surrogatepass")
        if rng.random() < 0.1:
            data = mutate_bytes(data, rng)
        (d / "config.json").write_bytes(data)
        settings = lambda: bnb_4bit_settings(read_config_dict(d), str(d / "config.json"))  # noqa: E731
        run.case("bnb quantization_config", settings, len(data), ("config.json",))


BNB_STATE = {"quant_type": "nf4", "absmax": [], "blocksize": 64, "quant_map": [], "dtype": "bfloat16", "shape": [8, 64],
             "nested_blocksize": 256, "nested_offset": 0.0123, "nested_dtype": "float32"}  # fmt: skip


def _bnb_tensors(rng: random.Random) -> dict[str, torch.Tensor]:
    """One double-quantized NF4 weight [8, 64] as save_pretrained stores it (values random, layout exact)."""
    state = BNB_STATE
    key = "model.layers.0.mlp.up_proj.weight"
    return {
        key: torch.randint(0, 256, (256, 1), dtype=torch.uint8),
        key + ".absmax": torch.randint(0, 256, (8,), dtype=torch.uint8),
        key + ".nested_absmax": torch.rand(1),
        key + ".nested_quant_map": torch.linspace(-1, 1, 256),
        key + ".quant_map": torch.linspace(-1, 1, 16),
        key + ".quant_state.bitsandbytes__nf4": torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8),
    }


_HOSTILE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int8, torch.int64, torch.bool, torch.float64)


def _hostile_tensor(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """``t`` with a wrong dtype, shape, length or values (NaN, infinities, huge, negative)."""
    kind = rng.randrange(6)
    if kind == 0:
        return t.to(rng.choice(_HOSTILE_DTYPES))
    if kind == 1:
        return t.reshape(-1)[: rng.randrange(t.numel() + 1)].clone()
    if kind == 2:
        return torch.cat([t.reshape(-1), t.reshape(-1)[: rng.randint(1, 8)]]).to(t.dtype)
    if kind == 3:
        return t.reshape(-1, 1) if t.dim() == 1 else t.reshape(1, -1) if rng.random() < 0.5 or t.numel() % 2 else t.reshape(-1, 2)
    if kind == 4 and t.is_floating_point() and t.numel():
        v = t.clone().reshape(-1)
        v[rng.randrange(v.numel())] = rng.choice([float("nan"), float("inf"), -float("inf"), 3e38, -1e30])
        return v.reshape(t.shape)
    return torch.zeros(0, dtype=t.dtype)


def fuzz_bnb_shard(run: Runner, rng: random.Random, tmp: Path, n: int) -> None:
    """A shard holding one bitsandbytes 4-bit weight and its quant state tensors, each case with hostile
    tensors (dtype, shape, length, values), a dropped one, the packed weight in another storage dtype or
    shape, or a mutated quant-state JSON blob; read as training reads it (formats.bnb.read_4bit_weights,
    then every row). Refusals are one line naming the shard or the tensor."""
    from slimtune.formats.bnb import read_4bit_weights
    from slimtune.formats.safetensors import SafetensorsReader

    path = tmp / "model.safetensors"
    for _ in range(n):
        tensors = _bnb_tensors(rng)
        keys = sorted(tensors)
        for _ in range(rng.randint(1, 2)):
            key, kind = rng.choice(keys), rng.randrange(10)
            if key not in tensors:
                continue
            if kind == 0:
                del tensors[key]
            elif kind == 1 and key.endswith("__nf4"):
                text = mutate_json(BNB_STATE, rng).encode("utf-8", "surrogatepass")  # the state as written, mutated
                tensors[key] = torch.tensor(list(text if rng.random() < 0.8 else mutate_bytes(text, rng)), dtype=torch.uint8)
            elif kind == 2 and key.endswith("up_proj.weight") and tensors[key].dtype == torch.uint8 and tensors[key].numel() % 4 == 0:
                # the packed bytes in another bnb_4bit_quant_storage
                tensors[key] = tensors[key].view(-1).view(rng.choice([torch.bfloat16, torch.float32, torch.int8])).reshape(-1, 1)
            elif kind == 3:
                tensors[key.rsplit(".weight", 1)[0] + ".weight.absmax"] = torch.rand(8).to(rng.choice(_HOSTILE_DTYPES))
            else:
                tensors[key] = _hostile_tensor(tensors[key], rng)
        save_file({k: v.contiguous() for k, v in tensors.items()}, path)

        def read():
            with SafetensorsReader(path) as reader:
                for w in read_4bit_weights({k: reader for k in reader.tensors}, str(tmp)).values():
                    w.rows(0, w.shape[0])

        run.case("bnb shard", read, path.stat().st_size, (str(path), "up_proj.weight"))


FUZZERS = {
    "safetensors": (fuzz_safetensors, 4000),
    "index": (fuzz_index, 2000),
    "config.json": (fuzz_config, 1500),
    "adapter_config.json": (fuzz_adapter_config, 2000),
    "adapter_model.bin": (fuzz_bin_adapter, 400),
    "manifest": (fuzz_manifest, 1500),
    "yaml": (fuzz_yaml, 600),
    "bnb quant state": (fuzz_quant_state, 1500),
    "preference rows": (fuzz_preference, 800),
    "bnb quantization_config": (fuzz_quantization_config, 600),
    "bnb shard": (fuzz_bnb_shard, 300),
}


def _warm_up(tmp: Path) -> None:
    """Import what the readers import lazily (transformers' config classes), so no case pays for it."""
    from slimtune.formats.hf import read_model_config

    d = tmp / "warm"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    read_model_config(d)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every fuzzer's case count")
    args = parser.parse_args(argv)
    import logging

    import transformers

    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)  # readers log what PEFT would warn about; the figures are what counts here
    run = Runner()
    shm = Path("/dev/shm")  # memory-backed where there is one: the cases are tiny files written and read
    tmp = Path(tempfile.mkdtemp(prefix="slimtune-fuzz-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None))
    try:
        _warm_up(tmp)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on
        baseline = _vm("VmRSS")
        start = time.perf_counter()
        for i, (fn, n) in enumerate(FUZZERS.values()):
            fn(run, random.Random(args.seed * 1000 + i), tmp, max(1, int(n * args.scale)))
        seconds = time.perf_counter() - start
        peak_growth = _vm("VmHWM") - baseline
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "seed": args.seed,
        "cases": sum(s["cases"] for s in run.stats.values()),
        "crashed": sum(s["crashed"] for s in run.stats.values()),
        "per_reader": run.stats,
        "slowest_case_s": round(run.slowest, 3),
        "slowest_reader": run.slowest_reader,
        "seconds": round(seconds, 1),
        "largest_input_bytes": run.largest_input,
        "peak_rss_growth_mb": round(peak_growth / 2**20, 1),
        "failures": run.failures,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["crashed"] == 0 else 1)
