"""GGUF LoRA adapters (slimtune.gguf.adapter, ``slimtune export --adapter-only``) checked by llama.cpp: the
adapter applied by llama.cpp to the base's f16 GGUF (``Llama(model_path=base, lora_path=adapter)``) gives
logits within the bf16 export's bound (test_gguf.LOGIT_BOUND std) of transformers' fp32 forward of the
PEFT-merged model, and the same greedy continuation but for near-ties (test_gguf.check_close_and_greedy).
The adapter has every scaling PEFT has (rsLoRA, rank_pattern, alpha_pattern: folded into B) and an
embedding LoRA (A stored transposed); Llama's Q/K row permutation reaches B's rows. DoRA, a mix type and
a missing base are one line, exit 2, nothing at --out."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from slimtune.cli import main as slimtune_main
from tests import test_gguf
from tests.test_gguf import LOGIT_BOUND, PROMPT, Reader, check_close_and_greedy, cpp_logits, export, hf_logits, llama_cpp

family_dirs = test_gguf.family_dirs  # the tiny family models, a session fixture

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"]


def _adapter(base, out, **settings) -> None:
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(**{"target_modules": TARGETS, **settings}))
    torch.manual_seed(3)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n or "lora_embedding" in n:
                p.normal_(0, 0.05)
    peft_model.save_pretrained(out / "adapter")
    peft_model.merge_and_unload().save_pretrained(out / "merged")  # fp32: PEFT's own merge, the reference


@pytest.fixture(scope="module")
def adapter_dir(family_dirs, tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf-adapter")
    settings = dict(r=4, lora_alpha=8, use_rslora=True, rank_pattern={"down_proj": 2}, alpha_pattern={"v_proj": 4.0})
    _adapter(family_dirs("llama"), d, **settings)
    return d


def load_with(base_gguf, adapter_gguf):
    return llama_cpp.Llama(str(base_gguf), lora_path=str(adapter_gguf), logits_all=True, verbose=False, n_ctx=256, n_threads=2)


def test_llama_cpp_applies_the_adapter_to_the_base_gguf(family_dirs, adapter_dir, tmp_path):
    base = family_dirs("llama")
    assert AutoModelForCausalLM.from_pretrained(base).config.tie_word_embeddings is False  # the embedding LoRA changes only the input
    base_gguf = export(base, "f16", tmp_path / "model-f16.gguf")
    out = tmp_path / "adapter-f32.gguf"
    args = ["export", "--adapter-only", "--base", str(base), "--adapter", str(adapter_dir / "adapter"), "--type", "f32", "--out", str(out)]
    assert slimtune_main([*args, "--base-gguf", "model-f16.gguf"]) == 0
    reader = Reader(out)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert fields == {
        "general.architecture": "llama",
        "general.type": "adapter",
        "adapter.type": "lora",
        "adapter.lora.alpha": 8.0,
        "general.quantization_version": 2,
    }
    names = {t.name: [int(x) for x in t.shape] for t in reader.tensors}  # GGUF shapes: row length first
    assert names["blk.0.attn_q.weight.lora_a"] == [128, 4] and names["blk.0.attn_q.weight.lora_b"] == [4, 128]
    assert names["blk.1.ffn_down.weight.lora_a"] == [256, 2]  # rank_pattern
    assert names["token_embd.weight.lora_a"] == [4, 49152] and names["token_embd.weight.lora_b"] == [4, 128]
    assert len(names) == 2 * (7 * 2 + 1)
    modelfile = (tmp_path / "Modelfile").read_text().splitlines()
    assert modelfile[:2] == ["FROM ./model-f16.gguf", "ADAPTER ./adapter-f32.gguf"]
    check_close_and_greedy(load_with(base_gguf, out), adapter_dir / "merged")  # measured 0.0018 std (bound 0.03)
    # f16 pairs (the type convert_lora_to_gguf.py writes with --outtype f16): the same bound
    half = tmp_path / "adapter-f16.gguf"
    assert slimtune_main([*args[:-4], "--out", str(half)]) == 0  # the default --type, f16
    assert {t.tensor_type.name for t in Reader(half).tensors} == {"F16"}
    hf = hf_logits(adapter_dir / "merged", PROMPT)  # the logits alone (the greedy check above): the test budget
    assert float(np.abs(cpp_logits(load_with(base_gguf, half), PROMPT) - hf).max()) / float(hf.std()) <= LOGIT_BOUND  # measured 0.0030


def test_bad_adapter_exports_are_one_line_exit_2_nothing_written(family_dirs, adapter_dir, tmp_path, capsys):
    base = family_dirs("llama")
    out = tmp_path / "a.gguf"
    dora = tmp_path / "dora"
    dora.mkdir()
    _adapter(base, dora, r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj"])
    cases = [
        (["--base", str(base), "--adapter", str(dora / "adapter")], "DoRA"),
        (["--base", str(base), "--adapter", str(adapter_dir / "adapter"), "--type", "q4_k_m"], "f32, f16, bf16, q8_0"),
        (["--adapter", str(adapter_dir / "adapter"), str(adapter_dir)], "--base"),
    ]
    for extra, word in cases:
        capsys.readouterr()
        assert slimtune_main(["export", "--adapter-only", "--out", str(out), *extra]) == 2, word
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and word in err, err
        assert not out.exists() and not list(tmp_path.glob(".a.gguf*")) and not (tmp_path / "Modelfile").exists()
