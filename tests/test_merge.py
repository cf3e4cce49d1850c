"""Offline merge against the real PEFT library, bitsandbytes-layout bases, bad input, verify and inspect."""

import json
import shutil
import struct
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config

from slimtune.checkpoint.writer import WriteOptions
from slimtune.errors import SlimtuneError
from slimtune.formats.merge_source import MergeSource
from slimtune.merge import merge_from_files
from slimtune.quant.nf4 import quantize_nf4
from tests.conftest import run_cli

peft = pytest.importorskip("peft")


def read_dir(path):
    out = {}
    for f in sorted(path.glob("model-*.safetensors")):
        out.update(load_file(f))
    return out


def make_peft_adapter(base_dir, out_dir, seed=0, **lora_kwargs):
    """A PEFT adapter made and saved by PEFT itself, with non-trivial (as if trained) weights."""
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.bfloat16)
    config = peft.LoraConfig(task_type="CAUSAL_LM", **lora_kwargs)
    model = peft.get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.05)
            elif "lora_magnitude_vector" in name:
                p.mul_(1 + 0.1 * torch.rand(p.shape, generator=gen).to(p.dtype))
    model.save_pretrained(str(out_dir))
    return model


def peft_reference(base_dir, adapter_dir):
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    return model


KINDS = {
    "plain": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "rslora": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj", "up_proj"]),
    "modules_to_save+patterns": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        modules_to_save=["lm_head"],
        rank_pattern={"v_proj": 2},
        alpha_pattern={"layers.1.self_attn.q_proj": 3},
    ),
}
# Tolerances against PEFT's merge_and_unload (bf16 base, fp32 adapters): LoRA is the same fp32 sum
# rounded once, so at most one bf16 ulp (2^-8 relative); DoRA's norm is computed in a different order
# (PEFT: in fp32 from the bf16 weight, then the product rounded in bf16), so two ulps.
ULPS = {"plain": 1, "rslora": 1, "dora": 2, "modules_to_save+patterns": 1}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_merge_matches_peft_merge_and_unload(kind, tiny_base, tmp_path):
    adapter = tmp_path / "adapter"
    make_peft_adapter(tiny_base, adapter, **KINDS[kind])
    merge_from_files(MergeSource(tiny_base, adapter), tmp_path / "merged", WriteOptions(progress=False))
    ours = read_dir(tmp_path / "merged")
    reference = peft_reference(tiny_base, adapter)
    theirs = reference.merge_and_unload().state_dict()
    worst = 0.0
    for name, t in ours.items():
        diff = (t.double() - theirs[name].double()).abs()
        allowed = ULPS[kind] * t.double().abs().clamp_min(theirs[name].double().abs()) * 2**-8 + 1e-30
        assert (diff <= allowed).all(), (name, diff.max().item())
        worst = max(worst, diff.max().item())
    assert set(ours) == {k for k in theirs if k != "lm_head.weight" or "lm_head.weight" in ours}
    print(f"{kind}: max |diff| vs peft merge_and_unload = {worst:.3g}")

    # the merged directory loads in plain transformers and gives the PeftModel's logits
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        unmerged = peft_reference(tiny_base, adapter)(input_ids=ids).logits.float()
        gap = (merged(input_ids=ids).logits.float() - unmerged).abs().max().item()
    print(f"{kind}: max |logit diff| merged vs PeftModel = {gap:.3g}")
    assert gap < 0.1  # bf16 weights rounded once vs PEFT's unmerged bf16 forward


def test_fan_in_fan_out_gpt2(tmp_path):
    config = GPT2Config(vocab_size=259, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "base")
    make_peft_adapter(tmp_path / "base", tmp_path / "adapter", r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    merge_from_files(MergeSource(tmp_path / "base", tmp_path / "adapter"), tmp_path / "merged", WriteOptions(progress=False))
    ours = read_dir(tmp_path / "merged")
    theirs = peft_reference(tmp_path / "base", tmp_path / "adapter").merge_and_unload().state_dict()
    for name, t in ours.items():
        allowed = t.double().abs() * 2**-8 + 1e-30
        assert ((t.double() - theirs[name].double()).abs() <= allowed).all(), name


def test_merge_base_quantized_is_torchao_nf4_of_the_base(tiny_base, tmp_path):
    adapter = tmp_path / "adapter"
    make_peft_adapter(tiny_base, adapter, r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    merge_from_files(MergeSource(tiny_base, adapter, "quantized"), tmp_path / "q", WriteOptions(dtype="fp32", progress=False))
    merged = read_dir(tmp_path / "q")
    base = load_file(tiny_base / "model.safetensors")
    lora = load_file(adapter / "adapter_model.safetensors")
    key = "model.layers.1.mlp.down_proj"
    a = lora[f"base_model.model.{key}.lora_A.weight"].float()
    b = lora[f"base_model.model.{key}.lora_B.weight"].float()
    expected = quantize_nf4(base[f"{key}.weight"]).get_original_weight().float() + 2.0 * (b @ a)
    assert torch.allclose(merged[f"{key}.weight"], expected, rtol=1e-6, atol=1e-6)
    assert merged["model.norm.weight"].dtype == torch.float32
    assert json.loads((tmp_path / "q" / "config.json").read_text())["torch_dtype"] == "float32"


# --- bitsandbytes layout ---------------------------------------------------------------------------
BNB_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635, -0.18477343022823334,
           -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
           0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]  # fmt: skip


def write_bnb_base(src_dir, out_dir, targets, nested: bool):
    """A load_in_4bit-style checkpoint written by hand from the documented layout; returns the values
    the documented dequantization gives, computed independently here."""
    shutil.copytree(src_dir, out_dir)
    state = load_file(src_dir / "model.safetensors")
    quant_map = torch.tensor(BNB_NF4)
    expected = {}
    for key in [k for k in state if any(f".{t}." in k for t in targets)]:
        w = state[key].float()
        flat = w.flatten()
        blocks = flat.view(-1, 64)
        absmax = blocks.abs().amax(dim=1)
        codes = (blocks / absmax[:, None]).unsqueeze(-1).sub(quant_map).abs().argmin(-1).flatten().to(torch.uint8)
        packed = (codes[0::2] << 4 | codes[1::2]).view(-1, 1)
        state[key] = packed
        state[key + ".quant_map"] = quant_map.clone()
        qs = {"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": list(w.shape)}
        if nested:
            offset = absmax.mean().item()
            centred = absmax - offset
            nested_map = torch.linspace(-1, 1, 256)
            nested_absmax = centred.view(-1, 256).abs().amax(dim=1) if centred.numel() % 256 == 0 else centred.abs().amax().view(1)
            idx = torch.arange(centred.numel()) // 256
            scaled = centred / nested_absmax[idx]
            q_absmax = scaled.unsqueeze(-1).sub(nested_map).abs().argmin(-1).to(torch.uint8)
            state[key + ".absmax"] = q_absmax
            state[key + ".nested_absmax"] = nested_absmax
            state[key + ".nested_quant_map"] = nested_map.clone()
            qs.update(nested_blocksize=256, nested_offset=offset, nested_dtype="float32")
            real_absmax = nested_map[q_absmax.long()] * nested_absmax[idx] + offset
        else:
            state[key + ".absmax"] = absmax
            real_absmax = absmax
        state[key + ".quant_state.bitsandbytes__nf4"] = torch.tensor(list(json.dumps(qs).encode()), dtype=torch.uint8)
        expected[key] = (quant_map[codes.long()].view(-1, 64) * real_absmax[:, None]).view(w.shape).to(torch.bfloat16)
    (out_dir / "model.safetensors").unlink()
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    (out_dir / "config.json").write_text(json.dumps(config))
    return expected


@pytest.mark.parametrize("nested", [True, False])
def test_bitsandbytes_nf4_base_dequantizes_to_documented_values(tiny_base, tmp_path, nested):
    expected = write_bnb_base(tiny_base, tmp_path / "bnb", ["q_proj", "gate_proj", "down_proj"], nested)
    adapter = tmp_path / "adapter"
    make_peft_adapter(tiny_base, adapter, r=4, lora_alpha=8, target_modules=["q_proj"])
    merge_from_files(MergeSource(tmp_path / "bnb", adapter), tmp_path / "merged", WriteOptions(progress=False))
    merged = read_dir(tmp_path / "merged")
    lora = load_file(adapter / "adapter_model.safetensors")
    for key, values in expected.items():
        if ".q_proj." in key:
            module = key[: -len(".weight")]
            a = lora[f"base_model.model.{module}.lora_A.weight"]
            b = lora[f"base_model.model.{module}.lora_B.weight"]
            values = (values.float() + 2.0 * (b @ a)).to(torch.bfloat16)
        assert torch.equal(merged[key], values), key
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in config
    assert not any(k.endswith((".absmax", ".quant_map")) or "quant_state" in k for k in merged)
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))


# --- bad input -------------------------------------------------------------------------------------
@pytest.fixture
def adapter_dir(tiny_base, tmp_path):
    path = tmp_path / "adapter"
    make_peft_adapter(tiny_base, path, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return path


def merge_cli(base, adapter, out, *extra):
    return run_cli("merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), *extra)


def assert_fails(result, *needles):
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("slimtune merge: error:"), result.stderr[-2000:]
    for needle in needles:
        assert needle in message, (needle, message)


def test_bad_base_files(tiny_base, adapter_dir, tmp_path):
    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_base, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:-1000])
    assert_fails(merge_cli(truncated, adapter_dir, tmp_path / "o1"), "model.safetensors", "truncated")

    lying = tmp_path / "lying"
    shutil.copytree(tiny_base, lying)
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] -= 2
    body = json.dumps(header).encode()
    (lying / "model.safetensors").write_bytes(struct.pack("<Q", len(body)) + body + data[8 + n :])
    assert_fails(merge_cli(lying, adapter_dir, tmp_path / "o2"), "model.safetensors", name)

    binary = tmp_path / "binary"
    binary.mkdir()
    shutil.copy(tiny_base / "config.json", binary)
    (binary / "pytorch_model.bin").write_bytes(b"x")
    assert_fails(merge_cli(binary, adapter_dir, tmp_path / "o3"), ".bin", "convert")
    assert not any((tmp_path / f"o{i}").exists() for i in (1, 2, 3))


def test_bad_adapters(tiny_base, adapter_dir, tmp_path):
    shapes = tmp_path / "shapes"
    shutil.copytree(adapter_dir, shapes)
    state = load_file(shapes / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    state[key] = torch.zeros(4, 96)
    save_file(state, shapes / "adapter_model.safetensors")
    assert_fails(merge_cli(tiny_base, shapes, tmp_path / "o1"), "model.layers.0.self_attn.q_proj", "[4, 96]")

    missing = tmp_path / "missing"
    shutil.copytree(adapter_dir, missing)
    state = load_file(missing / "adapter_model.safetensors")
    state["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 128)
    state["base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight"] = torch.zeros(128, 4)
    save_file(state, missing / "adapter_model.safetensors")
    assert_fails(merge_cli(tiny_base, missing, tmp_path / "o2"), "model.layers.7.self_attn.q_proj", "missing from base")

    no_r = tmp_path / "no_r"
    shutil.copytree(adapter_dir, no_r)
    config = json.loads((no_r / "adapter_config.json").read_text())
    del config["r"]
    (no_r / "adapter_config.json").write_text(json.dumps(config))
    assert_fails(merge_cli(tiny_base, no_r, tmp_path / "o3"), "adapter_config.json", "'r'")
    assert not any((tmp_path / f"o{i}").exists() for i in (1, 2, 3))


def test_existing_output_needs_overwrite(tiny_base, adapter_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert_fails(merge_cli(tiny_base, adapter_dir, out), "already exists", "--overwrite")
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    r = merge_cli(tiny_base, adapter_dir, out, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert not (out / "mine.txt").exists() and (out / "slimtune_manifest.json").is_file()


def test_api_rejects_unknown_merge_base(tiny_base, adapter_dir, tmp_path):
    with pytest.raises(SlimtuneError, match="merge base"):
        merge_from_files(MergeSource(tiny_base, adapter_dir, "fancy"), tmp_path / "x")


# --- verify and inspect ----------------------------------------------------------------------------
def test_verify_passes_then_catches_a_flipped_byte_and_a_deleted_shard(tiny_base, adapter_dir, tmp_path):
    out = tmp_path / "merged"
    assert merge_cli(tiny_base, adapter_dir, out, "--max-shard-size", "400KB").returncode == 0
    ok = run_cli("verify", str(out), "--base", str(tiny_base), "--adapter", str(adapter_dir))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "OK" in ok.stdout and "max |diff|" in ok.stdout

    shard = sorted(out.glob("model-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    bad = run_cli("verify", str(out), "--base", str(tiny_base), "--adapter", str(adapter_dir))
    assert bad.returncode == 1
    assert f"{shard}: sha256 differs" in bad.stdout
    assert "differs from the recomputed merge" in bad.stdout  # the recomputation finds the changed value too

    shard.unlink()
    gone = run_cli("verify", str(out))
    assert gone.returncode == 1
    assert f"{shard}: listed in the manifest but missing" in gone.stdout


def test_inspect_checkpoint_and_adapter(tiny_base, tmp_path):
    adapter = tmp_path / "adapter"
    make_peft_adapter(tiny_base, adapter, r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"])
    r = run_cli("inspect", str(adapter))
    assert r.returncode == 0, r.stderr
    assert "r 4" in r.stdout and "rsLoRA True" in r.stdout and "q_proj" in r.stdout
    assert "total: 8 tensors" in r.stdout
    r = run_cli("inspect", str(tiny_base / "model.safetensors"))
    assert "model.embed_tokens.weight" in r.stdout and "BF16" in r.stdout and "total: 21 tensors" in r.stdout
    assert run_cli("inspect", str(tmp_path / "nothing")).returncode == 2


def test_inspect_counts_merged_model_and_adapter_apart(qlora_model, tmp_path):
    from slimtune import save_checkpoint
    from slimtune.inspection import inspect_path

    save_checkpoint(qlora_model, tmp_path / "ckpt", WriteOptions(progress=False))
    totals = [line for line in inspect_path(tmp_path / "ckpt") if line.startswith("total")]
    assert totals[0].startswith("total (merged model): 21 tensors, 591,232 parameters"), totals
    assert totals[1].startswith("total (adapter): 28 tensors, 47,104 parameters"), totals  # r=8 on 14 linears of 128 + in/out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without a GPU")
def test_cuda_merge_without_gpu_is_a_clear_error(tiny_base, adapter_dir, tmp_path):
    assert_fails(merge_cli(tiny_base, adapter_dir, tmp_path / "o", "--device", "cuda"), "--device cuda", "no CUDA device")
    assert not (tmp_path / "o").exists()


def test_bin_adapter_merges_like_safetensors(tiny_base, tmp_path):
    model = make_peft_adapter(tiny_base, tmp_path / "st", r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"])
    model.save_pretrained(str(tmp_path / "bin"), safe_serialization=False)
    assert (tmp_path / "bin" / "adapter_model.bin").is_file() and not (tmp_path / "bin" / "adapter_model.safetensors").exists()
    merge_from_files(MergeSource(tiny_base, tmp_path / "st"), tmp_path / "m1", WriteOptions(progress=False))
    merge_from_files(MergeSource(tiny_base, tmp_path / "bin"), tmp_path / "m2", WriteOptions(progress=False))
    a, b = read_dir(tmp_path / "m1"), read_dir(tmp_path / "m2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _manifest_digests(path) -> dict[str, str]:
    from slimtune.checkpoint.atomic import read_manifest

    return {f["path"]: f["sha256"] for f in read_manifest(path)["files"]}


@pytest.mark.parametrize("dtype", [None, "fp32"])
def test_save_and_offline_merge_of_its_adapter_write_the_same_files(qlora_model, tiny_base, tmp_path, dtype):
    """One canonical tensor order (plan_save) and one config rule (export_config_dict): the in-training
    save and `merge --merge-base quantized` of the adapter it wrote give the same bytes, file by file,
    for every file both write (shards, index, config, tokenizer), though their streams come in different
    orders (the model's and the base files')."""
    from slimtune import save_checkpoint
    from slimtune.tensors import DTYPES

    save_checkpoint(qlora_model, tmp_path / "save", WriteOptions(max_shard_size="300KB", dtype=DTYPES.get(dtype), progress=False))
    adapter = tmp_path / "save" / "adapter"
    merge_from_files(
        MergeSource(tiny_base, adapter, "quantized"), tmp_path / "merged", WriteOptions(dtype=dtype, max_shard_size="300KB", progress=False)
    )
    saved, merged = _manifest_digests(tmp_path / "save"), _manifest_digests(tmp_path / "merged")
    assert set(saved) - set(merged) == {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"}
    assert set(merged) <= set(saved) and {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= set(merged)
    assert len([p for p in merged if p.startswith("model-")]) >= 3  # several shards: the packing order matters too
    assert {p: saved[p] for p in merged} == merged
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == ("float32" if dtype else "bfloat16")
    assert config["use_cache"] is True  # the base's config.json, not the training-time model.config


def test_odd_widths_use_their_own_scaler_blocks_in_load_save_and_offline_merge(tmp_path):
    """A width of 72 (81 blocks per 72 x 72 projection, rows not whole 64-blocks) and an MLP of 200
    (225 blocks): every target is NF4 with the scaler block chosen for it, the in-training merged save is
    torchao's own NF4 of the base with that scaler block + s * B @ A, and `merge --merge-base quantized`
    rebuilds the same NF4 from the files: the same bytes."""
    from slimtune import save_checkpoint
    from slimtune.lora import LoRAConfig, lora_modules
    from slimtune.model import load_qlora_model, nf4_report
    from slimtune.quant.nf4 import to_nf4
    from slimtune.tiny import make_tiny_checkpoint
    from tests.conftest import perturb_adapters

    base = make_tiny_checkpoint(tmp_path / "base", seed=2, hidden_size=72, intermediate_size=200)
    model = load_qlora_model(base, LoRAConfig(rank=4, alpha=8), progress=False).eval()
    perturb_adapters(model)
    report = nf4_report(model)
    assert (report["nf4"], report["targets"], report["kept"]) == (14, 14, {})
    assert report["scaler_blocks"] == {"225": 6, "81": 8}
    assert report["tensors"]["model.layers.0.self_attn.q_proj.weight"] == 81
    save_checkpoint(model, tmp_path / "save", WriteOptions(progress=False))
    merge_from_files(MergeSource(base, tmp_path / "save" / "adapter", "quantized"), tmp_path / "merged", WriteOptions(progress=False))
    saved, merged = _manifest_digests(tmp_path / "save"), _manifest_digests(tmp_path / "merged")
    assert {p: saved[p] for p in merged} == merged
    original = {k: v for f in base.glob("*.safetensors") for k, v in load_file(f).items()}
    written = read_dir(tmp_path / "save")
    m = lora_modules(model)["model.layers.1.mlp.down_proj"]
    key = "model.layers.1.mlp.down_proj.weight"
    oracle = to_nf4(original[key], 64, 225).get_original_weight().float()
    expected = (oracle + m.scaling * (m.lora_b.weight.detach() @ m.lora_a.weight.detach())).to(torch.bfloat16)
    assert torch.equal(written[key].view(torch.int16), expected.view(torch.int16))


def test_targets_that_cannot_be_nf4_keep_their_dtype_and_are_summarised(tmp_path):
    """36 wide: no projection is made of whole 64-element blocks (36 x 36 = 1,296 elements): each keeps
    bf16, and the load's one summary line says how many and why."""
    from slimtune.lora import LoRAConfig
    from slimtune.model import load_qlora_model, nf4_report, nf4_summary_line
    from slimtune.tiny import make_tiny_checkpoint

    sizes = dict(hidden_size=36, intermediate_size=100, num_attention_heads=2, num_key_value_heads=2)
    base = make_tiny_checkpoint(tmp_path / "base", seed=2, **sizes)
    report = nf4_report(load_qlora_model(base, LoRAConfig(rank=2, alpha=4), progress=False))
    assert (report["nf4"], report["targets"], report["scaler_blocks"]) == (0, 14, {})
    assert report["kept"]["model.layers.0.self_attn.q_proj.weight"] == "[36, 36] bfloat16: 1296 elements, not whole 64-element blocks"
    line = nf4_summary_line(report)
    assert line.startswith("NF4: 0 of 14 targets; 14 kept in their dtype: model.layers.0.") and line.endswith(" ...")


def test_a_single_process_merge_lets_go_of_the_base_it_read(tiny_base, adapter_dir, tmp_path, monkeypatch):
    """One process reads each byte of the base once (hashed from its own reads): every tensor's bytes it
    read are dropped from the page cache behind it, so a cold merge larger than memory does not make the
    kernel reclaim in its time."""
    import os

    from slimtune.formats.safetensors import read_header

    dropped = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: (dropped.append((off, n)), real(fd, off, n, advice)))
    merge_from_files(MergeSource(tiny_base, adapter_dir), tmp_path / "merged", WriteOptions(progress=False))
    headers = [read_header(p) for p in sorted(tiny_base.glob("*.safetensors"))]
    spans = {(h.data_start + e.begin, e.nbytes) for h in headers for e in h.tensors.values() if e.nbytes}
    assert spans and spans <= set(dropped)
