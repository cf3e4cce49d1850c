"""Vision-language families (slimtune.vision_families, families.VISION_FAMILIES), as tests/test_families.py
tests the text ones: a tiny random model written by transformers (its image-text-to-text class) with a
byte tokenizer that holds the image tokens, loaded as QLoRA with the default targets, trained two steps
on an image + text row, saved; the oracles are transformers and PEFT: (a) the merged save reloads in
plain transformers (``AutoModelForImageTextToText``) with the in-memory model's logits and greedy tokens
on an image + text prompt, (b) PEFT applies the adapter to the NF4-dequantized base with the same logits
and its ``merge_and_unload`` is the merged save bit for bit, (c) the vision tower and projector stay
frozen in the base dtype unless ``LoRAConfig.vision`` adapts the tower, (d) the keys are the ones
transformers' and PEFT's save_pretrained write."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForImageTextToText

from slimtune.checkpoint.save import save_checkpoint
from slimtune.checkpoint.writer import WriteOptions
from slimtune.facts import facts_of
from slimtune.families import VISION_FAMILIES, checkpoint_layout, default_targets, family_of, meta_model, resolve_targets, tiny_config
from slimtune.lora import LoRAConfig, lora_modules, lora_parameters, qlora_linears
from slimtune.model import load_qlora_model
from slimtune.quant import is_nf4
from slimtune.tiny import byte_tokenizer
from slimtune.vision_families import IMAGE_TOKENS, vision_parts
from tests.test_families import TOLERANCE_ULPS, bf16_ulps, read_tensors, tensor_keys

FAMILY = family_of("qwen2_5_vl")
PATCHES = (1, 4, 4)  # one 56 x 56 image in 14-pixel patches: 16 patches, merged 2 x 2 into 4 image tokens
PROMPT = "Read the chart: <|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|> The value is "
ANSWER = "twelve."
LM_LINEARS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def write_base(family, path):
    """What a user brings: transformers' from_config + save_pretrained (bf16) and a tokenizer with the image tokens."""
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(tiny_config(family)).to(torch.bfloat16).save_pretrained(path)
    tok = byte_tokenizer()
    tok.add_tokens([name for name, _ in IMAGE_TOKENS[family.model_type]], special_tokens=True)
    tok.save_pretrained(path)
    return tok


def image_batch(tok, text: str) -> dict[str, torch.Tensor]:
    ids = torch.tensor([[tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"]]])
    t, h, w = PATCHES
    pixels = torch.randn(t * h * w, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    return dict(input_ids=ids, pixel_values=pixels, image_grid_thw=torch.tensor([PATCHES]))


def logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits.float()


def greedy(model, batch, n=8):
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=n, do_sample=False, pad_token_id=256)
    return out[0, batch["input_ids"].shape[1] :].tolist()


def train(model, batch, steps=2):
    """AdamW steps on the answer tokens; the losses, and whether every adapter got a non-zero gradient in
    the last step (in the first, lora_A's is zero: lora_B starts at zero)."""
    labels = batch["input_ids"].clone()
    labels[:, : -len(ANSWER)] = -100
    opt = torch.optim.AdamW(lora_parameters(model), lr=1e-2)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        all_grads = all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_parameters(model))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        losses.append(model(**batch, labels=labels).loss.item())
    return losses, all_grads


def dequantized_base(base_dir, model):
    """The base as QLoRA training saw it: transformers' model with every NF4 weight dequantized (torchao)."""
    base = AutoModelForImageTextToText.from_pretrained(base_dir, dtype=torch.bfloat16)
    state = {f"{name}.weight": m.weight.get_original_weight() for name, m in qlora_linears(model).items() if is_nf4(m.weight)}
    assert not base.load_state_dict(state, strict=False).unexpected_keys
    return base.eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny Qwen2.5-VL, trained two steps as QLoRA (default targets) and saved."""
    root = tmp_path_factory.mktemp("vision")
    tok = write_base(FAMILY, root / "base")
    batch = image_batch(tok, PROMPT + ANSWER)
    model = load_qlora_model(root / "base", LoRAConfig(rank=8, alpha=16), seed=0, progress=False)
    losses, all_grads = train(model, batch)
    save_checkpoint(model, root / "ckpt", WriteOptions(progress=False))
    return dict(root=root, tok=tok, batch=batch, model=model, losses=losses, all_grads=all_grads)


def test_qlora_training_steps_run_with_the_vision_tower_frozen(trained):
    model, losses = trained["model"], trained["losses"]
    assert trained["all_grads"]
    assert losses[-1] < losses[0] - 0.1, losses  # lr 1e-2 on an 8-token answer: a clear drop
    assert facts_of(model).targets == default_targets("qwen2_5_vl") == LM_LINEARS
    parts = vision_parts("qwen2_5_vl")
    adapters = lora_modules(model)
    assert adapters and not any(parts.in_vision(n) for n in adapters)
    assert len(adapters) == 7 * 2  # every language-model projection of the 2 layers
    vision = {n: p for n, p in model.named_parameters() if parts.in_vision(n)}
    assert len(vision) > 20 and all(p.dtype == torch.bfloat16 and not is_nf4(p) and not p.requires_grad for p in vision.values())
    assert all(is_nf4(m.weight) for m in adapters.values())


def test_merged_save_reloads_in_transformers_with_the_same_logits_and_tokens(trained):
    model, batch, ckpt = trained["model"], trained["batch"], trained["root"] / "ckpt"
    # (d) keys: transformers' save_pretrained layout, vision tower and projector included
    assert tensor_keys(ckpt) == tensor_keys(trained["root"] / "base")
    assert any(k.startswith("visual.blocks.") for k in tensor_keys(ckpt))
    merged = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    assert type(merged) is type(model)
    ours = logits(model, batch)
    gap = bf16_ulps(logits(merged, batch), ours)
    assert gap <= TOLERANCE_ULPS, gap
    base = AutoModelForImageTextToText.from_pretrained(trained["root"] / "base", dtype=torch.bfloat16).eval()
    assert bf16_ulps(logits(base, batch), ours) > 8 * TOLERANCE_ULPS  # the bound is far below what training changed
    prompt = image_batch(trained["tok"], PROMPT)
    tokens = greedy(model, prompt)
    assert len(tokens) == 8 and greedy(merged, prompt) == tokens
    # the vision weights are the base's, bit for bit (frozen, streamed in the base dtype)
    saved, original = read_tensors(ckpt), read_tensors(trained["root"] / "base")
    for k in (k for k in original if k.startswith("visual.")):
        assert saved[k].dtype == original[k].dtype and torch.equal(saved[k], original[k]), k


def test_peft_oracle_logits_and_merge_and_unload(trained, tmp_path):
    peft = pytest.importorskip("peft")
    model, batch, ckpt = trained["model"], trained["batch"], trained["root"] / "ckpt"
    config = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert config["exclude_modules"] == r"^(?:model\.visual\..*)$"  # PEFT would otherwise adapt the tower's gate/up/down_proj
    # (d) PEFT writes the same adapter keys for the same config
    ref = AutoModelForImageTextToText.from_config(tiny_config(FAMILY))
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=config["target_modules"], exclude_modules=config["exclude_modules"])
    peft.get_peft_model(ref, cfg).save_pretrained(tmp_path / "peft")
    ours_adapter = {k: tuple(v.shape) for k, v in read_tensors(ckpt / "adapter").items()}
    assert ours_adapter == {k: tuple(v.shape) for k, v in read_tensors(tmp_path / "peft").items()}

    peft_model = peft.PeftModel.from_pretrained(dequantized_base(trained["root"] / "base", model), ckpt / "adapter").eval()
    gap = bf16_ulps(logits(peft_model, batch), logits(model, batch))
    assert gap <= TOLERANCE_ULPS, gap
    assert greedy(peft_model, image_batch(trained["tok"], PROMPT)) == greedy(model, image_batch(trained["tok"], PROMPT))

    theirs = peft_model.merge_and_unload().state_dict()
    saved = read_tensors(ckpt)
    layout = [p for p in facts_of(model).layout if p.whole]
    assert len(layout) == len(saved)
    for p in layout:  # 0 bf16 ulps: the same fp32 sum on the same NF4 base, rounded once
        t = saved[p.key]
        assert t.dtype == theirs[p.param].dtype and torch.equal(t.view(torch.uint8), theirs[p.param].view(torch.uint8)), p.key


def test_lora_vision_adapts_the_tower_and_loads_in_peft(tmp_path):
    peft = pytest.importorskip("peft")
    tok = write_base(FAMILY, tmp_path / "base")
    batch = image_batch(tok, PROMPT + ANSWER)
    model = load_qlora_model(tmp_path / "base", LoRAConfig(rank=8, alpha=16, vision=True), seed=0, progress=False)
    parts = vision_parts("qwen2_5_vl")
    adapters = lora_modules(model)
    tower = [n for n in adapters if parts.in_tower(n)]
    assert len(tower) == 5 * 2  # qkv, proj, gate/up/down_proj of both blocks
    assert not any(n.startswith("model.visual.merger") for n in adapters)  # the projector stays frozen
    assert facts_of(model).targets == default_targets("qwen2_5_vl", vision=True)
    _, all_grads = train(model, batch)
    assert all_grads  # the tower's adapters learn too
    save_checkpoint(model, tmp_path / "ckpt", WriteOptions(progress=False))
    config = json.loads((tmp_path / "ckpt" / "adapter" / "adapter_config.json").read_text())
    assert config["exclude_modules"] == r"^(?:model\.visual\.patch_embed\.proj)$"  # the Conv3d PEFT would take for `proj`
    peft_model = peft.PeftModel.from_pretrained(dequantized_base(tmp_path / "base", model), tmp_path / "ckpt" / "adapter").eval()
    assert {n.removeprefix("base_model.model.") for n, m in peft_model.named_modules() if hasattr(m, "lora_A")} == set(adapters)
    gap = bf16_ulps(logits(peft_model, batch), logits(model, batch))
    assert gap <= TOLERANCE_ULPS, gap


def test_targets_and_layout_by_name():
    """The class, the all-linear targets with and without the tower, and the vision tensors in the layout."""
    model = meta_model(tiny_config(FAMILY))
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert resolve_targets(model, "all-linear") == LM_LINEARS
    assert resolve_targets(model, "all-linear", vision=True) == [
        *("down_proj", "gate_proj", "k_proj", "o_proj", "proj", "q_proj", "qkv", "up_proj", "v_proj"),
    ]
    layout = {p.key: p for p in checkpoint_layout(model)}
    patch = layout["visual.patch_embed.proj.weight"]  # the 5-D Conv3d weight: one whole tensor, frozen
    assert patch.whole and patch.param == "model.visual.patch_embed.proj.weight" and len(patch.shape) == 5
    assert layout["model.layers.0.self_attn.q_proj.weight"].param == "model.language_model.layers.0.self_attn.q_proj.weight"
    assert FAMILY in VISION_FAMILIES
