"""``python -m bench gguf-vision --out DIR [--family gemma3|qwen2_5_vl] [--type TYPE]``: slimtune's GGUF + mmproj
of a tiny SmolVLM (Idefics3), Gemma 3 or Qwen2.5-VL against llama.cpp's own converter (``convert_hf_to_gguf.py``
and ``--mmproj``) on the same merged checkpoint.

Qwen2.5-VL: ``make_trained_qwen_vl`` (tests/test_vision_families.py's tiny model and its 2 QLoRA steps) with
SmolLM2's tokenizer plus the image tokens and 4 vision blocks (the converter cannot convert fewer than 3: it
names the merger's ``mlp.2`` through the block map); the converter takes its directory as it is.

The checkpoint: ``make_tiny_vision_checkpoint`` with SmolLM2's tokenizer (the converter cannot name the
byte-level fallback's pre-tokenizer) plus the image tokens, fine-tuned 2 steps on image rows by
``slimtune finetune`` (QLoRA, merged save). slimtune exports it (``--type f16``, mmproj f16); the converter
runs on the same directory, once with ``--mmproj`` and once for the language model. The converter picks its
text class from ``text_config.architectures``, which SmolVLM's published configs carry
(``VLlama3ForCausalLM``) and transformers' Idefics3 config does not write: its text run reads a copy of the
directory whose config.json has that one key added (the weights linked, not copied). Gemma 3: the converter
names SigLIP's tensors as Gemma 3's published checkpoints hold them (``vision_tower.vision_model.*``), which
transformers 5 no longer writes (its save, and so slimtune's merged one, has ``vision_tower.*``): its ``--mmproj``
run reads a copy of the directory whose weights carry the published names (the same tensors, renamed).

Prints one JSON line per file: metadata keys that differ (apart from the general.* keys only the converter writes
(``general.name``, ``general.size_label``, ...), which it makes up from the directory name and the parameter
count, and from a model card: every general.* key but architecture, type, file_type and
quantization_version), tensors (name, type, shape, order) and their data bytes, and whether the data sections and whole
files are byte-identical. Needs the converter extracted (``bash bench/peers/llama_cpp_convert.sh --setup``
or its ``llama.cpp/`` folder) and the real model's tokenizer (``make real-model``).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import gguf

CONVERTER = Path(__file__).resolve().parent / "peers" / "llama.cpp" / "convert_hf_to_gguf.py"
PEER_PYTHON = Path(__file__).resolve().parent / "peers" / ".venv-llamacpp" / "bin" / "python"
GENERAL_KEYS = ("general.architecture", "general.type", "general.file_type", "general.quantization_version")
"""The general.* keys slimtune writes; the converter's other general.* keys (name, basename, version, size label,
tags, base models) are made up from the directory's name, the parameter count and a model card."""


def _named(key: str) -> bool:
    return key.startswith("general.") and key not in GENERAL_KEYS


def compare_gguf(ours: Path, theirs: Path) -> dict:
    """Two GGUF files field by field and tensor by tensor: metadata (values, types and order) apart from the
    converter's own general.* keys (``_named``), tensor infos, each tensor's bytes, the data sections and
    the whole files."""
    a, b = gguf.GGUFReader(ours), gguf.GGUFReader(theirs)

    def fields(r: gguf.GGUFReader) -> dict:
        return {k: ([int(t) for t in f.types], f.contents()) for k, f in r.fields.items() if not k.startswith("GGUF.") and not _named(k)}

    fa, fb = fields(a), fields(b)
    infos = [[(t.name, t.tensor_type.name, [int(n) for n in t.shape]) for t in r.tensors] for r in (a, b)]
    same_data = sum(x.data.tobytes() == y.data.tobytes() for x, y in zip(a.tensors, b.tensors, strict=False))
    sections = [Path(p).read_bytes()[r.tensors[0].data_offset :] if r.tensors else b"" for p, r in ((ours, a), (theirs, b))]
    return {
        "file": Path(ours).name,
        "peer_file": Path(theirs).name,
        "bytes": [Path(ours).stat().st_size, Path(theirs).stat().st_size],
        "only_peer_general_keys": sorted(k for k in b.fields if _named(k)),
        "metadata_keys_compared": len(fb),
        "metadata_missing": sorted(fb.keys() - fa.keys()),
        "metadata_extra": sorted(fa.keys() - fb.keys()),
        "metadata_differ": sorted(k for k in fa.keys() & fb.keys() if fa[k] != fb[k]),
        "metadata_order_equal": list(fa) == list(fb),
        "tensor_infos_equal": infos[0] == infos[1],
        "tensors": len(infos[1]),
        "tensor_bytes_equal": same_data,
        "data_section_identical": sections[0] == sections[1],
        "data_section_sha256": hashlib.sha256(sections[0]).hexdigest()[:16],
        "file_identical": Path(ours).read_bytes() == Path(theirs).read_bytes(),
    }


def make_trained_vlm(out: Path, tokenizer_dir: Path, settings: tuple[str, ...] = (), model_type: str = "idefics3") -> Path:
    """The tiny SmolVLM (or ``model_type`` ``gemma3``: Gemma 3) with ``tokenizer_dir``'s tokenizer, fine-tuned 2
    steps on image rows (more config ``settings``, e.g. ``lora.vision=true``): its merged checkpoint, under ``out/run``."""
    import PIL.Image
    from transformers import AutoTokenizer

    from slimtune.config import load_config
    from slimtune.recipes.finetune import run_finetune
    from slimtune.tiny import make_tiny_vision_checkpoint

    base = make_tiny_vision_checkpoint(out / "base", tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir), model_type=model_type)
    PIL.Image.new("RGB", (48, 40), (220, 30, 30)).save(out / "red.png")
    PIL.Image.new("RGB", (30, 60), (30, 30, 220)).save(out / "blue.png")
    rows = [("Color?", "Red.", "red.png"), ("Color?", "Blue.", "blue.png")] * 2
    with open(out / "train.jsonl", "w") as f:
        for q, a, image in rows:
            user = [{"type": "image"}, {"type": "text", "text": q}]
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": [{"type": "text", "text": a}]}]
            f.write(json.dumps({"messages": messages, "images": [image]}) + "\n")
    settings = [*settings, f"output_dir={out / 'run'}", f"model.path={base}", "model.create_tiny=false"]
    settings += [f"dataset.path={out / 'train.jsonl'}"]
    settings += ["dataset.create_builtin=false", "training.batch_size=2", "training.max_steps=2", "logging.progress_bar=false"]
    return run_finetune(load_config("tiny", settings)).checkpoint


def make_trained_qwen_vl(out: Path, tokenizer=None, lora_vision: bool = False, **vision) -> Path:
    """The tiny Qwen2.5-VL of tests/test_vision_families.py (``vision_families.TINY``, ``vision`` over its
    vision_config; ``tokenizer``: a text tokenizer, the byte tokenizer by default, plus the image tokens), bf16,
    with Qwen2VLImageProcessor's preprocessor_config.json, QLoRA-trained 2 steps on an image + text row as
    that test trains it (the random-pixel batch: Qwen2.5-VL's processor needs torchvision; ``lora_vision``:
    LoRA on the tower's linears too) and saved:
    the merged checkpoint, under ``out/ckpt``.

    Example: ``make_trained_qwen_vl(Path("q"), depth=4, fullatt_block_indexes=[1, 3])`` -> ``Path("q/ckpt")``"""
    import torch
    from transformers import AutoModelForImageTextToText, Qwen2VLImageProcessor

    from slimtune.checkpoint.save import save_checkpoint
    from slimtune.checkpoint.writer import WriteOptions
    from slimtune.families import family_of, tiny_config
    from slimtune.lora import LoRAConfig
    from slimtune.model import load_qlora_model
    from slimtune.tiny import byte_tokenizer
    from slimtune.vision_families import IMAGE_TOKENS, TINY
    from tests.test_vision_families import ANSWER, image_batch, train

    tok = byte_tokenizer() if tokenizer is None else tokenizer
    text_vocab = len(tok)
    tok.add_tokens([name for name, _ in IMAGE_TOKENS["qwen2_5_vl"]], special_tokens=True)
    config = tiny_config(family_of("qwen2_5_vl"), vocab_size=text_vocab, vision_config=dict(TINY["qwen2_5_vl"]["vision_config"], **vision))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the tokenizer's own (another tokenizer's differ)
        if getattr(tok, key, None) is not None:
            setattr(config.text_config, key, getattr(tok, key))
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).to(torch.bfloat16).save_pretrained(out / "base")
    tok.save_pretrained(out / "base")
    Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=56 * 56).save_pretrained(out / "base")
    model = load_qlora_model(out / "base", LoRAConfig(rank=8, alpha=16, vision=lora_vision), seed=0, progress=False)
    if tok.bos_token_id is None:  # image_batch starts the row with the tokenizer's bos
        tok.bos_token_id = config.text_config.bos_token_id
    train(model, image_batch("qwen2_5_vl", tok, ANSWER))
    save_checkpoint(model, out / "ckpt", WriteOptions(progress=False))
    return out / "ckpt"


def _converter(python: Path, model: Path, outfile: Path, mmproj: bool, kind: str = "f16") -> float:
    started = time.perf_counter()
    cmd = [str(python), str(CONVERTER), str(model), "--outtype", kind, "--outfile", str(outfile), *(["--mmproj"] if mmproj else [])]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def _with_text_architecture(ckpt: Path, out: Path) -> Path:
    """A view of ``ckpt`` (files linked) whose config.json names the text class as SmolVLM's published one does."""
    out.mkdir(exist_ok=True)
    for f in ckpt.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["text_config"]["architectures"] = ["VLlama3ForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _with_published_vision_names(ckpt: Path, out: Path) -> Path:
    """A copy of Gemma 3 ``ckpt`` (other files linked) whose weights name SigLIP's tensors as the published
    checkpoints do (``vision_tower.x`` -> ``vision_tower.vision_model.x``), the names the converter maps."""
    from safetensors.torch import load_file, save_file

    def published(key: str) -> str:
        return key.replace("vision_tower.", "vision_tower.vision_model.", 1) if key.startswith("vision_tower.") else key

    out.mkdir(exist_ok=True)
    for f in ckpt.iterdir():
        if f.suffix == ".safetensors":
            save_file({published(k): v for k, v in load_file(str(f)).items()}, str(out / f.name), metadata={"format": "pt"})
        elif f.name.endswith(".safetensors.index.json"):
            index = json.loads(f.read_text())
            index["weight_map"] = {published(k): v for k, v in index["weight_map"].items()}
            (out / f.name).write_text(json.dumps(index))
        elif not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    return out


def bench_gguf_vision(
    out: Path, tokenizer_dir: Path, python: Path | None = None, lora_vision: bool = False, model_type: str = "idefics3", kind: str = "f16"
) -> list[dict]:
    """slimtune's export of the trained tiny SmolVLM (or Gemma 3, or Qwen2.5-VL) and the converter's, compared
    (``compare_gguf``); ``kind``: both files' type and the converter's ``--outtype`` (f16, f32, bf16, q8_0)."""
    from slimtune.cli import main as slimtune_main

    if not CONVERTER.is_file():
        raise SystemExit(f"{CONVERTER}: missing; run bash bench/peers/llama_cpp_convert.sh --setup")
    python = python or (PEER_PYTHON if PEER_PYTHON.is_file() else Path(sys.executable))
    out.mkdir(parents=True, exist_ok=True)
    if model_type == "qwen2_5_vl":
        ckpt = _trained_qwen_vl(out, tokenizer_dir, lora_vision)
    else:
        ckpt = make_trained_vlm(out, tokenizer_dir, (f"lora.vision={str(lora_vision).lower()}",), model_type)
    started = time.perf_counter()
    argv = ["export", str(ckpt), "--type", kind, "--mmproj-type", kind, "--out", str(out / f"model-{kind}.gguf"), "--overwrite"]
    assert slimtune_main(argv) == 0
    ours_s = time.perf_counter() - started
    gemma3 = model_type == "gemma3"
    vision_view = _with_published_vision_names(ckpt, out / "peer-vision-view") if gemma3 else ckpt
    peer_mm = _converter(python, vision_view, out / f"peer-mmproj-{kind}.gguf", mmproj=True, kind=kind)
    # Gemma 3's and Qwen2.5-VL's configs name their class; SmolVLM's needs the view
    text_view = _with_text_architecture(ckpt, out / "peer-view") if model_type == "idefics3" else ckpt
    peer_text = _converter(python, text_view, out / f"peer-{kind}.gguf", mmproj=False, kind=kind)
    rows = [compare_gguf(out / f"model-{n}{kind}.gguf", out / f"peer-{n}{kind}.gguf") for n in ("mmproj-", "")]
    for row, peer_s in zip(rows, (peer_mm, peer_text), strict=True):
        row |= {"family": model_type, "type": kind, "lora_vision": lora_vision, "slimtune_s_both_files": round(ours_s, 2)}
        row["converter_s"] = round(peer_s, 2)
        row["converter_python"] = str(python)
    return rows


def _trained_qwen_vl(out: Path, tokenizer_dir: Path, lora_vision: bool) -> Path:
    """``make_trained_qwen_vl`` with ``tokenizer_dir``'s tokenizer and 4 vision blocks (full attention in
    blocks 1 and 3): the converter names the merger's ``mlp.2`` as block 2, so it cannot convert fewer than 3."""
    import shutil

    from transformers import AutoTokenizer

    shutil.rmtree(out / "qwen-vl", ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return make_trained_qwen_vl(out / "qwen-vl", tokenizer, lora_vision, depth=4, fullatt_block_indexes=[1, 3])
