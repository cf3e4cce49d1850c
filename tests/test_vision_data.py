"""Vision conversation rows (data/vision.py) on the tiny SmolVLM (tiny.make_tiny_vision_checkpoint): TRL's
format with images as paths relative to the data file or a datasets ``Image`` feature in Parquet; the
oracle is the checkpoint's own processor rendering and expanding the whole conversation at once. Only
assistant turns are trained; every bad row is one line naming the file and row (the CLI exits 2); a seeded
fuzzer of vision rows (corrupt image bytes, odd sizes and modes, wrong part types and counts) finds no
error but SlimtuneError, and every row it accepts goes through a batch and the model."""

from __future__ import annotations

import io
import json
import random
import time
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from transformers import AutoModelForImageTextToText

from slimtune.cli import main
from slimtune.data import IGNORE_INDEX, DataSpec, collate, load_data, model_inputs
from slimtune.errors import SlimtuneError
from slimtune.model import load_processor, load_tokenizer
from slimtune.tiny import make_tiny_vision_checkpoint


def image_row(question: str, answer: str, images: list, parts: int | None = None) -> dict:
    """A TRL vision row: ``parts`` image parts (default: one per image) before the question."""
    content = [{"type": "image"}] * (len(images) if parts is None else parts) + [{"type": "text", "text": question}]
    return {
        "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
        "images": images,
    }


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def png(path: Path, size=(40, 30), color=(200, 40, 40), mode="RGB") -> Path:
    PIL.Image.new(mode, size, color if mode == "RGB" else 128).save(path)
    return path


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """The tiny SmolVLM's directory, processor and tokenizer, and a data directory with two images in a subfolder."""
    root = tmp_path_factory.mktemp("vision-data")
    base = make_tiny_vision_checkpoint(root / "base")
    (root / "data" / "img").mkdir(parents=True)
    png(root / "data" / "img" / "red.png")
    png(root / "data" / "img" / "blue.png", size=(64, 20), color=(30, 30, 220))
    return dict(root=root, base=base, processor=load_processor(base), tokenizer=load_tokenizer(base))


def load(vlm, path: Path, max_seq_len: int = 256, with_processor: bool = True):
    spec = DataSpec([str(path)], max_seq_len=max_seq_len)
    return load_data(spec, vlm["tokenizer"], vocab_size=262, processor=vlm["processor"] if with_processor else None)


def test_vision_rows_expand_images_as_the_processor_does_and_train_assistant_turns_only(vlm):
    data_dir, processor = vlm["root"] / "data", vlm["processor"]
    rows = [
        image_row("What color?", "Red.", ["img/red.png"]),
        image_row("Compare.", "Both.", ["img/red.png", str(data_dir / "img" / "blue.png")]),  # relative and absolute paths
        {"messages": [{"role": "user", "content": "No image."}, {"role": "assistant", "content": "Text only."}]},
    ]
    data = load(vlm, write_rows(data_dir / "train.jsonl", rows))
    assert len(data.train) == 3 and data.images is not None and data.shapes == {"chat": 3}
    image_id = processor.image_token_id
    for row, example in zip(rows, data.train, strict=True):
        images = [PIL.Image.open(data_dir / p if not Path(p).is_absolute() else p) for p in row.get("images", [])]
        text = processor.apply_chat_template(row["messages"], tokenize=False)
        oracle = processor(text=[text], images=[images] if images else None, add_special_tokens=False)["input_ids"][0]
        assert example.input_ids.tolist() == list(oracle)  # piece by piece = the processor on the whole conversation
        assert int((example.input_ids == image_id).sum()) == 4 * len(images)  # 64 x 64, unsplit: 4 tokens an image
        answer = row["messages"][1]["content"]
        answer = answer if isinstance(answer, str) else answer[0]["text"]
        trained = example.labels[example.labels != IGNORE_INDEX].tolist()
        assert vlm["tokenizer"].decode(trained) == f"{answer}<|eos|>\n"  # the assistant turn only, image tokens never
        assert [Path(r.source) for r in example.images] == [data_dir / "img" / Path(p).name for p in row.get("images", [])]
    batch = collate(data.train, pad_id=256, images=data.images)
    assert batch["pixel_values"].shape == (3, 2, 3, 64, 64)  # rows padded to the most images, the processor's way
    assert batch["pixel_attention_mask"].flatten(2).sum(-1).tolist() == [[4096, 0], [4096, 4096], [0, 0]]
    assert set(model_inputs(batch)) == {"input_ids", "attention_mask", "use_cache", "pixel_values", "pixel_attention_mask"}


def test_gemma3_rows_expand_as_its_processor_does_with_token_type_ids(vlm):
    """Gemma 3's processor (the tiny one: <start_of_image> in the template, 4 <image_soft_token> an image):
    the ids are the processor's on the whole conversation, image tokens never targets (train_on_inputs too),
    and the batch carries the processor's token_type_ids (1 on the soft tokens) into the forward pass."""
    base = make_tiny_vision_checkpoint(vlm["root"] / "gemma3", model_type="gemma3")
    processor, data_dir = load_processor(base), vlm["root"] / "data"
    rows = [image_row("Compare.", "Both.", ["img/red.png", "img/blue.png"]), image_row("What color?", "Red.", ["img/red.png"])]
    spec = DataSpec([str(write_rows(data_dir / "gemma3.jsonl", rows))], max_seq_len=256, train_on_inputs=True)
    data = load_data(spec, load_tokenizer(base), vocab_size=262, processor=processor)
    soft, boi = processor.tokenizer.image_token_id, processor.tokenizer.boi_token_id
    oracles = []
    for row, example in zip(rows, data.train, strict=True):
        images = [[PIL.Image.open(data_dir / p) for p in row["images"]]]
        oracle = processor(text=[processor.apply_chat_template(row["messages"], tokenize=False)], images=images, add_special_tokens=False)
        oracles.append(oracle)
        assert example.input_ids.tolist() == list(oracle["input_ids"][0])
        assert int((example.input_ids == soft).sum()) == 4 * len(row["images"])
        trained = example.labels[example.labels != IGNORE_INDEX]
        assert soft not in trained.tolist() and boi not in trained.tolist() and len(trained) > 20  # the text tokens, user turn too
    batch = collate(data.train, pad_id=256, images=data.images)
    for row, oracle in enumerate(oracles):
        n = len(oracle["token_type_ids"][0])
        assert batch["token_type_ids"][row, :n].tolist() == list(oracle["token_type_ids"][0]) and not batch["token_type_ids"][row, n:].any()
    assert batch["pixel_values"].shape == (3, 3, 64, 64)  # one 64 x 64 tile an image
    assert set(model_inputs(batch)) == {"input_ids", "attention_mask", "use_cache", "pixel_values", "token_type_ids"}


def test_a_parquet_image_feature_gives_the_same_tokens_and_pixels_as_paths(vlm):
    datasets = pytest.importorskip("datasets")
    data_dir = vlm["root"] / "data"
    rows = [image_row("What color?", "Red.", ["img/red.png"]), image_row("And this?", "Blue.", ["img/blue.png"])]
    by_path = load(vlm, write_rows(data_dir / "paths.jsonl", rows))
    table = {
        "messages": [r["messages"] for r in rows],
        "images": [[{"bytes": (data_dir / p).read_bytes(), "path": None} for p in r["images"]] for r in rows],
    }
    features = datasets.Features(
        {
            "messages": datasets.Dataset.from_dict({"messages": table["messages"]}).features["messages"],
            "images": datasets.Sequence(datasets.Image()),
        }
    )
    datasets.Dataset.from_dict(table, features=features).to_parquet(data_dir / "train.parquet")
    by_feature = load(vlm, data_dir / "train.parquet")
    for a, b in zip(by_path.train, by_feature.train, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
        assert all(isinstance(r.source, bytes) for r in b.images)  # the encoded bytes, decoded per batch
    pixels = [collate(d.train, 256, d.images)["pixel_values"] for d in (by_path, by_feature)]
    assert torch.equal(*pixels)


def test_the_data_identity_covers_the_images_bytes(vlm, tmp_path):
    """Resume refuses changed data (checkpoint.run_state.check_data): an image changed under the same path changes it."""
    path = write_rows(tmp_path / "train.jsonl", [image_row("Q?", "A.", ["red.png"])])
    png(tmp_path / "red.png")
    first, again = load(vlm, path).sha256, load(vlm, path).sha256
    png(tmp_path / "red.png", color=(201, 40, 40))
    assert first == again != load(vlm, path).sha256


BAD_ROWS = {
    "missing image": (image_row("Q?", "A.", ["img/nope.png"]), "image 1 (img/nope.png): no such image file"),
    "unreadable image": (image_row("Q?", "A.", ["img/corrupt.png"]), "image 1 (img/corrupt.png): cannot read the image"),
    "image part without an image": ({"messages": image_row("Q?", "A.", ["x"])["messages"]}, "1 image part(s) in 'messages' but no image"),
    "more image parts than images": (image_row("Q?", "A.", ["img/red.png"], parts=2), "more image part(s) than images: 2 image part(s)"),
    "more images than image parts": (image_row("Q?", "A.", ["img/red.png", "img/red.png"], parts=1), "more images than image part(s)"),
    "past max_seq_len": (
        image_row("Q?" * 10, "A.", ["img/red.png"]),
        "tokens once the image tokens are expanded, over dataset.max_seq_len=60",
    ),
    "wrong part type": (
        {"messages": [{"role": "user", "content": [{"type": "video"}]}, {"role": "assistant", "content": "A."}], "images": []},
        'messages[0].content[0] must be {"type": "image"} or {"type": "text", "text": "..."}',
    ),
    "image token in text": (image_row("look: <image>", "A.", ["img/red.png"]), "rendered 2 image token(s) '<image>' for 1 image part(s)"),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_each_bad_vision_row_is_one_line_naming_the_file_and_row(vlm, case, tmp_path):
    row, needle = BAD_ROWS[case]
    (tmp_path / "img").mkdir()
    png(tmp_path / "img" / "red.png")
    (tmp_path / "img" / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(200)))
    path = write_rows(tmp_path / "train.jsonl", [image_row("Fine?", "Yes.", ["img/red.png"]), row])
    with pytest.raises(SlimtuneError) as e:
        load(vlm, path, max_seq_len=60)
    message = str(e.value)
    assert message.startswith(f"{path}:2: ") and needle in message and "\n" not in message, message


def test_image_rows_on_a_text_model_and_packed_image_rows_are_refused(vlm, tmp_path):
    png(tmp_path / "red.png")
    path = write_rows(tmp_path / "train.jsonl", [image_row("Q?", "A.", ["red.png"])])
    with pytest.raises(SlimtuneError, match=rf"^{path}:1: a row with images \(content parts\) needs a vision-language model's processor$"):
        load(vlm, path, with_processor=False)
    spec = DataSpec([str(path)], packed=True)
    with pytest.raises(SlimtuneError, match="rows with images cannot be packed; set dataset.packed=false"):
        load_data(spec, vlm["tokenizer"], processor=vlm["processor"])


def test_the_cli_exits_2_with_one_line_for_a_missing_image_before_loading_the_model(vlm, tmp_path, capsys):
    png(tmp_path / "red.png")
    path = write_rows(tmp_path / "train.jsonl", [image_row("Q?", "A.", ["red.png"]), image_row("Q?", "A.", ["gone.png"])])
    out = tmp_path / "run"
    settings = [
        f"output_dir={out}",
        f"model.path={vlm['base']}",
        "model.create_tiny=false",
        f"dataset.path={path}",
        "dataset.create_builtin=false",
    ]
    code = main(["finetune", "--config", "tiny", *settings, "logging.progress_bar=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"slimtune finetune: error: {path}:2: image 1 (gone.png): no such image file"], err
    assert not out.exists()


# --- the fuzzer -----------------------------------------------------------------------------------------

MODES = ["RGB", "L", "LA", "P", "RGBA", "CMYK", "1", "I", "F", "I;16"]
FORMATS = ["PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF"]


def _image_bytes(rng: random.Random) -> bytes:
    """An image of a random size (1 to 300 pixels a side), mode and format; sometimes its bytes corrupted."""
    size = (rng.choice([1, 2, rng.randint(1, 300)]), rng.choice([1, 3, rng.randint(1, 300)]))
    mode, fmt = rng.choice(MODES), rng.choice(FORMATS)
    pixels = np.random.default_rng(rng.randint(0, 2**31)).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    image = PIL.Image.fromarray(pixels).convert(mode) if mode not in ("I;16",) else PIL.Image.new(mode, size)
    buf = io.BytesIO()
    try:
        image.save(buf, format=fmt)
    except (OSError, ValueError, KeyError):  # a mode the format cannot hold: TIFF holds every one here
        buf = io.BytesIO()
        image.save(buf, format="TIFF")
    raw = bytearray(buf.getvalue())
    roll = rng.random()
    if roll < 0.15:  # flipped bytes
        for _ in range(rng.randint(1, 20)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
    elif roll < 0.25:  # cut short
        raw = raw[: rng.randrange(len(raw))]
    elif roll < 0.3:
        raw = bytearray(rng.randbytes(rng.randint(0, 300)))
    return bytes(raw)


def _part(rng: random.Random):
    """A content part: mostly good, sometimes of a wrong type or shape."""
    return rng.choice(
        [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "What is it?"}, {"type": "text", "text": "<image>"},
         {"type": "text"}, {"type": "image", "text": None}, {"type": 3}, {"kind": "image"}, "image", None, 7, [],
         {"type": "text", "text": ["x"]}]
    )  # fmt: skip


def _fuzz_row(rng: random.Random, folder: Path) -> dict:
    """A vision row with random parts and images (files written under ``folder``, or wrong entries)."""
    content = [_part(rng) if rng.random() < 0.2 else {"type": "image"} for _ in range(rng.randint(0, 3))] + [{"type": "text", "text": "Q?"}]
    parts = sum(1 for p in content if isinstance(p, dict) and p.get("type") == "image")
    count = parts if rng.random() < 0.7 else rng.randint(0, 4)
    images = []
    for i in range(count):
        kind = rng.random()
        if kind < 0.85:
            (folder / f"{i}.img").write_bytes(_image_bytes(rng))
            images.append(f"{i}.img")
        else:
            images.append(rng.choice(["missing.png", "", ".", 5, None, {"path": 3}, {"bytes": "text"}]))
    row = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": [{"type": "text", "text": "A."}]}]}
    if rng.random() < 0.9:
        row["images"] = images if rng.random() < 0.95 else "0.img"
    return row


@pytest.mark.filterwarnings("ignore::UserWarning")  # PIL's warnings on the corrupt files it still reads
def test_seeded_fuzzer_of_vision_rows_refuses_in_one_line_and_every_accepted_row_runs_the_model(vlm, tmp_path):
    """400 seeded rows: each is refused in one line naming its file, or accepted, batched (its images decoded
    again) and run through the model with finite logits."""
    rng = random.Random(47)
    model = AutoModelForImageTextToText.from_pretrained(vlm["base"], dtype=torch.float32).eval()
    counts, slowest = {"accepted": 0, "refused": 0}, 0.0
    for case in range(400):
        folder = tmp_path / str(case)
        folder.mkdir()
        path = write_rows(folder / "train.jsonl", [_fuzz_row(rng, folder)])
        started = time.perf_counter()
        try:
            data = load(vlm, path, max_seq_len=128)
            batch = collate(data.train, 256, data.images)
        except SlimtuneError as e:
            counts["refused"] += 1
            assert str(e).startswith(f"{path}") and "\n" not in str(e), (case, str(e))
            continue
        finally:
            slowest = max(slowest, time.perf_counter() - started)
        counts["accepted"] += 1
        images = data.train[0].images
        assert ("pixel_values" in batch) == bool(images)
        with torch.no_grad():
            logits = model(**model_inputs(batch)).logits
        assert torch.isfinite(logits).all(), case
    print(f"vision fuzzer: {counts}, slowest case {slowest:.2f} s")
    assert counts["accepted"] >= 50 and counts["refused"] >= 50, counts
    assert slowest < 5, slowest
