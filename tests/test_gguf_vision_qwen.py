"""GGUF export of Qwen2.5-VL (slimtune.gguf.mmproj's ``qwen2_5_vl`` family): the tiny Qwen2.5-VL of
tests/test_vision_families.py fine-tuned 2 QLoRA steps, exported as its language model's GGUF (``qwen2vl``)
and its mmproj GGUF (projector ``qwen2.5vl``), then checked by llama.cpp itself (llama-cpp-python's mtmd):

- every tensor of both files reads back (gguf.GGUFReader) equal to the merged checkpoint's in the converter's
  types: the fused ``attn.qkv`` as its three thirds, the Conv3d patch embedding as its two frames
  (``v.patch_embd.weight`` and ``.weight.1``), the rest under the gguf package's MMPROJ names; the
  metadata llama.cpp reads (``rope.dimension_sections``, ``clip.vision.n_wa_pattern``, ...);
- a K-quant mix of the language model is llama-quantize's, byte for byte;
- mtmd loads the pair, encodes a 224 x 112 image (8 x 4 merged tokens in two attention windows) into
  transformers' image features, and after an image + text prompt (M-RoPE positions) gives transformers' logits;
- a published flat config.json (no text_config) writes the same files;
- settings llama.cpp's qwen2.5vl graph cannot be told are one line, exit 2, nothing written.

The byte comparison with llama.cpp's own converter needs the converter: ``python -m bench gguf-vision
--family qwen2_5_vl`` (docs/gguf.md)."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import PIL.Image
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from bench.gguf_vision import make_trained_qwen_vl
from slimtune.cli import main as slimtune_main
from tests.conftest import llama_cpp_oracle
from tests.test_gguf import LLAMA_QUANTIZE_ADDS, assert_same_gguf, llama_quantize
from tests.vision_gguf_helpers import export_f16_pair, mtmd_answer, read_tensors

llama_cpp = llama_cpp_oracle()
mtmd = pytest.importorskip("llama_cpp.mtmd_cpp")

EMBED_BOUND = 0.01  # max |llama.cpp - transformers| image embedding, in std units (f16 weights), as for idefics3; measured 0.002
LOGIT_BOUND = 0.005  # std(logits) units; measured 0.0005 (with 1-D positions in place of M-RoPE's: 0.018)
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def qvl(tmp_path_factory):
    """The merged checkpoint after 2 steps, and its f16 GGUF + f16 mmproj written by ``slimtune export``."""
    root = tmp_path_factory.mktemp("gguf-qwen-vl")
    ckpt = make_trained_qwen_vl(root)
    return export_f16_pair(root, ckpt)


def _mmproj_expected(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The mmproj's tensors as the converter makes them from the checkpoint's ``visual.*`` (named by hand here)."""
    names = {"attn.proj": "attn_out", "norm1": "ln1", "norm2": "ln2", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up"}
    names |= {"mlp.down_proj": "ffn_down"}
    out = {}
    for key, value in weights.items():
        if not key.startswith("visual."):
            continue
        part, suffix = key.removeprefix("visual.").rsplit(".", 1)
        if part == "patch_embed.proj":
            out["v.patch_embd.weight"], out["v.patch_embd.weight.1"] = value[:, :, 0], value[:, :, 1]
        elif part == "merger.ln_q":
            out[f"v.post_ln.{suffix}"] = value
        elif part.startswith("merger.mlp."):
            out[f"mm.{part.rsplit('.', 1)[1]}.{suffix}"] = value
        elif part.endswith("attn.qkv"):
            block = part.split(".")[1]
            for p, third in zip("qkv", value.chunk(3), strict=True):
                out[f"v.blk.{block}.attn_{p}.{suffix}"] = third
        else:
            block, rest = part.split(".", 2)[1:]
            out[f"v.blk.{block}.{names[rest]}.{suffix}"] = value
    return out


def test_both_files_hold_the_checkpoint_tensors_under_llama_cpp_names(qvl):
    weights = load_file(str(qvl["ckpt"] / "model-00001-of-00001.safetensors"))
    want = _mmproj_expected(weights)
    mm = read_tensors(qvl["mmproj"])
    assert sorted(mm) == sorted(want) and len(mm) == 2 * 16 + 7  # 16 a block (qkv as 6), 2 frames, the merger's norm and MLP
    for name, value in want.items():
        t = mm[name]
        f32 = value.dim() == 1
        assert t.tensor_type == (Q.F32 if f32 else Q.F16), name  # the patch embedding F16 in an f16 file, as the converter
        expected = value.float().numpy().astype(np.float32 if f32 else np.float16)
        assert np.array_equal(np.asarray(t.data).reshape(expected.shape), expected), name
    text = read_tensors(qvl["model"])
    assert len(text) == sum(not k.startswith("visual.") for k in weights) and not any(n.startswith(("v.", "mm.")) for n in text)
    assert np.array_equal(np.asarray(text["blk.1.attn_k.bias"].data), weights["model.layers.1.self_attn.k_proj.bias"].float().numpy())
    assert np.array_equal(np.asarray(text["output.weight"].data), weights["lm_head.weight"].half().numpy())
    fields = {k: f.contents() for k, f in gguf.GGUFReader(qvl["model"]).fields.items()}
    assert fields["general.architecture"] == "qwen2vl" and fields["qwen2vl.rope.dimension_sections"] == [4, 6, 6, 0]
    assert fields["qwen2vl.rope.freq_base"] == 1e6
    fields = {k: f.contents() for k, f in gguf.GGUFReader(qvl["mmproj"]).fields.items()}
    assert {k: fields[k] for k in fields if k.startswith("clip.") and not k.endswith(("_mean", "_std"))} == {
        "clip.has_vision_encoder": True,
        "clip.vision.projection_dim": 128,
        "clip.vision.image_size": 560,  # the converter's, where vision_config has none
        "clip.vision.patch_size": 14,
        "clip.vision.embedding_length": 64,
        "clip.vision.feed_forward_length": 128,
        "clip.vision.block_count": 2,
        "clip.vision.attention.head_count": 4,
        "clip.projector_type": "qwen2.5vl_merger",  # gguf's VisionProjectorType.QWEN25VL
        "clip.use_silu": True,
        "clip.vision.n_wa_pattern": 2,  # fullatt_block_indexes [1]: every 2nd block attends to the whole image
        "clip.vision.attention.layer_norm_epsilon": pytest.approx(1e-6),
    }
    lines = (qvl["model"].parent / "Modelfile").read_text().splitlines()
    assert lines[:2] == ["FROM ./model-f16.gguf", "FROM ./model-mmproj-f16.gguf"]


def test_kquant_language_model_is_llama_quantize(qvl, tmp_path):
    """``--type q4_k_m``: the language model (``qwen2vl``) byte for byte llama-quantize's q4_k_m of slimtune's
    f32 file (rows of 128 fall back to 32-blocks, ffn_down's 256 take K-quants); the same mmproj as f16's."""
    f32, ours = tmp_path / "f32" / "m-f32.gguf", tmp_path / "m-q4_k_m.gguf"
    for out, kind in ((f32, "f32"), (ours, "q4_k_m")):  # the mmproj beside each: m-mmproj-f16.gguf
        assert slimtune_main(["export", str(qvl["ckpt"]), "--type", kind, "--out", str(out)]) == 0
    assert_same_gguf(ours, llama_quantize(f32, tmp_path / "llama-q4_k_m.gguf", "q4_k_m"), LLAMA_QUANTIZE_ADDS)
    assert {t.name: t.tensor_type for t in read_tensors(ours).values()}["blk.0.ffn_down.weight"] in (Q.Q4_K, Q.Q6_K)
    assert (tmp_path / "m-mmproj-f16.gguf").read_bytes() == qvl["mmproj"].read_bytes()


def test_llama_cpp_encodes_the_image_and_answers_as_transformers(qvl):
    """mtmd loads the pair; its embeddings of a 224 x 112 image (aligned to 28 pixels: not resized) are
    transformers' image features; after the prompt its logits are transformers' on the same tokens
    (the image tokens in the image chunk's place) at the same M-RoPE positions. llama.cpp's qwen2vl (the
    build here) does not read ``qwen2vl.attention.layer_norm_rms_epsilon`` (the file holds the config's, as
    the converter writes it) and computes the language model's norms with 0: transformers' norms do so here
    too (with the config's 1e-5 the logits differ by 0.015 std, by 0.016 on text alone)."""
    from transformers import Qwen2VLImageProcessorPil

    image = np.random.default_rng(0).integers(0, 256, (112, 224, 3), dtype=np.uint8)
    prompt = b"<|bos|>Read the chart: " + mtmd.mtmd_default_marker() + b" The value is "
    parts, theirs, cpp_last, n_past = mtmd_answer(qvl["model"], qvl["mmproj"], prompt, image, mrope=True)
    model = AutoModelForImageTextToText.from_pretrained(qvl["ckpt"], dtype=torch.float32).eval()
    for norm in model.model.language_model.modules():  # as llama.cpp computes: its qwen2vl reads no rms epsilon (0.0)
        if hasattr(norm, "variance_epsilon"):
            norm.variance_epsilon = 0.0
    size = {"shortest_edge": 8 * 28 * 28, "longest_edge": 4096 * 28 * 28}  # llama.cpp's limits: 8 to 4096 merged tokens
    processor = Qwen2VLImageProcessorPil.from_pretrained(qvl["ckpt"], size=size)
    pixels = processor(images=[PIL.Image.fromarray(image)], return_tensors="pt")
    assert pixels["image_grid_thw"].tolist() == [[1, 8, 16]] and len(theirs) == 1 and theirs[0].shape == (32, 128)
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
        ours = torch.cat(list(getattr(features, "pooler_output", features))).numpy()
        assert np.abs(ours - theirs[0]).max() <= EMBED_BOUND * ours.std()
        image_id = model.config.image_token_id
        ids = [i for kind, x in parts for i in (x if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT else [image_id] * x)]
        image_parts = (torch.tensor([ids]) == image_id).int()  # where the image is: M-RoPE positions
        logits = model(input_ids=torch.tensor([ids]), mm_token_type_ids=image_parts, **pixels).logits[0, -1].numpy()
    assert n_past == len(ids) - 32 + 8  # M-RoPE: the image takes max(4, 8) positions, not its 32 tokens
    assert np.abs(logits - cpp_last).max() <= LOGIT_BOUND * logits.std()
    top2 = np.sort(logits)[-2:]
    assert int(cpp_last.argmax()) == int(logits.argmax()) or top2[1] - top2[0] <= LOGIT_BOUND * logits.std()


def _edited(qvl, tmp_path, edits: dict):
    """A copy of the merged checkpoint (without its manifest) with config.json's entries replaced by ``edits``."""
    d = tmp_path / "ckpt"
    shutil.copytree(qvl["ckpt"], d, ignore=shutil.ignore_patterns("slimtune_manifest.json", "adapter", "train_state"))
    spec = json.loads((d / "config.json").read_text())
    for dotted, value in edits.items():
        *path, key = dotted.split(".")
        node = spec
        for part in path:
            node = node[part]
        node[key] = value
    (d / "config.json").write_text(json.dumps(spec))
    return d


def test_a_published_flat_config_writes_the_same_files(qvl, tmp_path):
    """Qwen2.5-VL's published config.json has no text_config (the language model's keys at the top level) and
    the older ``rope_scaling: {type: mrope}``: the same two files as transformers 5's nested config."""
    src = _edited(qvl, tmp_path, {})
    cfg = json.loads((src / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**cfg, **{k: v for k, v in text.items() if k != "model_type"}, "rope_theta": rope["rope_theta"]}
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    (src / "config.json").write_text(json.dumps(flat))
    out = tmp_path / "flat" / "model-f16.gguf"
    assert slimtune_main(["export", str(src), "--out", str(out)]) == 0
    for name in ("model-f16.gguf", "model-mmproj-f16.gguf"):
        assert (out.parent / name).read_bytes() == (qvl["model"].parent / name).read_bytes(), name


@pytest.mark.parametrize(
    ("edits", "expected"),
    [
        ({"vision_config.window_size": 56}, "vision_config.window_size is 56; llama.cpp's qwen2.5vl mmproj assumes 112"),
        ({"vision_config.fullatt_block_indexes": [0]}, "fullatt_block_indexes [0]: llama.cpp's qwen2.5vl attends to the whole image in"),
        ({"vision_config.depth": 3}, "vision_config.depth is 3, the checkpoint holds vision blocks [0, 1]"),
        ({"vision_config.intermediate_size": 96}, "mmproj tensor v.blk.0.ffn_gate.weight is [128, 64]; vision_config (hidden_size"),
        (
            {"text_config.rope_parameters.mrope_section": [4, 6, 4]},
            "mrope_section [4, 6, 4]: expected up to 4 counts of rotary pairs summing to",
        ),
    ],
    ids=["window", "fullatt", "depth", "mlp-width", "mrope-sections"],
)
def test_bad_qwen_vl_settings_are_one_line_exit_2(qvl, tmp_path, capsys, edits, expected):
    """What llama.cpp's qwen2vl / qwen2.5vl cannot be told, or shapes the metadata contradicts: one line
    naming the file and key, exit 2, neither file written."""
    src, out = _edited(qvl, tmp_path, edits), tmp_path / "m.gguf"
    assert slimtune_main(["export", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
    assert not out.exists() and not out.with_name("m-mmproj-f16.gguf").exists()
