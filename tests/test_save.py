import hashlib
import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from slimtune import save_checkpoint
from slimtune.checkpoint.atomic import MANIFEST_NAME, read_manifest
from slimtune.checkpoint.writer import WriteOptions, _RowSink
from slimtune.errors import SlimtuneError
from slimtune.facts import facts_of
from slimtune.lora import lora_modules, qlora_linears
from slimtune.tiny import DEMO_TEXTS, byte_tokenizer


def read_merged(ckpt: Path) -> dict[str, torch.Tensor]:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(ckpt / shard, "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    assert set(out) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    return out


def reference_merged_weights(model) -> dict[str, torch.Tensor]:
    """Independent of slimtune's stream: torchao's own dequantization, fp32 merge, one bf16 rounding."""
    ref = {}
    for name, m in qlora_linears(model).items():
        w = m.weight.get_original_weight().float()
        if m.lora_a is not None:
            w = w + m.scaling * (m.lora_b.weight.float() @ m.lora_a.weight.float())
        ref[f"{name}.weight"] = w.to(torch.bfloat16)
    return ref


def tree_digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()}


def logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits.float()


@pytest.fixture
def batch():
    tok = byte_tokenizer()
    enc = tok(DEMO_TEXTS[:4], padding=True, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def test_merged_files_equal_independent_reference_and_load_in_transformers(qlora_model, tmp_path, batch):
    ckpt = tmp_path / "ckpt"
    result = save_checkpoint(qlora_model, ckpt, WriteOptions(progress=False))
    merged = read_merged(ckpt)
    reference = reference_merged_weights(qlora_model)
    for name, ref in reference.items():
        assert torch.equal(merged[name].view(torch.int16), ref.view(torch.int16)), name
    for name, p in qlora_model.named_parameters():
        if name not in reference and ".lora_" not in name:
            assert torch.equal(merged[name], p.detach()), name
    assert all(t.dtype == torch.bfloat16 for t in merged.values())

    config = json.loads((ckpt / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    assert (ckpt / "tokenizer.json").is_file()

    # manifest lists every file with its size and sha256
    manifest = read_manifest(ckpt)
    listed = {f["path"]: f for f in manifest["files"]}
    on_disk = {k: v for k, v in tree_digest(ckpt).items() if k != MANIFEST_NAME}
    assert set(listed) == set(on_disk)
    for path, digest in on_disk.items():
        assert listed[path]["sha256"] == digest and listed[path]["size"] == (ckpt / path).stat().st_size
    assert result.total_bytes == sum(f["size"] for f in manifest["files"])

    # transformers loads it; its logits match the in-memory QLoRA model. Tolerance: the two differ only
    # by the one bf16 rounding of each merged weight (QLoRA keeps W and the LoRA term apart) plus bf16
    # activations, so we require the gap to be a small fraction of the adapters' own effect on the logits.
    reloaded = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16).eval()
    mask = batch["attention_mask"].bool()
    qlora = logits(qlora_model, batch)[mask]
    gap = (logits(reloaded, batch)[mask] - qlora).abs().max().item()
    for m in lora_modules(qlora_model).values():
        m.scaling, m._saved = 0.0, m.scaling
    lora_effect = (logits(qlora_model, batch)[mask] - qlora).abs().max().item()
    for m in lora_modules(qlora_model).values():
        m.scaling = m._saved
    assert gap < 0.1, gap
    assert gap < 0.2 * lora_effect, (gap, lora_effect)


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_merged_forward_is_the_merged_save(qlora_model, tmp_path, batch, dtype):
    """merged_forward (what eval_loss_merged evaluates) makes each merged weight bit for bit as the save
    writes it, in bounded memory (one layer at a time), and the QLoRA model run that way gives the logits
    of the merged checkpoint reloaded in transformers."""
    from slimtune.checkpoint.fidelity import merged_forward

    save_checkpoint(qlora_model, tmp_path / "ckpt", WriteOptions(dtype=dtype, progress=False))
    saved = read_merged(tmp_path / "ckpt")
    with merged_forward(qlora_model, dtype):
        for name, m in qlora_linears(qlora_model).items():
            w = m.merged_weight()
            assert w.dtype == saved[f"{name}.weight"].dtype and torch.equal(w.view(torch.uint8), saved[f"{name}.weight"].view(torch.uint8))
        merged_logits = logits(qlora_model, batch)
    assert all(m.merged_weight is None for m in qlora_linears(qlora_model).values())
    adapter_logits = logits(qlora_model, batch)
    if dtype is None:  # bf16 everywhere: the same model transformers loads, the same kernels
        reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"), dtype=torch.bfloat16).eval()
        assert torch.equal(merged_logits, logits(reloaded, batch))
    assert not torch.equal(merged_logits, adapter_logits)  # the rounding of W' + s B A is visible


def test_peft_merge_and_unload_agrees_with_slimtune(qlora_model, tiny_base, tmp_path):
    peft = pytest.importorskip("peft")
    ckpt = tmp_path / "ckpt"
    save_checkpoint(qlora_model, ckpt, WriteOptions(progress=False))
    # PEFT's oracle: its own loader applies slimtune's adapter files to the dequantized base
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(tiny_base)), dtype=torch.bfloat16)
    state = {k: v.detach().clone() for k, v in qlora_model.state_dict().items() if ".lora_" not in k}
    for name, m in qlora_linears(qlora_model).items():
        state[f"{name}.weight"] = m.weight.get_original_weight()
    base.load_state_dict(state, strict=False)
    merged_by_peft = peft.PeftModel.from_pretrained(base, str(ckpt / "adapter")).merge_and_unload()
    theirs = merged_by_peft.state_dict()
    ours = read_merged(ckpt)
    exact = 0
    for name, t in ours.items():
        diff = (t.double() - theirs[name].double()).abs()
        one_ulp = (t.double().abs() * 2**-7).clamp_min(1e-30)  # bf16 has 8 significant bits
        assert (diff <= one_ulp).all(), name
        exact += torch.equal(t, theirs[name])
    assert exact == len(ours)  # same fp32 math, one rounding: bit-identical in practice


def test_adapter_only_and_sharding(qlora_model, tmp_path):
    adapter_only = tmp_path / "a"
    save_checkpoint(qlora_model, adapter_only, WriteOptions(adapter_only=True, progress=False))
    files = {p.relative_to(adapter_only).as_posix() for p in adapter_only.rglob("*") if p.is_file()}
    assert files == {"adapter/adapter_config.json", "adapter/adapter_model.safetensors", MANIFEST_NAME}
    cfg = json.loads((adapter_only / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16 and cfg["peft_type"] == "LORA"
    with safe_open(adapter_only / "adapter" / "adapter_model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert len(keys) == 2 * len(lora_modules(qlora_model))

    sharded = tmp_path / "s"
    save_checkpoint(qlora_model, sharded, WriteOptions(max_shard_size="300KB", progress=False))
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    for p in sharded.glob("model-*.safetensors"):
        assert p.stat().st_size < 300_000 + 100_000  # one tensor may exceed the limit only when alone
    assert read_merged(sharded).keys() == read_merged_single(qlora_model, tmp_path).keys()
    AutoModelForCausalLM.from_pretrained(str(sharded))


def read_merged_single(model, tmp_path):
    out = tmp_path / "single"
    if not out.exists():
        save_checkpoint(model, out, WriteOptions(progress=False))
    return read_merged(out)


def test_failure_mid_save_leaves_earlier_checkpoint_intact(qlora_model, tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    save_checkpoint(qlora_model, ckpt, WriteOptions(progress=False))
    before = tree_digest(ckpt)
    calls = {"n": 0}
    original = _RowSink.write

    def failing_write(self, chunk):
        calls["n"] += 1
        if calls["n"] == 20:
            raise OSError(28, "No space left on device (injected)")
        return original(self, chunk)

    monkeypatch.setattr(_RowSink, "write", failing_write)
    with torch.no_grad():
        for m in lora_modules(qlora_model).values():
            m.lora_b.weight.add_(1.0)  # the new save would differ
    with pytest.raises(SlimtuneError, match=r"cannot write .*ckpt: no space left on device \(needs [0-9,]+ bytes, [0-9,]+ are free\)"):
        save_checkpoint(qlora_model, ckpt, WriteOptions(overwrite=True, progress=False))
    assert calls["n"] >= 20  # the other file lane may write the chunks it had in hand before it stops
    assert tree_digest(ckpt) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # temporary sibling removed


def test_refuses_existing_directory_and_short_disk(qlora_model, tmp_path, monkeypatch):
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    with pytest.raises(SlimtuneError, match="already exists"):
        save_checkpoint(qlora_model, existing, WriteOptions(progress=False))
    assert (existing / "keep.txt").read_text() == "mine"

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(SlimtuneError, match=r"needs [\d,]+ bytes .* 1,000 bytes are free"):
        save_checkpoint(qlora_model, tmp_path / "new", WriteOptions(progress=False))
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]


FAMILY_CONFIGS = {
    "llama-tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=64)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),  # q/k/v carry biases
}


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_model_families_load_save_and_reload(family, tmp_path, batch):
    import transformers

    from slimtune.lora import LoRAConfig
    from slimtune.model import load_qlora_model
    from tests.conftest import perturb_adapters

    cls_name, extra = FAMILY_CONFIGS[family]
    common = dict(
        vocab_size=259,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        pad_token_id=256,
        dtype="bfloat16",
    )
    config = getattr(transformers, cls_name)(**common, **extra)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "base")
    model = load_qlora_model(tmp_path / "base", LoRAConfig(rank=4, alpha=8, use_rslora=True), progress=False).eval()
    perturb_adapters(model)
    save_checkpoint(model, tmp_path / "ckpt", WriteOptions(progress=False))
    merged = read_merged(tmp_path / "ckpt")
    if config.tie_word_embeddings:
        assert "lm_head.weight" not in merged
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"), dtype=torch.bfloat16).eval()
    assert type(reloaded).__name__ == type(model).__name__
    mask = batch["attention_mask"].bool()
    gap = (logits(reloaded, batch)[mask] - logits(model, batch)[mask]).abs().max().item()
    assert gap < 0.1, gap


def test_config_comes_from_the_base_or_from_the_model_when_the_base_is_gone(qlora_model, tiny_base, tmp_path, caplog):
    qlora_model.config.use_cache = False  # as during training
    save_checkpoint(qlora_model, tmp_path / "a", WriteOptions(progress=False))
    base = json.loads((tiny_base / "config.json").read_text())
    written = json.loads((tmp_path / "a" / "config.json").read_text())
    assert written == {**base, "dtype": "bfloat16", "torch_dtype": "bfloat16"}  # the base's config.json, use_cache as there
    facts_of(qlora_model).source_dir = tmp_path / "moved"
    save_checkpoint(qlora_model, tmp_path / "b", WriteOptions(progress=False))
    assert "config.json written from the model's config instead" in caplog.text
    config = AutoConfig.from_pretrained(tmp_path / "b")
    assert config.model_type == "llama" and config.hidden_size == base["hidden_size"] and "quantization_config" not in config.to_dict()
