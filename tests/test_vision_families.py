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
import shutil
from dataclasses import dataclass

import PIL.Image
import pytest
import torch
from transformers import AutoModelForImageTextToText

from slimtune.checkpoint.atomic import read_manifest
from slimtune.checkpoint.save import save_checkpoint
from slimtune.checkpoint.writer import WriteOptions
from slimtune.errors import SlimtuneError
from slimtune.facts import facts_of
from slimtune.families import (
    VISION_FAMILIES,
    checkpoint_layout,
    default_targets,
    family_of,
    meta_model,
    model_key_names,
    resolve_targets,
    tiny_config,
)
from slimtune.formats.merge_source import MergeSource
from slimtune.lora import LoRAConfig, lora_modules, lora_parameters, qlora_linears
from slimtune.merge import merge_from_files
from slimtune.model import build_qlora_skeleton, load_qlora_model, load_tokenizer
from slimtune.quant import is_nf4
from slimtune.tiny import byte_tokenizer, make_tiny_vision_checkpoint
from slimtune.vision_families import IMAGE_TOKENS, vision_parts
from tests.test_families import TOLERANCE_ULPS, bf16_ulps, read_tensors, tensor_keys

ANSWER = "twelve."
LM_LINEARS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@dataclass(frozen=True)
class Case:
    """One family's test inputs and what its model holds: an image of 4 image tokens in ``prompt``."""

    prompt: str
    pixels: dict  # name -> shape of the image inputs (random bf16), beside any integer inputs in ``extra``
    extra: dict
    tower_targets: list[str]  # all-linear with LoRAConfig.vision: the language model's and the tower's
    tower_adapters: int
    exclude: str  # exclude_modules with the tower frozen
    exclude_vision: str | None  # ... and with LoRAConfig.vision


CASES = {
    # one 56 x 56 image in 14-pixel patches (2 frames): 16 patches, merged 2 x 2 into 4 image tokens
    "qwen2_5_vl": Case(
        "Read the chart: <|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|> The value is ",
        {"pixel_values": (16, 3 * 2 * 14 * 14)},
        {"image_grid_thw": [[1, 4, 4]]},
        sorted([*LM_LINEARS, "proj", "qkv"]),
        5 * 2,  # qkv, proj, gate/up/down_proj of both blocks
        r"^(?:model\.visual\..*)$",  # PEFT would otherwise adapt the tower's gate/up/down_proj
        r"^(?:model\.visual\.patch_embed\.proj)$",  # the Conv3d PEFT would take for the tower's `proj`
    ),
    # one 64 x 64 image in 16-pixel patches: 16 patches, pixel-shuffled 2 x 2 into 4 image tokens
    "idefics3": Case(
        "Read the chart: <fake_token_around_image>" + "<image>" * 4 + "<fake_token_around_image> The value is ",
        {"pixel_values": (1, 1, 3, 64, 64)},
        {},
        sorted([*LM_LINEARS, "fc1", "fc2", "out_proj"]),
        6 * 2,  # q/k/v/out_proj, fc1, fc2 of both layers
        r"^(?:model\.vision_model\..*)$",  # the encoder's q/k/v_proj
        None,  # every encoder linear of a target's name is adapted; the connector's `proj` is not a target
    ),
    # one 64 x 64 image in 16-pixel patches: 16 patches, average-pooled 2 x 2 into 4 soft tokens; token_type_ids
    # (1 on the soft tokens) make them attend to each other both ways
    "gemma3": Case(
        "Read the chart: <start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image> The value is ",
        {"pixel_values": (1, 3, 64, 64)},
        {},
        sorted([*LM_LINEARS, "fc1", "fc2", "out_proj"]),
        6 * 2,  # q/k/v/out_proj, fc1, fc2 of both layers
        r"^(?:model\.vision_tower\..*)$",  # SigLIP's q/k/v_proj
        None,  # the projector holds no linear: one [vision, text] matrix
    ),
}
FAMILY_IDS = [f.model_type for f in VISION_FAMILIES]


def write_base(family, path, **overrides):
    """What a user brings: transformers' from_config + save_pretrained (bf16) and a tokenizer with the image
    tokens. Idefics3 and Gemma 3: the tiny model with its whole processor (tiny.make_tiny_vision_checkpoint:
    64-pixel images, 4 image tokens); Qwen2.5-VL: its image processor's preprocessor_config.json only, as
    transformers' Qwen2_5_VLProcessor needs torchvision, not installed here."""
    if family.model_type in ("idefics3", "gemma3"):
        make_tiny_vision_checkpoint(path, seed=0, model_type=family.model_type, **overrides)
        return load_tokenizer(path)
    from transformers import Qwen2VLImageProcessor

    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(tiny_config(family, **overrides)).to(torch.bfloat16).save_pretrained(path)
    tok = byte_tokenizer()
    tok.add_tokens([name for name, _ in IMAGE_TOKENS[family.model_type]], special_tokens=True)
    tok.save_pretrained(path)
    Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=56 * 56).save_pretrained(path)
    return tok


def image_batch(model_type: str, tok, answer: str = "") -> dict[str, torch.Tensor]:
    case = CASES[model_type]
    ids = torch.tensor([[tok.bos_token_id, *tok(case.prompt + answer, add_special_tokens=False)["input_ids"]]])
    gen = torch.Generator().manual_seed(1)
    pixels = {k: torch.randn(shape, generator=gen).to(torch.bfloat16) for k, shape in case.pixels.items()}
    batch = dict(input_ids=ids, **pixels, **{k: torch.tensor(v) for k, v in case.extra.items()})
    if model_type == "gemma3":  # as its processor gives them: 1 on the image (soft) tokens
        batch["token_type_ids"] = (ids == tok.convert_tokens_to_ids("<image_soft_token>")).long()
    return batch


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


@pytest.fixture(scope="module", params=FAMILY_IDS)
def trained(request, tmp_path_factory):
    """The family's tiny model, trained two steps as QLoRA (default targets) and saved."""
    model_type = request.param
    root = tmp_path_factory.mktemp(model_type)
    tok = write_base(family_of(model_type), root / "base")
    batch = image_batch(model_type, tok, ANSWER)
    model = load_qlora_model(root / "base", LoRAConfig(rank=8, alpha=16), seed=0, progress=False)
    assert (batch["input_ids"] == model.config.image_token_id).sum() == 4  # the tokenizer's image token is the model's
    losses, all_grads = train(model, batch)
    save_checkpoint(model, root / "ckpt", WriteOptions(progress=False))
    prompt = image_batch(model_type, tok)
    return dict(type=model_type, root=root, batch=batch, prompt=prompt, model=model, losses=losses, all_grads=all_grads)


def test_qlora_training_steps_run_with_the_vision_tower_frozen(trained):
    model, losses = trained["model"], trained["losses"]
    assert trained["all_grads"]
    assert losses[-1] < losses[0] - 0.1, losses  # lr 1e-2 on an 8-token answer: a clear drop
    assert facts_of(model).targets == default_targets(trained["type"]) == LM_LINEARS
    parts = vision_parts(trained["type"])
    adapters = lora_modules(model)
    assert adapters and not any(parts.in_vision(n) for n in adapters)
    assert len(adapters) == 7 * 2  # every language-model projection of the 2 layers
    vision = {n: p for n, p in model.named_parameters() if parts.in_vision(n)}
    assert len(vision) > 15 and all(p.dtype == torch.bfloat16 and not is_nf4(p) and not p.requires_grad for p in vision.values())
    assert all(is_nf4(m.weight) for m in adapters.values())
    other = {k: v.flip(-1) if k == "pixel_values" else v for k, v in trained["batch"].items()}
    assert not torch.equal(logits(model, other), logits(model, trained["batch"]))  # the image reaches the language model
    if "token_type_ids" in trained["batch"]:  # Gemma 3: its image tokens attend to each other both ways
        causal = {k: v for k, v in trained["batch"].items() if k != "token_type_ids"}
        assert not torch.equal(logits(model, causal), logits(model, trained["batch"]))


def test_merged_save_reloads_in_transformers_with_the_same_logits_and_tokens(trained):
    model, batch, ckpt = trained["model"], trained["batch"], trained["root"] / "ckpt"
    # (d) keys: transformers' save_pretrained layout, vision tower and projector included
    assert tensor_keys(ckpt) == tensor_keys(trained["root"] / "base")
    merged = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    assert type(merged) is type(model)
    ours = logits(model, batch)
    gap = bf16_ulps(logits(merged, batch), ours)
    print(f"{model.config.model_type}: {gap:.2f} bf16 ulps of the largest logit")
    assert gap <= TOLERANCE_ULPS, gap
    base = AutoModelForImageTextToText.from_pretrained(trained["root"] / "base", dtype=torch.bfloat16).eval()
    assert bf16_ulps(logits(base, batch), ours) > 8 * TOLERANCE_ULPS  # the bound is far below what training changed
    prompt = trained["prompt"]
    tokens = greedy(model, prompt)
    assert len(tokens) == 8 and greedy(merged, prompt) == tokens
    # the vision weights are the base's, bit for bit (frozen, streamed in the base dtype)
    saved, original = read_tensors(ckpt), read_tensors(trained["root"] / "base")
    parts = vision_parts(trained["type"])
    vision_keys = [p.key for p in facts_of(model).layout if parts.in_vision(p.param)]
    assert len(vision_keys) > 15
    for k in vision_keys:
        assert saved[k].dtype == original[k].dtype and torch.equal(saved[k], original[k]), k


def test_peft_oracle_logits_and_merge_and_unload(trained, tmp_path):
    peft = pytest.importorskip("peft")
    model, batch, ckpt = trained["model"], trained["batch"], trained["root"] / "ckpt"
    config = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert config["exclude_modules"] == CASES[trained["type"]].exclude
    # (d) PEFT writes the same adapter keys for the same config
    ref = AutoModelForImageTextToText.from_config(tiny_config(family_of(trained["type"])))
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=config["target_modules"], exclude_modules=config["exclude_modules"])
    peft.get_peft_model(ref, cfg).save_pretrained(tmp_path / "peft")
    ours_adapter = {k: tuple(v.shape) for k, v in read_tensors(ckpt / "adapter").items()}
    assert ours_adapter == {k: tuple(v.shape) for k, v in read_tensors(tmp_path / "peft").items()}

    peft_model = peft.PeftModel.from_pretrained(dequantized_base(trained["root"] / "base", model), ckpt / "adapter").eval()
    gap = bf16_ulps(logits(peft_model, batch), logits(model, batch))
    print(f"{model.config.model_type}: {gap:.2f} bf16 ulps of the largest logit")
    assert gap <= TOLERANCE_ULPS, gap
    assert greedy(peft_model, trained["prompt"]) == greedy(model, trained["prompt"])

    theirs = peft_model.merge_and_unload().state_dict()
    saved = read_tensors(ckpt)
    layout = [p for p in facts_of(model).layout if p.whole]
    assert len(layout) == len(saved)
    for p in layout:  # 0 bf16 ulps: the same fp32 sum on the same NF4 base, rounded once
        t = saved[p.key]
        assert t.dtype == theirs[p.param].dtype and torch.equal(t.view(torch.uint8), theirs[p.param].view(torch.uint8)), p.key


def manifest_digests(path) -> dict[str, str]:
    return {f["path"]: f["sha256"] for f in read_manifest(path)["files"]}


def assert_merge_is_the_save(ckpt, out):
    """The merge of the save's adapter onto the base on disk (published keys, the adapter in the model's
    names) wrote the in-training save's bytes, file for file."""
    saved, merged = manifest_digests(ckpt), manifest_digests(out)
    assert set(saved) - set(merged) == {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"}
    assert {"config.json", "tokenizer.json"} <= set(merged) <= set(saved)
    assert any(p.startswith("model") and p.endswith(".safetensors") for p in merged)
    assert {p: saved[p] for p in merged} == merged


def test_offline_merge_of_the_adapter_is_the_in_training_save(trained, tmp_path):
    base, ckpt = trained["root"] / "base", trained["root"] / "ckpt"
    out = tmp_path / "quantized"
    merge_from_files(MergeSource(base, ckpt / "adapter", "quantized"), out, WriteOptions(progress=False))
    assert_merge_is_the_save(ckpt, out)
    # --merge-base original: W + s * B @ A from the file's own W; the vision tower and projector as stored
    merge_from_files(MergeSource(base, ckpt / "adapter", "original"), tmp_path / "original", WriteOptions(progress=False))
    model, original, merged = trained["model"], read_tensors(base), read_tensors(tmp_path / "original")
    assert merged.keys() == original.keys()
    modules = lora_modules(model)
    adapted = {
        p.key: modules[p.param.removesuffix(".weight")] for p in facts_of(model).layout if p.param.removesuffix(".weight") in modules
    }
    assert len(adapted) == 7 * 2
    for key, t in merged.items():
        if key not in adapted:
            assert torch.equal(t, original[key]), key
            continue
        m = adapted[key]
        expected = (original[key].float() + m.scaling * (m.lora_b.weight.detach() @ m.lora_a.weight.detach())).to(torch.bfloat16)
        assert torch.equal(t.view(torch.int16), expected.view(torch.int16)), key


PROCESSOR_FILES = {
    "qwen2_5_vl": {"preprocessor_config.json"},
    "idefics3": {"processor_config.json", "tokenizer.json"},
    "gemma3": {"processor_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"},
}
# the processor's class and its image placeholder in text
PROCESSORS = {"idefics3": ("Idefics3Processor", "<image>"), "gemma3": ("Gemma3Processor", "<start_of_image>")}


def test_merged_checkpoint_carries_the_processor(trained, tmp_path):
    """The base's processor files are in the in-training save and the offline merge, byte for byte; the
    merged directory loads with AutoProcessor (Idefics3, Gemma 3: the whole processor), whose image + text
    inputs (Gemma 3's token_type_ids included) give the in-memory model's logits on the merged model."""
    from transformers import AutoImageProcessor, AutoProcessor

    base, ckpt = trained["root"] / "base", trained["root"] / "ckpt"
    merge_from_files(MergeSource(base, ckpt / "adapter"), tmp_path / "merged", WriteOptions(progress=False))
    for name in PROCESSOR_FILES[trained["type"]]:
        for out in (ckpt, tmp_path / "merged"):
            assert (out / name).read_bytes() == (base / name).read_bytes(), (out, name)
    if trained["type"] == "qwen2_5_vl":
        assert AutoImageProcessor.from_pretrained(tmp_path / "merged").size["longest_edge"] == 56 * 56
        return
    processor = AutoProcessor.from_pretrained(ckpt)
    name, placeholder = PROCESSORS[trained["type"]]
    assert type(processor).__name__ == name
    image = PIL.Image.fromarray(torch.randint(0, 256, (64, 64, 3), generator=torch.Generator().manual_seed(2), dtype=torch.uint8).numpy())
    inputs = processor(images=[image], text=[f"Read the chart: {placeholder} The value is "], return_tensors="pt")
    image_tokens = inputs["input_ids"] == trained["model"].config.image_token_id
    assert image_tokens.sum() == 4
    if trained["type"] == "gemma3":
        assert torch.equal(inputs["token_type_ids"], image_tokens.long())
    merged = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    batch = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}
    gap = bf16_ulps(logits(merged, batch), logits(trained["model"], batch))
    assert gap <= TOLERANCE_ULPS, gap


@pytest.mark.parametrize("model_type", FAMILY_IDS)
def test_lora_vision_adapts_the_tower_and_loads_in_peft(model_type, tmp_path):
    peft = pytest.importorskip("peft")
    case = CASES[model_type]
    tok = write_base(family_of(model_type), tmp_path / "base")
    batch = image_batch(model_type, tok, ANSWER)
    model = load_qlora_model(tmp_path / "base", LoRAConfig(rank=8, alpha=16, vision=True), seed=0, progress=False)
    parts = vision_parts(model_type)
    adapters = lora_modules(model)
    assert len([n for n in adapters if parts.in_tower(n)]) == case.tower_adapters
    assert not any(parts.in_vision(n) and not parts.in_tower(n) for n in adapters)  # the projector stays frozen
    assert facts_of(model).targets == default_targets(model_type, vision=True) == case.tower_targets
    _, all_grads = train(model, batch)
    assert all_grads  # the tower's adapters learn too
    save_checkpoint(model, tmp_path / "ckpt", WriteOptions(progress=False))
    config = json.loads((tmp_path / "ckpt" / "adapter" / "adapter_config.json").read_text())
    assert config.get("exclude_modules") == case.exclude_vision
    peft_model = peft.PeftModel.from_pretrained(dequantized_base(tmp_path / "base", model), tmp_path / "ckpt" / "adapter").eval()
    assert {n.removeprefix("base_model.model.") for n, m in peft_model.named_modules() if hasattr(m, "lora_A")} == set(adapters)
    gap = bf16_ulps(logits(peft_model, batch), logits(model, batch))
    print(f"{model.config.model_type}: {gap:.2f} bf16 ulps of the largest logit")
    assert gap <= TOLERANCE_ULPS, gap
    source = MergeSource(tmp_path / "base", tmp_path / "ckpt" / "adapter", "quantized")
    merge_from_files(source, tmp_path / "merged", WriteOptions(progress=False))
    assert_merge_is_the_save(tmp_path / "ckpt", tmp_path / "merged")  # the tower's adapters too


@pytest.mark.parametrize("model_type", FAMILY_IDS)
def test_tied_embeddings_stay_tied_and_the_merged_save_reloads(model_type, tmp_path):
    """The smaller published checkpoints (Qwen2.5-VL-3B, SmolVLM) and every Gemma 3 tie the head to the embeddings."""
    tok = write_base(family_of(model_type), tmp_path / "base", tie_word_embeddings=True)
    batch = image_batch(model_type, tok, ANSWER)
    model = load_qlora_model(tmp_path / "base", LoRAConfig(rank=8, alpha=16), seed=0, progress=False)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    train(model, batch)
    save_checkpoint(model, tmp_path / "ckpt", WriteOptions(progress=False))
    assert tensor_keys(tmp_path / "ckpt") == tensor_keys(tmp_path / "base")
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16).eval()
    gap = bf16_ulps(logits(merged, batch), logits(model, batch))
    assert gap <= TOLERANCE_ULPS, gap


def test_explicit_vision_targets(tmp_path):
    """A target only the frozen vision tower has is one error naming LoRAConfig.vision; with it, only the tower's layers."""
    (tmp_path / "base").mkdir()
    tiny_config(family_of("qwen2_5_vl")).save_pretrained(tmp_path / "base")
    with pytest.raises(SlimtuneError, match=r"\['qkv'\] not found in Qwen2.5-VL .*\['qkv'\] are vision linears, frozen; LoRAConfig.vision"):
        load_qlora_model(tmp_path / "base", LoRAConfig(target_modules=["q_proj", "qkv"]), progress=False)
    model = build_qlora_skeleton(tiny_config(family_of("qwen2_5_vl")), LoRAConfig(target_modules=["qkv", "gate_proj"], vision=True))
    assert sorted(lora_modules(model)) == sorted(
        [f"model.visual.blocks.{i}.attn.qkv" for i in range(2)]
        + [f"model.{part}.{i}.mlp.gate_proj" for part in ("visual.blocks", "language_model.layers") for i in range(2)]
    )


def test_model_key_names(tmp_path):
    """A vision base's keys in the model's names (transformers' load renamings); a text base's are its own
    (empty: nothing renamed); two keys that would be one model tensor are one error naming both."""
    tiny_config(family_of("qwen2_5_vl")).save_pretrained(tmp_path / "vl")
    names = model_key_names(tmp_path / "vl", ["model.layers.0.mlp.up_proj.weight", "visual.blocks.0.attn.qkv.weight", "lm_head.weight"])
    assert names == {
        "model.layers.0.mlp.up_proj.weight": "model.language_model.layers.0.mlp.up_proj.weight",
        "visual.blocks.0.attn.qkv.weight": "model.visual.blocks.0.attn.qkv.weight",
        "lm_head.weight": "lm_head.weight",
    }
    with pytest.raises(SlimtuneError, match=r"model\.layers\.0\.mlp\.up_proj\.weight and model\.language_model\.layers\.0"):
        model_key_names(tmp_path / "vl", ["model.layers.0.mlp.up_proj.weight", "model.language_model.layers.0.mlp.up_proj.weight"])
    tiny_config(family_of("llama")).save_pretrained(tmp_path / "text")
    assert model_key_names(tmp_path / "text", ["model.layers.0.mlp.up_proj.weight"]) == {}


def test_targets_and_layout_by_name():
    """The class, the all-linear targets with and without the tower, and the vision tensors in the layout."""
    model = meta_model(tiny_config(family_of("qwen2_5_vl")))
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert resolve_targets(model, "all-linear") == LM_LINEARS
    assert resolve_targets(model, "all-linear", vision=True) == [
        *("down_proj", "gate_proj", "k_proj", "o_proj", "proj", "q_proj", "qkv", "up_proj", "v_proj"),
    ]
    layout = {p.key: p for p in checkpoint_layout(model)}
    patch = layout["visual.patch_embed.proj.weight"]  # the 5-D Conv3d weight: one whole tensor, frozen
    assert patch.whole and patch.param == "model.visual.patch_embed.proj.weight" and len(patch.shape) == 5
    assert layout["model.layers.0.self_attn.q_proj.weight"].param == "model.language_model.layers.0.self_attn.q_proj.weight"
    assert type(meta_model(tiny_config(family_of("idefics3")))).__name__ == "Idefics3ForConditionalGeneration"


def test_lora_vision_config_key(tmp_path):
    """`lora.vision` (default false) is LoRAConfig.vision where the recipe builds the model; not a bool is one error naming it."""
    from slimtune.config import load_config
    from slimtune.recipes.run_steps import lora_config

    out = f"output_dir={tmp_path / 'run'}"
    assert lora_config(load_config("tiny", [out])).vision is False
    lora = lora_config(load_config("tiny", [out, "lora.vision=true", "lora.target_modules=[all-linear]"]))
    assert lora.vision is True
    model = build_qlora_skeleton(tiny_config(family_of("qwen2_5_vl")), lora)
    assert len([n for n in lora_modules(model) if vision_parts("qwen2_5_vl").in_tower(n)]) == CASES["qwen2_5_vl"].tower_adapters
    with pytest.raises(SlimtuneError, match="lora.vision"):
        load_config("tiny", [out, "lora.vision=3"])


@pytest.mark.parametrize("trained", ["gemma3"], indirect=True)
def test_gemma3_base_with_the_published_names_loads_trains_and_merges(trained, tmp_path):
    """Gemma 3 as published on the Hub (SigLIP under ``vision_tower.vision_model.``, which transformers 5 reads and
    no longer writes): it loads as the same model (the logits of transformers' own load), its in-training save
    has transformers 5's names, and ``slimtune merge`` keeps the base file's names, the same tensors bit for bit."""
    from safetensors.torch import save_file

    base, ckpt, published = trained["root"] / "base", trained["root"] / "ckpt", tmp_path / "published"
    shutil.copytree(base, published)
    weights = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in read_tensors(base).items()}
    save_file(weights, str(published / "model.safetensors"), metadata={"format": "pt"})
    model = load_qlora_model(published, LoRAConfig(rank=8, alpha=16), seed=0, progress=False)
    assert torch.equal(logits(model.eval(), trained["batch"]), logits(dequantized_base(published, model), trained["batch"]))
    save_checkpoint(model, tmp_path / "ckpt", WriteOptions(progress=False))
    assert tensor_keys(tmp_path / "ckpt") == tensor_keys(base) == tensor_keys(ckpt)
    merge_from_files(MergeSource(published, ckpt / "adapter", "quantized"), tmp_path / "merged", WriteOptions(progress=False))
    merged, saved = read_tensors(tmp_path / "merged"), read_tensors(ckpt)
    assert merged.keys() == weights.keys()
    for key, t in merged.items():
        assert torch.equal(t, saved[key.replace("vision_tower.vision_model.", "vision_tower.", 1)]), key
