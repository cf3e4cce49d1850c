"""Every supported model family (slimtune.families.FAMILIES, the same list the README table comes from):
a tiny random model written by transformers with a chat-template tokenizer, loaded as QLoRA with the
default targets (all-linear), trained two steps, saved; then the oracles are transformers and PEFT
themselves: (a) the merged save reloads in plain transformers with the in-memory model's logits, (b) PEFT
applies the adapter to the NF4-round-tripped base with the same logits, (c) the same greedy tokens,
(d) `slimtune merge --merge-base quantized` is bit-identical to the in-training merged save (every tensor
and every file both write), (e) the merged and adapter keys are the ones transformers' save_pretrained
and PEFT's save_pretrained write."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from slimtune.checkpoint.atomic import read_manifest
from slimtune.checkpoint.save import save_checkpoint
from slimtune.checkpoint.writer import WriteOptions
from slimtune.cli import main as slimtune_main
from slimtune.errors import SlimtuneError
from slimtune.facts import facts_of
from slimtune.families import FAMILIES, default_targets, family_of, tiny_config
from slimtune.lora import LoRAConfig, lora_modules, lora_parameters
from slimtune.model import load_qlora_model
from slimtune.quant.nf4 import can_quantize, quantize_nf4
from slimtune.tiny import byte_tokenizer

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MESSAGES = [
    {"role": "user", "content": "Name one thing a checkpoint must never do."},
    {"role": "assistant", "content": "Hold the whole model in memory."},
]


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def tensor_keys(path: Path) -> set[str]:
    keys = set()
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            keys |= set(st.keys())
    return keys


def write_base(family, path: Path):
    """What a user brings: transformers' from_config + save_pretrained (bf16), a BPE tokenizer with a chat template."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family)).to(torch.bfloat16)
    model.save_pretrained(path)
    tok = byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return tok


def nf4_round_trip_base(base: Path, out: Path, adapter_keys: set[str]) -> None:
    """The base as QLoRA training saw it: adapter targets and MoE experts through torchao NF4 and back."""
    shutil.copytree(base, out)
    targets = {re.sub(r"^base_model\.model\.", "", k).rsplit(".lora_", 1)[0] + ".weight" for k in adapter_keys}
    (f,) = out.glob("*.safetensors")  # save_pretrained of a tiny model: one file
    tensors = read_tensors(base)
    for k, t in tensors.items():
        if (k in targets or re.search(r"\.experts\.\d+\.", k)) and can_quantize(t.shape):
            tensors[k] = quantize_nf4(t).get_original_weight()
    save_file(tensors, f, metadata={"format": "pt"})


# The merged weights are W_nf4 + s*B@A rounded once to bf16; the QLoRA model keeps the two terms apart.
# Measured on these models: 1.0-1.5 ulps of the largest logit (bf16 activations round at every layer).
TOLERANCE_ULPS = 2.0


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in bf16 ulps of the largest logit (bf16 keeps 8 significant bits)."""
    top = torch.maximum(a.abs(), b.abs()).max().clamp_min(2**-100)
    ulp = 2.0 ** (torch.floor(torch.log2(top)).item() - 7)
    return (a - b).abs().max().item() / ulp


@pytest.mark.parametrize("family", FAMILIES, ids=[f.model_type for f in FAMILIES])
def test_family_end_to_end(family, tmp_path):
    peft = pytest.importorskip("peft")
    base = tmp_path / "base"
    tok = write_base(family, base)
    ids = torch.tensor([tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=False)])
    assert ids.shape[1] > 20

    model = load_qlora_model(base, LoRAConfig(rank=8, alpha=16), seed=0, progress=False)
    assert facts_of(model).targets == default_targets(family.model_type)
    opt = torch.optim.AdamW(lora_parameters(model), lr=1e-2)
    model.train()
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    assert all(p.abs().sum() > 0 for p in lora_parameters(model))
    ckpt = tmp_path / "ckpt"
    save_checkpoint(model, ckpt, WriteOptions(progress=False))
    ours = logits(model, ids)

    # (e) keys: the merged save is what transformers' save_pretrained writes for this family (the base
    # was written by it); the adapter is what PEFT's all-linear get_peft_model + save_pretrained writes.
    assert tensor_keys(ckpt) == tensor_keys(base)
    our_adapter = {k: tuple(v.shape) for k, v in read_tensors(ckpt / "adapter").items()}
    our_config = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())

    def peft_writes(targets, name):
        cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, task_type="CAUSAL_LM")
        peft.get_peft_model(AutoModelForCausalLM.from_config(tiny_config(family)), cfg).save_pretrained(tmp_path / name)
        written = {k: tuple(v.shape) for k, v in read_tensors(tmp_path / name).items()}
        return written, json.loads((tmp_path / name / "adapter_config.json").read_text())

    explicit, explicit_config = peft_writes(sorted(lora_modules(model)), "peft_explicit")
    assert our_adapter == explicit  # PEFT's key names and shapes for these layers
    assert our_config["fan_in_fan_out"] == explicit_config["fan_in_fan_out"]
    all_linear, all_config = peft_writes("all-linear", "peft_all_linear")
    if all_config.get("target_parameters"):
        # MoE: PEFT's all-linear also wraps the fused expert and router *parameters* (target_parameters); slimtune
        # keeps them frozen (README: Model families) and adapts attention and dense layers.
        assert set(all_config["target_modules"]) <= set(facts_of(model).targets)
        assert {k for k in all_linear if any(f".{t}.lora_" in k for t in all_config["target_modules"])} <= set(our_adapter)
    else:
        assert our_adapter == all_linear

    # (a) plain transformers reloads the merged save: logits within one bf16 rounding of the QLoRA model's
    merged = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    assert type(merged) is type(model)
    gap_merged = bf16_ulps(logits(merged, ids), ours)
    assert gap_merged <= TOLERANCE_ULPS, gap_merged

    # (b) PEFT applies our adapter to the NF4-round-tripped base: the same logits
    nf4_round_trip_base(base, tmp_path / "base_nf4", set(our_adapter))
    peft_base = AutoModelForCausalLM.from_pretrained(tmp_path / "base_nf4", dtype=torch.bfloat16)
    peft_model = peft.PeftModel.from_pretrained(peft_base, ckpt / "adapter").eval()
    gap_peft = bf16_ulps(logits(peft_model, ids), ours)
    assert gap_peft <= TOLERANCE_ULPS, gap_peft
    # the tolerance is far below what the trained adapters change (so a wrong or missing merge fails)
    no_adapter = AutoModelForCausalLM.from_pretrained(tmp_path / "base_nf4", dtype=torch.bfloat16).eval()
    assert bf16_ulps(logits(no_adapter, ids), ours) > 8 * TOLERANCE_ULPS

    # (c) greedy generation: the same 8 tokens from the QLoRA model, the merged reload and PEFT
    def greedy(m):
        with torch.no_grad():
            return m.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=256)[0, ids.shape[1] :].tolist()

    tokens = greedy(model)
    assert len(tokens) == 8
    assert greedy(merged) == tokens
    assert greedy(peft_model) == tokens

    # (d) the offline merge of the saved adapter onto the original base, NF4 base: bit-identical
    assert slimtune_main(
        ["merge", "--base", str(base), "--adapter", str(ckpt / "adapter"), "--out", str(tmp_path / "offline"), "--merge-base", "quantized"]
    ) in (0, None)
    offline, saved = read_tensors(tmp_path / "offline"), read_tensors(ckpt)
    assert set(offline) == set(saved)
    for k, t in saved.items():
        assert t.dtype == offline[k].dtype and torch.equal(t.view(torch.uint8), offline[k].view(torch.uint8)), k
    # ... and so is every file both write (shards, index, config, tokenizer): one order, one config rule
    offline_files, saved_files = ({f["path"]: f["sha256"] for f in read_manifest(d)["files"]} for d in (tmp_path / "offline", ckpt))
    assert set(offline_files) == {p for p in saved_files if not p.startswith("adapter/")}
    assert {p: saved_files[p] for p in offline_files} == offline_files


def test_moe_experts_are_nf4_and_stream_per_expert(tmp_path):
    family = family_of("mixtral")
    write_base(family, tmp_path / "base")
    model = load_qlora_model(tmp_path / "base", LoRAConfig(), progress=False)
    experts = model.model.layers[0].mlp.experts
    cfg = tiny_config(family)
    assert len(experts.pieces) == 3 * cfg.num_local_experts  # one per expert and projection, as published
    assert all(type(p).__name__ == "NF4Tensor" for p in experts.pieces.values())
    assert not any(p.requires_grad for p in experts.parameters())


def test_explicit_targets_and_clear_errors(tmp_path):
    write_base(family_of("gpt2"), tmp_path / "gpt2")
    model = load_qlora_model(tmp_path / "gpt2", LoRAConfig(target_modules=["c_attn"]), progress=False)
    assert facts_of(model).targets == ["c_attn"] and model.transformer.h[0].attn.c_attn.fan_in_fan_out
    with pytest.raises(SlimtuneError, match=r"\['q_proj'\] not found in GPT-2 .*c_attn.*all-linear"):
        load_qlora_model(tmp_path / "gpt2", LoRAConfig(target_modules=["q_proj"]), progress=False)
    write_base(family_of("mixtral"), tmp_path / "mixtral")
    with pytest.raises(SlimtuneError, match=r"\['gate'\] not found in Mixtral .*MixtralTopKRouter.*not linear layers"):
        load_qlora_model(tmp_path / "mixtral", LoRAConfig(target_modules=["q_proj", "gate"]), progress=False)


def test_unsupported_architecture_is_one_clear_error(tmp_path):
    (tmp_path / "vit").mkdir()
    (tmp_path / "vit" / "config.json").write_text(json.dumps({"model_type": "vit", "architectures": ["ViTModel"]}))
    with pytest.raises(SlimtuneError, match=r"'vit' has no causal-LM class.*supported families: Llama"):
        load_qlora_model(tmp_path / "vit", LoRAConfig(), progress=False)


def test_cli_error_for_a_non_linear_target_is_one_line_exit_2(tmp_path, capsys):
    write_base(family_of("mixtral"), tmp_path / "base")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": MESSAGES}) + "\n")
    code = slimtune_main(
        ["finetune", "--config", "tiny", f"output_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'base'}"]
        + [f"dataset.path={data}", "lora.target_modules=[q_proj, w1]", "logging.progress_bar=false"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "Mixtral" in err[0] and "['w1']" in err[0] and "no LoRA on experts" in err[0] and "all-linear" in err[0]
    assert not list((tmp_path / "run").glob("step-*"))


def test_readme_family_table_comes_from_families():
    from slimtune.families import family_table

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert family_table() in readme
    assert all(f"| {f.name} |" in family_table() for f in FAMILIES)


@pytest.mark.parametrize("model_type", ["mixtral", "gpt2"])
def test_finetune_recipe_with_default_targets(model_type, tmp_path, capsys):
    """`slimtune finetune` on a family's checkpoint with chat data and no target list: all-linear,
    resolved and printed; the step checkpoint is in the family's published layout and reloads."""
    family = family_of(model_type)
    write_base(family, tmp_path / "base")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": MESSAGES}) + "\n" for _ in range(4)))
    config = tmp_path / "run.yaml"
    config.write_text(
        f"output_dir: {tmp_path / 'run'}\nmodel:\n  path: {tmp_path / 'base'}\ndataset:\n  path: {data}\n"
        "training:\n  batch_size: 2\n  max_steps: 2\nlogging:\n  progress_bar: false\n"
    )
    assert slimtune_main(["finetune", "--config", str(config)]) in (0, None)
    out = capsys.readouterr().out
    assert f"lora targets (all-linear): {', '.join(default_targets(model_type))}" in out
    (ckpt,) = sorted((tmp_path / "run").glob("step-*"))
    assert tensor_keys(ckpt) == tensor_keys(tmp_path / "base")
    reloaded = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    assert type(reloaded).__name__ == type(AutoModelForCausalLM.from_config(tiny_config(family))).__name__


def test_resolve_targets_and_checkpoint_layout_by_name():
    """all-linear resolved on a meta model, and the published layout read from transformers' reversed
    conversions: plain weights map one to one; Mixtral's per-expert tensors are row blocks of the fused
    experts parameter."""
    from slimtune.families import checkpoint_layout, meta_model, resolve_targets

    llama = meta_model(tiny_config(family_of("llama")))
    assert resolve_targets(llama, "all-linear") == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert resolve_targets(llama, ["q_proj", "v_proj"]) == ["q_proj", "v_proj"]
    layout = {p.key: p for p in checkpoint_layout(llama)}
    q = layout["model.layers.0.self_attn.q_proj.weight"]
    assert (q.param, q.row0, q.shape) == ("model.layers.0.self_attn.q_proj.weight", 0, (128, 128))
    assert "lm_head.weight" in layout and len(layout) == 21  # embeddings, 2 x (7 projections + 2 norms), norm, head
    mixtral = {p.key: p for p in checkpoint_layout(meta_model(tiny_config(family_of("mixtral"))))}
    w2 = mixtral["model.layers.0.block_sparse_moe.experts.1.w2.weight"]
    assert (w2.param, w2.row0, w2.shape, w2.param_shape) == ("model.layers.0.mlp.experts.down_proj", 128, (128, 128), (4, 128, 128))


def test_auto_dtype_on_the_cpu_is_bf16_only_where_it_multiplies_bf16_natively(monkeypatch):
    """model.pick_dtype: bf16 where the CPU has AVX512_BF16 / AMX-BF16 / Arm BF16 (or no /proc/cpuinfo), fp32
    on an AVX2-only CPU, where torch's bf16 products are many times slower; an explicit dtype is kept."""
    from slimtune import model as model_module

    cpu = torch.device("cpu")
    for flags, expected in (({"avx2", "avx512_bf16"}, torch.bfloat16), ({"fp", "asimd", "bf16"}, torch.bfloat16),
                            ({"avx2", "fma"}, torch.float32), (set(), torch.float32), (None, torch.bfloat16)):  # fmt: skip
        monkeypatch.setattr(model_module, "_cpu_flags", lambda flags=flags: flags)
        assert model_module.pick_dtype("auto", cpu) == expected, flags
        assert model_module.pick_dtype("bf16", cpu) == torch.bfloat16 and model_module.pick_dtype("fp32", cpu) == torch.float32
