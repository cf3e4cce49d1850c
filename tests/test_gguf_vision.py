"""GGUF export of a vision-language model (slimtune.gguf.mmproj): the tiny SmolVLM (Idefics3) fine-tuned 2
QLoRA steps on image rows, exported as its language model's GGUF and its mmproj GGUF, then checked by
llama.cpp itself (llama-cpp-python's mtmd, the multimodal library llama-server and llama-mtmd-cli use):

- every tensor of both files reads back (gguf.GGUFReader) equal to the merged checkpoint's, under the
  gguf package's names, in the converter's types (F16 weights; F32 embeddings, norms and biases);
- mtmd loads the pair and encodes an image into the same embeddings as transformers' vision tower and
  connector (within f16's bound), and answers an image + text prompt with transformers' logits on the
  same tokens (image features in place of the image tokens) and its greedy token;
- the Modelfile names both files; ``checkpoint.gguf`` in the run writes the same files; bad input is one
  line, exit 2, nothing written.

The byte comparison with llama.cpp's own converter (``convert_hf_to_gguf.py --mmproj``) needs the converter,
which the tests do not have: ``python -m bench gguf-vision`` (docs/gguf.md)."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import PIL.Image
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText, AutoProcessor

from bench.gguf_vision import make_trained_vlm
from slimtune.cli import main as slimtune_main
from slimtune.tiny import byte_tokenizer, make_tiny_vision_checkpoint
from tests.conftest import llama_cpp_oracle
from tests.vision_gguf_helpers import export_f16_pair, mtmd_answer, read_tensors

llama_cpp = llama_cpp_oracle()
mtmd = pytest.importorskip("llama_cpp.mtmd_cpp")

EMBED_BOUND = 0.01  # max |llama.cpp - transformers| image embedding, in std units (f16 weights; measured ~0.001)
LOGIT_BOUND = 0.03  # as tests/test_gguf.py's f16 bound, std(logits) units


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """The merged checkpoint after 2 steps, and its f16 GGUF + f16 mmproj written by ``slimtune export``."""
    root = tmp_path_factory.mktemp("gguf-vision")
    tokenizer_dir = root / "tokenizer"
    tokenizer = byte_tokenizer()  # + the tokens llama.cpp's idefics3 wrapping looks up whole (SmolVLM's vocabulary has them)
    tokenizer.add_tokens(["<global-img>", "<row_1_col_1>"], special_tokens=True)
    tokenizer.add_tokens(["\n\n"])
    tokenizer.save_pretrained(tokenizer_dir)
    ckpt = make_trained_vlm(root, tokenizer_dir, ("checkpoint.gguf=f16",))  # the run writes its GGUF pair too
    return export_f16_pair(root, ckpt)


def test_both_files_hold_the_checkpoint_tensors_under_llama_cpp_names(vlm):
    weights = load_file(str(vlm["ckpt"] / "model-00001-of-00001.safetensors"))
    vision = {k: v for k, v in weights.items() if k.startswith(("model.vision_model.", "model.connector."))}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, 2)
    mm = read_tensors(vlm["mmproj"])
    assert sorted(mm) == sorted(names.get_name(k, try_suffixes=(".weight", ".bias")) for k in vision) and len(mm) == 38
    for key, value in vision.items():
        t = mm[names.get_name(key, try_suffixes=(".weight", ".bias"))]
        f32 = ".embeddings." in key or value.dim() == 1
        assert t.tensor_type == (gguf.GGMLQuantizationType.F32 if f32 else gguf.GGMLQuantizationType.F16), key
        want = value.float().numpy().astype(np.float32 if f32 else np.float16)
        assert np.array_equal(np.asarray(t.data).reshape(want.shape), want), key
    text = read_tensors(vlm["model"])
    assert len(text) == len(weights) - len(vision) and not any(n.startswith(("v.", "mm.")) for n in text)
    assert np.array_equal(np.asarray(text["token_embd.weight"].data), weights["model.text_model.embed_tokens.weight"].half().numpy())
    fields = gguf.GGUFReader(vlm["mmproj"]).fields
    meta = {k: fields[k].contents() for k in ("general.architecture", "general.type", "clip.projector_type", "clip.vision.projection_dim")}
    assert meta == {
        "general.architecture": "clip",
        "general.type": "mmproj",
        "clip.projector_type": "idefics3",
        "clip.vision.projection_dim": 128,
    }
    assert gguf.GGUFReader(vlm["model"]).fields["general.architecture"].contents() == "llama"
    lines = (vlm["model"].parent / "Modelfile").read_text().splitlines()
    assert lines[:2] == ["FROM ./model-f16.gguf", "FROM ./model-mmproj-f16.gguf"]
    for name in ("model-f16.gguf", "model-mmproj-f16.gguf", "Modelfile"):  # checkpoint.gguf at the end of the run: the same files
        assert (vlm["root"] / "run" / name).read_bytes() == (vlm["model"].parent / name).read_bytes(), name


def test_llama_cpp_encodes_the_image_and_answers_as_transformers(vlm):
    """mtmd (llama.cpp's multimodal library) loads the pair; its image embeddings are transformers' image
    features; its logits after an image + text prompt are transformers' on the same tokens."""
    image = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    prompt = b"<|bos|><|user|>\n" + mtmd.mtmd_default_marker() + b"Color?<|eos|>\n<|assistant|>\n"
    parts, theirs, cpp_last, n_past = mtmd_answer(vlm["model"], vlm["mmproj"], prompt, image)
    # llama.cpp splits an image into tiles plus an overview: here one tile, each the 64 x 64 image itself
    model = AutoModelForImageTextToText.from_pretrained(vlm["ckpt"], dtype=torch.float32).eval()
    pixels = AutoProcessor.from_pretrained(vlm["ckpt"]).image_processor(images=[[PIL.Image.fromarray(image)]], return_tensors="pt")
    pixels = {k: v.repeat(1, len(theirs), *[1] * (v.dim() - 2)) for k, v in pixels.items()}  # the image once per image chunk
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values=pixels["pixel_values"], pixel_attention_mask=pixels["pixel_attention_mask"])
        ours = torch.cat(list(getattr(features, "pooler_output", features))).reshape(-1, 128).numpy()
        assert len(theirs) == 2 and ours.shape == (8, 128)
        assert np.abs(ours - np.concatenate(theirs)).max() <= EMBED_BOUND * ours.std()
        image_id = model.config.image_token_id  # the image's place in transformers' input: its token, once per embedding
        ids = [i for kind, x in parts for i in (x if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT else [image_id] * x)]
        logits = model(input_ids=torch.tensor([ids]), **pixels).logits[0, -1].numpy()
    assert n_past == len(ids)
    assert np.abs(logits - cpp_last).max() <= LOGIT_BOUND * logits.std()
    top2 = np.sort(logits)[-2:]
    assert int(cpp_last.argmax()) == int(logits.argmax()) or top2[1] - top2[0] <= LOGIT_BOUND * logits.std()


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """The tiny Gemma 3 (make_tiny_vision_checkpoint: byte tokenizer + <start_of_image>, <image_soft_token>,
    <end_of_image>; a checkpoint in transformers' layout, as a merged save is) and its f16 GGUF + f16 mmproj."""
    root = tmp_path_factory.mktemp("gguf-gemma3")
    ckpt = make_tiny_vision_checkpoint(root / "ckpt", model_type="gemma3")
    out = root / "export" / "model-f16.gguf"
    out.parent.mkdir()
    assert slimtune_main(["export", str(ckpt), "--type", "f16", "--out", str(out)]) == 0
    return dict(ckpt=ckpt, model=out, mmproj=out.with_name("model-mmproj-f16.gguf"))


def test_gemma3_files_hold_the_checkpoint_tensors_under_llama_cpp_names(gemma3):
    """The mmproj: SigLIP's tensors under the names of its published layout (``vision_tower.vision_model.``),
    the projector's norm as 1 + w (F32), its [vision, text] matrix F16; the language model: ``gemma3``, its
    norms as 1 + w; metadata as llama.cpp reads it (projector gemma3, pooling 2 x 2 where published is 4 x 4)."""
    weights = load_file(str(gemma3["ckpt"] / "model.safetensors"))
    vision = {k: v for k, v in weights.items() if k.startswith(("vision_tower.", "multi_modal_projector."))}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, 2)
    mm = read_tensors(gemma3["mmproj"])
    assert len(mm) == len(vision) == 39
    for key, value in vision.items():
        name = names.get_name(
            key.replace("vision_tower.", "vision_tower.vision_model.").replace("_weight", ".weight"), (".weight", ".bias")
        )
        t, f32 = mm[name], ".embeddings." in key or value.dim() == 1
        assert t.tensor_type == (gguf.GGMLQuantizationType.F32 if f32 else gguf.GGMLQuantizationType.F16), key
        want = (value.float() + (name == "mm.soft_emb_norm.weight")).numpy().astype(np.float32 if f32 else np.float16)
        assert np.array_equal(np.asarray(t.data).reshape(want.shape), want), key
    text = read_tensors(gemma3["model"])
    assert len(text) == len(weights) - len(vision) and not any(n.startswith(("v.", "mm.")) for n in text)
    norm = weights["language_model.model.layers.0.input_layernorm.weight"].float() + 1
    assert np.array_equal(np.asarray(text["blk.0.attn_norm.weight"].data), norm.numpy())
    fields = gguf.GGUFReader(gemma3["mmproj"]).fields
    keys = ("clip.projector_type", "clip.vision.projection_dim", "clip.vision.projector.scale_factor", "clip.use_gelu")
    assert {k: fields[k].contents() for k in keys} == dict(zip(keys, ("gemma3", 128, 2, True), strict=True))
    assert gguf.GGUFReader(gemma3["model"]).fields["general.architecture"].contents() == "gemma3"
    lines = (gemma3["model"].parent / "Modelfile").read_text().splitlines()
    assert lines[:2] == ["FROM ./model-f16.gguf", "FROM ./model-mmproj-f16.gguf"]


def test_gemma3_with_the_published_names_exports_the_same_files(gemma3, tmp_path):
    """Gemma 3 as published (SigLIP under ``vision_tower.vision_model.``, what ``slimtune merge`` keeps of such a
    base) exports the same two files as transformers 5's layout."""
    src = tmp_path / "published"
    shutil.copytree(gemma3["ckpt"], src)
    weights = load_file(str(src / "model.safetensors"))
    published = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in weights.items()}
    save_file(published, str(src / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "model-f16.gguf"
    assert slimtune_main(["export", str(src), "--type", "f16", "--out", str(out)]) == 0
    for name in ("model-f16.gguf", "model-mmproj-f16.gguf"):
        assert (tmp_path / name).read_bytes() == (gemma3["model"].parent / name).read_bytes(), name


def test_gemma3_llama_cpp_encodes_the_image_and_answers_as_transformers_with_the_bidirectional_image_mask(gemma3):
    """mtmd loads the pair; its 4 image embeddings are transformers' (SigLIP, 2 x 2 pooling, RMSNorm,
    projection); its logits after an image + text prompt are transformers' given token_type_ids (the image's
    tokens see each other, as llama.cpp decodes an image batch non-causally), not the causal model's."""
    image = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    prompt = b"<|bos|><|user|>\n" + mtmd.mtmd_default_marker() + b"Color?<|eos|>\n<|assistant|>\n"
    parts, theirs, cpp_last, n_past = mtmd_answer(gemma3["model"], gemma3["mmproj"], prompt, image)
    model = AutoModelForImageTextToText.from_pretrained(gemma3["ckpt"], dtype=torch.float32).eval()
    pixels = AutoProcessor.from_pretrained(gemma3["ckpt"]).image_processor(images=[[PIL.Image.fromarray(image)]], return_tensors="pt")
    image_id = model.config.image_token_id
    ids = torch.tensor([[i for kind, x in parts for i in (x if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT else [image_id] * x)]])
    with torch.no_grad():
        ours = model.model.get_image_features(pixel_values=pixels["pixel_values"]).pooler_output.reshape(-1, 128).numpy()
        assert len(theirs) == 1 and ours.shape == (4, 128)
        assert np.abs(ours - theirs[0]).max() <= EMBED_BOUND * ours.std()
        both_ways, causal = (
            model(input_ids=ids, pixel_values=pixels["pixel_values"], token_type_ids=types).logits[0, -1].numpy()
            for types in ((ids == image_id).long(), None)
        )
    assert n_past == ids.shape[1]
    assert np.abs(both_ways - cpp_last).max() <= LOGIT_BOUND * both_ways.std()
    assert np.abs(causal - cpp_last).max() > LOGIT_BOUND * causal.std()
    assert int(cpp_last.argmax()) == int(both_ways.argmax())


def test_unsupported_vision_exports_are_one_line_exit_2(vlm, tmp_path, capsys, monkeypatch):
    """An adapter-only GGUF of a vision model; a vision family without an mmproj here (Qwen2.5-VL's config,
    its family taken out of slimtune.gguf.mmproj's table): one line, exit 2, nothing written."""
    from slimtune.gguf import mmproj

    out = tmp_path / "a.gguf"
    argv = ["export", str(vlm["ckpt"] / "adapter"), "--adapter-only", "--base", str(vlm["root"] / "base"), "--out", str(out)]
    assert slimtune_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--adapter-only of a vision-language model is not supported" in err
    qwen = tmp_path / "qwen"
    shutil.copytree(vlm["ckpt"], qwen, ignore=shutil.ignore_patterns("slimtune_manifest.json", "adapter", "train_state"))
    cfg = json.loads((qwen / "config.json").read_text())
    (qwen / "config.json").write_text(json.dumps(cfg | {"model_type": "qwen2_5_vl"}))
    monkeypatch.delitem(mmproj._FAMILIES, "qwen2_5_vl")
    assert slimtune_main(["export", str(qwen), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'qwen2_5_vl'" in err and "idefics3 only" in err
    assert not out.exists() and not out.with_name("a-mmproj-f16.gguf").exists()


def _edited(vlm, tmp_path, config=None, processor=None, drop: str | None = None):
    """A copy of the merged checkpoint (without its manifest) with config.json's / processor_config.json's
    entries replaced by ``config`` / ``processor`` ({"vision_config.patch_size": 8}) and ``drop`` removed."""
    d = tmp_path / "ckpt"
    shutil.copytree(vlm["ckpt"], d, ignore=shutil.ignore_patterns("slimtune_manifest.json", "adapter", "train_state"))
    for name, edits in (("config.json", config), ("processor_config.json", processor)):
        spec = json.loads((d / name).read_text())
        for dotted, value in (edits or {}).items():
            *path, key = dotted.split(".")
            node = spec
            for part in path:
                node = node[part]
            node[key] = value
        (d / name).write_text(json.dumps(spec))
    if drop:
        (d / drop).unlink()
    return d


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (dict(drop="processor_config.json"), "no preprocessor_config.json or processor_config.json"),
        (dict(processor={"image_processor.image_mean": [0.5, 0.5]}), "processor_config.json: image_mean must be a list of 3 numbers"),
        (dict(config={"vision_config.num_hidden_layers": 3}), "num_hidden_layers is 3, the checkpoint holds vision blocks [0, 1]"),
        (dict(config={"vision_config.intermediate_size": 96}), "mmproj tensor v.blk.0.ffn_up.weight is [128, 64]"),
        (dict(config={"scale_factor": 4}), "mmproj tensor mm.model.fc.weight is [128, 256]"),
    ],
    ids=["no-processor-config", "image-mean", "blocks", "mlp-width", "scale-factor"],
)
def test_bad_vision_inputs_are_one_line_exit_2(vlm, tmp_path, capsys, edit, expected):
    """What llama.cpp would compute wrongly or refuse (the image statistics, shapes its metadata implies) is
    one line naming the file and key, exit 2, neither file written."""
    src, out = _edited(vlm, tmp_path, **edit), tmp_path / "m.gguf"
    assert slimtune_main(["export", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
    assert not out.exists() and not out.with_name("m-mmproj-f16.gguf").exists()


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (dict(processor={"image_seq_length": 9}), "processor_config.json: image_seq_length 9 must be a square whose side divides the 4"),
        (dict(config={"vision_config.hidden_size": 32}), "mmproj tensor v.patch_embd.weight is [64, 3, 16, 16]"),
    ],
    ids=["pooling", "tower-width"],
)
def test_bad_gemma3_inputs_are_one_line_exit_2(gemma3, tmp_path, capsys, edit, expected):
    """Gemma 3's pooling that does not divide the patch grid, a tower the config contradicts: one line
    naming the file and key, exit 2, neither file written."""
    src, out = _edited(gemma3, tmp_path, **edit), tmp_path / "m.gguf"
    assert slimtune_main(["export", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
    assert not out.exists() and not out.with_name("m-mmproj-f16.gguf").exists()
