"""The validated readers: strict JSON everywhere, the safetensors header by the reference library's rules
(differentially, against the reference itself), and the files slimtune writes read back by both."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct

import pytest
import safetensors
import torch
from safetensors.torch import load_file, save_file

from slimtune.checkpoint.stream import tensor_source
from slimtune.checkpoint.writer import WriteOptions, write_safetensors
from slimtune.errors import SlimtuneError
from slimtune.formats.merge_source import MergeSource
from slimtune.formats.safetensors import SafetensorsReader, build_header, read_header
from slimtune.formats.strict_json import MAX_DEPTH, loads_json, safe_name
from tests.mutate import mutated_safetensors, safetensors_file


def _verdict_slimtune(path) -> bool:
    try:
        read_header(path)
        return True
    except SlimtuneError:
        return False


def _verdict_reference(data: bytes) -> bool:
    try:
        safetensors.deserialize(data)
        return True
    except Exception:  # noqa: BLE001 - the reference's refusal, whatever its type
        return False


def test_safetensors_reader_agrees_with_the_reference_on_mutated_headers(tmp_path):
    """Differential: 2,000 seeded mutations of valid headers (wrong types, negative/float/huge/-0 dims,
    duplicate keys, deep nesting, lone surrogates, byte damage); accept <=> the reference accepts."""
    rng = random.Random(20261130)
    path = tmp_path / "m.safetensors"
    counts = {"both_accept": 0, "both_refuse": 0, "only_slimtune": 0, "only_reference": 0}
    disagreements = []
    for _ in range(2000):
        data = mutated_safetensors(rng)
        path.write_bytes(data)
        mine, ref = _verdict_slimtune(path), _verdict_reference(data)
        key = "both_accept" if mine and ref else "both_refuse" if not (mine or ref) else "only_slimtune" if mine else "only_reference"
        counts[key] += 1
        if mine != ref:
            disagreements.append(data[:200])
        if mine and ref:  # same tensors, shapes and offsets as the reference sees
            ours = read_header(path).tensors
            theirs = {name: info for name, info in safetensors.deserialize(data)}
            assert sorted(ours) == sorted(theirs)
            for name, info in theirs.items():
                assert list(ours[name].shape) == list(info["shape"]) and ours[name].type_name == _ref_dtype(info["dtype"])
    print(f"safetensors differential: {counts}")
    assert not disagreements, disagreements[:5]
    assert counts["both_accept"] > 100 and counts["both_refuse"] > 100  # the corpus exercises both sides


def _ref_dtype(name: str) -> str:
    return {"float32": "F32"}.get(name, name.upper()) if name.islower() else name


@pytest.mark.parametrize(
    "body, expected",
    [
        ('{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}', "shape must be a list of integers"),
        ('{"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}', "shape must be"),
        ('{"a":{"dtype":"F32","shape":["1"],"data_offsets":[0,4]}}', "shape must be"),
        ('{"a":{"dtype":"F32","shape":[true],"data_offsets":[0,4]}}', "shape must be"),
        ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,1e400]}}', "out of range"),
        ('{"a":{"dtype":"F32","shape":[NaN],"data_offsets":[0,4]}}', "NaN"),
        ('{"a":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}', "twice"),
        ('{"__metadata__":5,"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', "__metadata__ must be"),
        ('{"__metadata__":{"k":1},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', "__metadata__ must be"),
        ('{"\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', "surrogate"),
        ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":' + "[" * 1000 + "]" * 1000 + "}}", "nested deeper"),
        ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,0]}}', "contiguous"),
        (
            '{"a":{"dtype":"F32","shape":[4611686018427387904,4,0],"data_offsets":[0,0]},"b":{"dtype":"F32","shape":[1],'
            '"data_offsets":[0,4]}}',
            "overflows",
        ),  # fmt: skip
        ('{"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,4]}}', "unknown dtype"),
    ],
)
def test_header_faults_are_one_clear_error(tmp_path, body, expected):
    path = tmp_path / "x.safetensors"
    path.write_bytes(safetensors_file(body, 4))
    with pytest.raises(SlimtuneError, match=expected) as info:
        read_header(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    assert not _verdict_reference(path.read_bytes())


def test_reference_dtypes_and_empty_tensors_are_read_written_and_read_back(tmp_path):
    tensors = {
        "u16": torch.tensor([[1, 2, 3], [4, 5, 65535]], dtype=torch.uint16),
        "u32": torch.tensor([1, 2, 3, 2**32 - 1], dtype=torch.uint32),
        "u64": torch.tensor([2**63 + 5], dtype=torch.uint64),
        "f8a": torch.randn(3, 2).to(torch.float8_e4m3fn),
        "f8b": torch.randn(5).to(torch.float8_e5m2),
        "c64": torch.randn(2, 2, dtype=torch.complex64),
        "huge_empty": torch.empty(2**62, 0),  # valid, holds no bytes; must not be iterated row by row
        "w": torch.randn(3, 4),
        "last_empty": torch.empty(4, 0),
    }
    ref = tmp_path / "ref.safetensors"
    save_file(tensors, ref)
    header = read_header(ref)
    assert header.tensors["huge_empty"].shape == (2**62, 0) and header.tensors["c64"].type_name == "C64"
    ours = tmp_path / "ours.safetensors"
    with SafetensorsReader(ref) as r:
        write_safetensors(ours, [tensor_source(k, r.read(k)) for k in r.tensors], WriteOptions(progress=False))
    back = load_file(ours)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        assert torch.equal(back[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k


def test_writer_never_writes_what_a_reader_would_refuse(tmp_path):
    def one(name: str) -> list:
        return [tensor_source(name, torch.ones(1))]

    with pytest.raises(SlimtuneError, match="surrogate"):
        write_safetensors(tmp_path / "s.safetensors", one("bad\ud800"))
    with pytest.raises(SlimtuneError, match="surrogate"):
        build_header([("a", torch.float32, (1,))], {"k": "\udc00"})
    with pytest.raises(SlimtuneError, match="cannot be stored"):
        write_safetensors(tmp_path / "n.safetensors", one("__metadata__"))
    assert not list(tmp_path.iterdir())  # refused before any file was made
    path = tmp_path / "u.safetensors"
    write_safetensors(path, one("é\U0001f600"), WriteOptions(progress=False))
    assert _verdict_reference(path.read_bytes()) and list(load_file(path)) == ["é\U0001f600"]
    header, _ = build_header([("é", torch.float32, (2,))], {"naïve": "ü"})  # non-ASCII metadata too
    assert _verdict_reference(header + torch.ones(2).numpy().tobytes())


def test_strict_json_refuses_what_serde_json_refuses():
    for text, expected in [
        ('{"a":1,"a":2}', "duplicate key"),
        ("[NaN]", "NaN"),
        ("[Infinity]", "Infinity"),
        ("[1e400]", "out of range"),
        ("[" + "9" * 5000 + "]", "out of range"),
        ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "nested deeper"),
        ('["\\ud800"]', "surrogate"),
        (b'["\xff"]', "not UTF-8"),
    ]:
        with pytest.raises(SlimtuneError, match=expected):
            loads_json(text, "f.json")
    assert loads_json("[" * MAX_DEPTH + "]" * MAX_DEPTH, "f.json") is not None
    assert loads_json('{"n": 18446744073709551615, "m": -0}', "f.json") == {"n": 2**64 - 1, "m": 0.0}
    with pytest.raises(SlimtuneError, match="expected a JSON object, found array"):
        loads_json("[]", "f.json", expect=dict)


def test_safe_name_prints_anything():
    assert safe_name("model.w") == "model.w"
    assert safe_name("a\ud800b") == "a\\ud800b"
    assert safe_name("a\nb") == "a\\nb"
    safe_name("x\udc00").encode("utf-8")


def _with_extra_tensors(src, dst, extra):
    shutil.copytree(src, dst)
    (weights,) = list(dst.glob("*.safetensors"))
    tensors = load_file(weights)
    save_file({**tensors, **extra}, weights, metadata={"format": "pt"})
    return dst


def test_merge_passes_reference_dtypes_and_empty_tensors_through(tiny_base, tmp_path):
    """A base with U16/U64/fp8/complex tensors and a [2**62, 0] tensor merges (no cast, no hang) and the
    output opens with the reference library."""
    from slimtune.merge import merge_from_files
    from slimtune.verify import verify_checkpoint

    extra = {
        "extra.u16": torch.tensor([[1, 2, 3], [4, 5, 65535]], dtype=torch.uint16),
        "extra.u64": torch.tensor([2**63 + 1], dtype=torch.uint64),
        "extra.f8": torch.randn(4, 2).to(torch.float8_e4m3fn),
        "extra.c64": torch.randn(3, dtype=torch.complex64),
        "extra.huge_empty": torch.empty(2**62, 0, dtype=torch.bfloat16),
        "extra.last_empty": torch.empty(4, 0, dtype=torch.bfloat16),
    }
    base = _with_extra_tensors(tiny_base, tmp_path / "base", extra)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}))
    q = load_file(next(base.glob("*.safetensors")))["model.layers.0.self_attn.q_proj.weight"]
    save_file(
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(2, q.shape[1]),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(q.shape[0], 2),
        },
        adapter / "adapter_model.safetensors",
    )
    out = tmp_path / "merged"
    merge_from_files(MergeSource(base, adapter), out, WriteOptions(dtype="fp32", progress=False))
    merged = {}
    for f in sorted(out.glob("model-*.safetensors")):
        assert _verdict_reference(f.read_bytes())
        merged.update(load_file(f))
    for k, v in extra.items():
        expected = torch.float32 if v.dtype == torch.bfloat16 else v.dtype  # only compute floats are cast
        assert merged[k].dtype == expected and merged[k].shape == v.shape, k
        assert torch.equal(merged[k].reshape(-1).view(torch.uint8), v.to(expected).reshape(-1).view(torch.uint8)), k
    assert merged["model.norm.weight"].dtype == torch.float32
    report = verify_checkpoint(out, MergeSource(base, adapter), progress=False)
    assert report.ok, report.problems


def test_header_length_limit_is_the_references(tmp_path):
    path = tmp_path / "big.safetensors"
    path.write_bytes(struct.pack("<Q", 100_000_001) + b"{}")
    with pytest.raises(SlimtuneError, match="over the format's limit"):
        read_header(path)


# --- exit statuses -----------------------------------------------------------------------------------
def _cli(argv, capsys):
    from slimtune.cli import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_exit_status_2_one_line_for_bad_input_even_with_unprintable_names(tmp_path, capsys):
    odd = tmp_path / os.fsdecode(b"bad\xff\xfe.safetensors")  # a name with undecodable bytes (lone surrogates)
    odd.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    code, out, err = _cli(["inspect", odd], capsys)
    assert code == 2 and err.startswith("slimtune inspect: error:") and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err
    for size in ("abc", "nanGB", "1e400GB", "-5GB", "0"):
        code, out, err = _cli(
            ["merge", "--base", tmp_path, "--adapter", tmp_path, "--out", tmp_path / "o", "--max-shard-size", size], capsys
        )
        assert code == 2 and "max-shard-size" in err and "Traceback" not in err, (size, err)


def test_exit_status_1_only_for_problems_found_and_3_for_internal_errors(tmp_path, capsys, monkeypatch):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"w": torch.ones(2)}, ckpt / "model.safetensors")
    (ckpt / "slimtune_manifest.json").write_text(
        json.dumps({"format": "slimtune-checkpoint/1", "files": [{"path": "model.safetensors", "size": 1, "sha256": "0" * 64}]})
    )
    code, out, err = _cli(["verify", ckpt], capsys)
    assert code == 1 and "FAIL" in out and "Traceback" not in out + err

    import slimtune.inspection

    def boom(path):
        raise RuntimeError("unexpected\nsecond line")

    monkeypatch.setattr(slimtune.inspection, "inspect_path", boom)
    monkeypatch.delenv("SLIMTUNE_DEBUG", raising=False)
    code, out, err = _cli(["inspect", ckpt], capsys)
    assert code == 3 and len(err.strip().splitlines()) == 1 and "internal error: RuntimeError" in err and "report" in err
    monkeypatch.setenv("SLIMTUNE_DEBUG", "1")
    code, out, err = _cli(["inspect", ckpt], capsys)
    assert code == 3 and "Traceback" in err


def test_index_config_and_shard_faults_are_refused_before_anything_is_built(tmp_path):
    from slimtune.formats.hf import checkpoint_files, read_config_dict, read_model_config

    d = tmp_path / "m"
    d.mkdir()
    save_file({"a": torch.zeros(2)}, d / "one.safetensors")
    save_file({"a": torch.ones(2)}, d / "two.safetensors")
    with pytest.raises(SlimtuneError, match="tensor a is in both one.safetensors and two.safetensors"):
        checkpoint_files(d)
    index_faults = [
        (None, "weight_map must be an object"),
        ([], "weight_map must be"),
        ({"a": 5}, "expected a file name"),
        ({"a": "../x"}, "expected a file name"),
        ({"a": "one.safetensors", "b": "one.safetensors"}, "does not hold it"),
    ]
    for weight_map, needle in index_faults:
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(SlimtuneError, match=needle):
            checkpoint_files(d)
    (d / "config.json").mkdir()
    with pytest.raises(SlimtuneError, match="not a regular file"):
        read_config_dict(d)
    (d / "config.json").rmdir()
    good = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 300}
    huge = {
        "hidden_size": 131072,
        "intermediate_size": 1 << 20,
        "num_hidden_layers": 1024,
        "vocab_size": 1 << 22,
        "num_local_experts": 4096,
    }
    config_faults = [
        ({"hidden_size": 10**9}, "hidden_size must be an integer in"),
        ({"num_hidden_layers": 10**6}, "num_hidden_layers"),
        ({"head_dim": 1e9}, "head_dim"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"vocab_size": "300"}, "vocab_size"),
        ({"num_attention_heads": True}, "num_attention_heads"),
        ({"hidden_size": 65}, "not a multiple"),
        ({"model_type": None}, "model_type"),
        (huge, "parameters"),
    ]
    for change, needle in config_faults:
        (d / "config.json").write_text(json.dumps({**good, **change}))
        with pytest.raises(SlimtuneError, match=needle):
            read_model_config(d)
    (d / "config.json").write_text("[]")
    with pytest.raises(SlimtuneError, match="expected a JSON object"):
        read_model_config(d)


# --- values from files that reached torch or transformers unchecked (issue 16) ---------------------------
def _copy_base(tiny_base, dst, config_change=None, files=None):
    shutil.copytree(tiny_base, dst)
    if config_change:
        config = json.loads((dst / "config.json").read_text())
        config_change(config)
        (dst / "config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (dst / name).write_text(text)
    return dst


def _one_line_exit_2(code, err, *needles):
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "internal error" not in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


def test_merge_refuses_a_dimension_torch_cannot_hold_before_writing(tiny_base, tmp_path, capsys):
    """[2**63, 0] is valid safetensors (the reference accepts it) but no torch size: one line, nothing written."""
    base = _with_extra_tensors(tiny_base, tmp_path / "base", {"extra.huge_empty": torch.empty(2**62, 0, dtype=torch.bfloat16)})
    (weights,) = list(base.glob("*.safetensors"))
    data = weights.read_bytes().replace(b"4611686018427387904", b"9223372036854775808", 1)  # same length: header intact
    weights.write_bytes(data)
    assert ("extra.huge_empty", [2**63, 0]) in [(n, i["shape"]) for n, i in safetensors.deserialize(data)]
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}))
    save_file(
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(2, 128),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(128, 2),
        },
        adapter / "adapter_model.safetensors",
    )
    code, out, err = _cli(["merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "out"], capsys)
    _one_line_exit_2(code, err, str(weights), "extra.huge_empty", "[9223372036854775808, 0]", "torch cannot hold")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base"]


def test_lora_rank_larger_than_the_model_is_refused_before_allocating(tiny_base, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["finetune", "--config", "tiny", f"output_dir={out}", f"model.path={tiny_base}", "lora.rank=1000000000"]
    data = [f"dataset.path={tmp_path / 'data.jsonl'}", "dataset.create_builtin=true", "logging.progress_bar=false"]
    code, _, err = _cli([*args, *data], capsys)
    _one_line_exit_2(code, err, "LoRA rank 1000000000 (lora.rank", "more than the whole base model (591,232)")
    assert not out.exists() and not (tmp_path / "data.jsonl").exists()


def _set_rope_type(key):
    def change(c):
        c.pop("rope_parameters", None)
        c[key] = {"rope_type": "weird-rope", "factor": 2.0, "rope_theta": 10000.0}

    return change


@pytest.mark.parametrize(
    "change,needles",
    [
        (lambda c: c.update(hidden_act="gelu_fancy"), ["hidden_act 'gelu_fancy' is not a known activation", "a newer transformers may"]),
        (_set_rope_type("rope_scaling"), ["rope_scaling.rope_type 'weird-rope' is not a known RoPE type", "a newer transformers may"]),
        (_set_rope_type("rope_parameters"), ["rope_parameters.rope_type 'weird-rope'"]),
        (lambda c: c.update(dtype=5), ['dtype must be a dtype name such as "bfloat16", found integer']),
        (lambda c: (c.pop("dtype"), c.update(torch_dtype=5)), ["torch_dtype must be a dtype name"]),
        (lambda c: c.update(dtype="notadtype"), ["dtype must be a dtype name", "'notadtype'"]),
        (lambda c: c["rope_parameters"].update(rope_theta="1e4"), ["rope_parameters.rope_theta must be a number"]),
        (lambda c: c.update(pad_token_id=100000), ["pad_token_id 100000 is not a token of the vocabulary (vocab_size 259)"]),
    ],
)
def test_config_values_transformers_would_trip_on_are_one_line(tiny_base, tmp_path, capsys, change, needles):
    """Each reached a KeyError, TypeError or AssertionError inside transformers or torch (exit 3)."""
    base = _copy_base(tiny_base, tmp_path / "base", change)
    out = tmp_path / "run"
    code, _, err = _cli(["finetune", "--config", "tiny", f"output_dir={out}", f"model.path={base}", "logging.progress_bar=false"], capsys)
    _one_line_exit_2(code, err, f"{base / 'config.json'}: ", *needles)
    assert not out.exists()


@pytest.mark.parametrize(
    "name,change,needle",
    [
        ("tokenizer.json", lambda t: t.pop("added_tokens"), "no usable tokenizer files (KeyError: 'added_tokens')"),
        ("tokenizer_config.json", lambda t: t.update(model_max_length="x"), "model_max_length must be an integer"),
    ],
)
def test_tokenizer_values_that_tripped_transformers_are_one_line(tiny_base, tmp_path, capsys, name, change, needle):
    text = json.loads((tiny_base / name).read_text())
    change(text)
    base = _copy_base(tiny_base, tmp_path / "base", files={name: json.dumps(text)})
    out = tmp_path / "run"
    code, _, err = _cli(["finetune", "--config", "tiny", f"output_dir={out}", f"model.path={base}", "logging.progress_bar=false"], capsys)
    _one_line_exit_2(code, err, str(base), needle)
    assert not out.exists()
