"""Vision conversation rows (TRL's format) -> token ids, image references and, at batch time, pixels.

A vision row is a chat row whose messages' ``content`` is a list of parts, ``{"type": "image"}`` and
``{"type": "text", "text": ...}``, with the row's images in an ``images`` column, in the order of the
image parts: local paths (relative to the data file's directory) or a ``datasets`` ``Image`` feature
(Parquet, Arrow: ``{"bytes", "path"}``, read undecoded). The checkpoint's own processor
(``AutoProcessor``) renders the conversation with its chat template, expands each image part into the
image's tokens and makes the pixel values; only assistant turns are trained on (``train_on_inputs``:
every text token), image tokens never. On a vision-language model every chat row takes this path (a
string content is one text part), so text and image rows render with the same template.

Images are decoded row by row: loading a row decodes its images once (their token count is checked
against ``max_seq_len``; a row that does not fit is an error, never cut through an image), then keeps
only where each image is (``ImageRef``); each batch decodes its rows' images again (``ImageInputs.pixels``),
so memory does not grow with the dataset's images (an ``Image`` feature's encoded bytes stay in memory).

Example::

    images = ImageInputs(AutoProcessor.from_pretrained("runs/vlm-base"))
    example = images.tokenize(record, Path("data"), max_seq_len=512)
    batch = collate([example], pad_id=0, images=images)   # input_ids, labels, pixel_values, ...
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slimtune.data.readers import Record
from slimtune.data.shapes import IGNORE_INDEX, Example, templated_segments
from slimtune.errors import SlimtuneError

# What a batch passes to the model beside the token ids: the processor's image outputs, and Gemma 3's
# token_type_ids (1 on image tokens: its image tokens attend to each other both ways).
PIXEL_INPUTS = ("pixel_values", "pixel_attention_mask", "image_grid_thw", "token_type_ids")


@dataclass(frozen=True)
class ImageRef:
    """Where one image of a row is: a local file (absolute path) or its encoded bytes."""

    source: str | bytes
    where: str  # "data.jsonl:3: image 1 (cat.png)"


def is_vision_row(record: Record) -> bool:
    """Whether the row is a vision conversation: a message whose content is a list of parts, or images."""
    messages = record.data.get("messages")
    listed = isinstance(messages, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages)
    return listed or record.data.get("images") is not None


class ImageInputs:
    """The checkpoint's processor for vision rows: ``tokenize`` (a row's ids, labels, image references)
    and ``pixels`` (a batch's image inputs); ``digest`` hashes every image read, in order (the run's data
    identity for resume).

    Example: ``ImageInputs(processor).tokenize(record, Path("data"), 512).images[0].where``"""

    def __init__(self, processor: Any):
        self.processor = processor
        self.image_token = getattr(processor, "image_token", None)
        self.image_token_id = getattr(processor, "image_token_id", None)
        # the ids of image tokens: the placeholder and what it expands into (Gemma 3: <start_of_image>, <image_soft_token>)
        self.image_ids = {i for i in (self.image_token_id, *(getattr(processor, "image_token_ids", None) or ())) if i is not None}
        # the processor gives token_type_ids (image tokens 1) the model's attention mask is built from (Gemma 3)
        self.token_types = "token_type_ids" in (getattr(processor, "model_input_names", None) or ())
        self._digest = hashlib.sha256()
        self.rows = 0  # rows with images tokenized

    @property
    def digest(self) -> str:
        return self._digest.hexdigest()

    def tokenize(self, record: Record, base_dir: Path, max_seq_len: int, train_on_inputs: bool = False) -> Example:
        """The row's token ids (image parts expanded by the processor), labels (assistant turns, or every
        text token with ``train_on_inputs``) and image references; every bad row is one line naming it."""
        messages, trained, parts = _conversation(record)
        refs = _image_refs(record, parts, base_dir)
        images = [self._open(ref) for ref in refs]
        if getattr(self.processor, "chat_template", None) is None:
            raise SlimtuneError(f"{record.where}: the model's processor has no chat template (chat_template.jinja); vision rows need one")
        pieces = templated_segments(record, messages, trained, self.processor)
        counts = [text.count(self.image_token) if self.image_token else 0 for text, _ in pieces]
        if sum(counts) != len(images):
            raise SlimtuneError(
                f"{record.where}: the chat template rendered {sum(counts)} image token(s) {self.image_token!r} for {len(images)} "
                "image part(s) (a text part holding the image token?)"
            )
        ids: list[int] = []
        labels: list[int] = []
        used = 0
        for (text, train), count in zip(pieces, counts, strict=True):
            piece = self._expand(record, text, images[used : used + count])
            used += count
            ids += piece
            kept = train or train_on_inputs  # image tokens are never targets
            labels += [IGNORE_INDEX if t in self.image_ids or not kept else t for t in piece]
        if len(ids) > max_seq_len:
            if images:
                raise SlimtuneError(
                    f"{record.where}: {len(ids)} tokens once the image tokens are expanded, over dataset.max_seq_len={max_seq_len} "
                    "(a row with images is never cut; raise max_seq_len or use smaller images)"
                )
            ids, labels = ids[:max_seq_len], labels[:max_seq_len]
        self.rows += bool(refs)
        return Example(torch.tensor(ids, dtype=torch.int32), torch.tensor(labels, dtype=torch.int32), images=tuple(refs))

    def pixels(self, examples: list[Example]) -> dict[str, torch.Tensor]:
        """The image inputs of a batch of ``examples`` (their images decoded again, rows without images
        padded as the processor pads them); empty when no row has an image."""
        if not any(e.images for e in examples):
            return {}
        images = [[self._open(ref, hashed=False) for ref in e.images] for e in examples]
        try:
            out = self.processor.image_processor(images, return_tensors="pt")
        except Exception as e:  # noqa: BLE001 - PIL and the image processors raise many types
            where = next(x.images[0].where for x in examples if x.images)
            raise SlimtuneError(f"{where}: the image processor failed on this batch's images ({_line(e)})") from None
        return {k: v for k, v in out.items() if k in PIXEL_INPUTS}

    def token_type_ids(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"token_type_ids": 1 on image tokens, 0 elsewhere}`` for a batch's ``input_ids``, as the processor
        makes them, when the model takes them (Gemma 3: its image tokens attend to each other both ways);
        empty otherwise.

        Example: ``batch.update(images.token_type_ids(batch["input_ids"]))``"""
        if not self.token_types:
            return {}
        ids = torch.tensor(sorted(self.processor.image_token_ids), dtype=input_ids.dtype)
        return {"token_type_ids": torch.isin(input_ids, ids).long()}

    def _expand(self, record: Record, text: str, images: list) -> list[int]:
        """``text``'s token ids, each image token expanded into its image's tokens (the processor's own rule)."""
        if not text:
            return []
        try:
            out = self.processor(text=[text], images=[images] if images else None, add_special_tokens=False)
        except Exception as e:  # noqa: BLE001 - the processor raises many types for an image it cannot take
            raise SlimtuneError(f"{record.where}: the processor cannot take this row's images ({_line(e)})") from None
        return list(out["input_ids"][0])

    def _open(self, ref: ImageRef, hashed: bool = True):
        raw = read_image_bytes(ref)
        if hashed:
            self._digest.update(hashlib.sha256(raw).digest())
        return decode_image(raw, ref.where)


def read_image_bytes(ref: ImageRef) -> bytes:
    """The encoded bytes of the image ``ref`` names; a missing or unreadable file is one line.

    Example: ``decode_image(read_image_bytes(ImageRef("/data/cat.png", "--image cat.png")), "--image cat.png")``"""
    if isinstance(ref.source, bytes):
        return ref.source
    try:
        return Path(ref.source).read_bytes()
    except FileNotFoundError:
        raise SlimtuneError(f"{ref.where}: no such image file") from None
    except OSError as e:
        raise SlimtuneError(f"{ref.where}: cannot read the image file ({_line(e)})") from None


def decode_image(raw: bytes, where: str):
    """``raw`` decoded as an image (PIL, fully loaded); a corrupt or unknown format is one line naming ``where``.

    Example: ``decode_image(Path("cat.png").read_bytes(), "cat.png").size``"""
    import PIL.Image  # lazy: only runs with vision rows import PIL

    try:
        image = PIL.Image.open(io.BytesIO(raw))
        image.load()
    except Exception as e:  # noqa: BLE001 - PIL raises many types for a corrupt image
        raise SlimtuneError(f"{where}: cannot read the image ({_line(e)})") from None
    return image


def _line(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


def _conversation(record: Record) -> tuple[list[dict], list[bool], int]:
    """The row's messages with their parts checked (content a string, or a list of image and text parts),
    whether each is trained (assistant turns) and how many image parts there are."""
    messages = record.data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise SlimtuneError(f"{record.where}: 'messages' must be a non-empty list of {{role, content}} objects")
    out, parts = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise SlimtuneError(f"{record.where}: messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": [{"type": "text", "text": content}]})
            continue
        if not isinstance(content, list):
            raise SlimtuneError(f"{record.where}: messages[{i}].content must be a string or a list of parts")
        checked = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image":
                checked.append({"type": "image"})
                parts += 1
            elif kind == "text" and isinstance(part.get("text"), str):
                checked.append({"type": "text", "text": part["text"]})
            else:
                raise SlimtuneError(
                    f'{record.where}: messages[{i}].content[{j}] must be {{"type": "image"}} or {{"type": "text", "text": "..."}}'
                )
        out.append({"role": m["role"], "content": checked})
    if not any(m["role"] == "assistant" for m in out):
        raise SlimtuneError(f"{record.where}: no assistant message to train on")
    return out, [m["role"] == "assistant" for m in out], parts


def _image_refs(record: Record, parts: int, base_dir: Path) -> list[ImageRef]:
    """The row's ``images`` as references, one per image part, in order."""
    images = record.data.get("images")
    if images is None:
        images = []
    if not isinstance(images, list):
        raise SlimtuneError(f"{record.where}: 'images' must be a list of image paths or images, got {type(images).__name__}")
    if parts and not images:
        raise SlimtuneError(f"{record.where}: {parts} image part(s) in 'messages' but no image in 'images'")
    if parts != len(images):
        more = "image part(s) than images" if parts > len(images) else "images than image part(s)"
        raise SlimtuneError(f"{record.where}: more {more}: {parts} image part(s) in 'messages', {len(images)} image(s) in 'images'")
    return [_ref(value, base_dir, f"{record.where}: image {i + 1}") for i, value in enumerate(images)]


def _ref(value: Any, base_dir: Path, where: str) -> ImageRef:
    """One ``images`` entry: a path (relative to ``base_dir``), or an undecoded ``Image`` feature."""
    if isinstance(value, dict) and isinstance(value.get("bytes"), bytes):
        return ImageRef(value["bytes"], where)
    if isinstance(value, dict) and isinstance(value.get("path"), str):
        value = value["path"]
    if isinstance(value, str) and value:
        path = Path(value) if Path(value).is_absolute() else base_dir / value
        return ImageRef(str(path), f"{where} ({value})")
    raise SlimtuneError(f"{where}: expected an image path or a datasets Image value, got {type(value).__name__}")
