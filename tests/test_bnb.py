"""bitsandbytes 4-bit checkpoints (formats/bnb.py) against bitsandbytes itself (0.50 runs 4-bit on the CPU):
checkpoints written by transformers + bitsandbytes (``BitsAndBytesConfig(load_in_4bit=True, ...)``,
``save_pretrained``) of the tiny model, NF4 and FP4, double quantization on and off, quant_storage u8 and bf16;
every 4-bit weight slimtune reads, whole and by row range, equals ``bitsandbytes.functional.dequantize_4bit``
of the same bytes, bit for bit; a merge from such a base reloads in plain transformers; 8-bit bases and
training from a 4-bit base are refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from slimtune.checkpoint.writer import WriteOptions
from slimtune.errors import SlimtuneError
from slimtune.merge import BaseCheckpoint, merge_from_files
from tests.test_merge import make_peft_adapter

bnb = pytest.importorskip("bitsandbytes")
from bitsandbytes.functional import QuantState, dequantize_4bit  # noqa: E402

LAYOUTS = {
    "nf4-u8-double": dict(bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_quant_storage=torch.uint8),
    "fp4-bf16-double": dict(bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True, bnb_4bit_quant_storage=torch.bfloat16),
    "nf4-u8-plain-fp16": dict(bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False, bnb_4bit_compute_dtype=torch.float16),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def bnb_base(request, tiny_base, tmp_path_factory):
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, **LAYOUTS[request.param])
    model = AutoModelForCausalLM.from_pretrained(str(tiny_base), quantization_config=config, device_map="cpu", dtype=torch.bfloat16)
    out = tmp_path_factory.mktemp("bnb") / request.param
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tiny_base / name, out / name)
    return out


def bnb_reference(path, key: str) -> torch.Tensor:
    """bitsandbytes' own dequantization of the weight ``key`` as stored (its QuantState.from_dict reads the file's
    auxiliary tensors, as transformers does when it loads the checkpoint)."""
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        packed = f.get_tensor(key)
        aux = {k[len(key) + 1 :]: f.get_tensor(k) for k in f.keys() if k.startswith(key + ".")}
    return dequantize_4bit(packed, QuantState.from_dict(aux, device=torch.device("cpu")))


def test_every_4bit_weight_is_bitsandbytes_dequantization(bnb_base):
    base = BaseCheckpoint(bnb_base)
    try:
        assert len(base.bnb) == 14  # 2 layers x 7 projections
        for key, weight in base.bnb.items():
            reference = bnb_reference(bnb_base, key)
            whole = base.rows(key, 0, weight.shape[0])
            assert whole.dtype == reference.dtype and torch.equal(whole, reference), key
            rows = weight.shape[0]
            assert torch.equal(base.rows(key, rows // 3, rows // 3 + 5), reference[rows // 3 : rows // 3 + 5]), key
    finally:
        base.close()


def test_a_merge_from_a_4bit_base_is_a_plain_16bit_model(bnb_base, tiny_base, tmp_path):
    adapter = tmp_path / "adapter"
    make_peft_adapter(tiny_base, adapter, r=4, lora_alpha=8, target_modules=["q_proj"])
    merge_from_files(bnb_base, adapter, tmp_path / "merged", WriteOptions(progress=False))
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in config
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.bfloat16)  # plain transformers
    key = "model.layers.1.mlp.down_proj.weight"
    reference = bnb_reference(bnb_base, key)
    assert torch.equal(merged.state_dict()[key], reference.to(merged.dtype))  # the file's weight is the merge base


def test_8bit_bases_and_training_from_4bit_are_refused_in_one_line(bnb_base, tmp_path):
    from slimtune.model import load_qlora_model

    with pytest.raises(SlimtuneError, match="training from one is not supported yet") as e:
        load_qlora_model(bnb_base, progress=False)
    assert "\n" not in str(e.value)
    eight = tmp_path / "eight"
    shutil.copytree(bnb_base, eight)
    config = json.loads((eight / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False}
    (eight / "config.json").write_text(json.dumps(config))
    for load in (BaseCheckpoint, lambda d: load_qlora_model(d, progress=False)):
        with pytest.raises(SlimtuneError, match="a bitsandbytes 8-bit checkpoint .* not 8-bit: use the model's 16-bit checkpoint"):
            load(eight)
