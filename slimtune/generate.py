"""Talk to a fine-tuned checkpoint: ``slimtune generate CKPT --prompt TEXT`` and ``slimtune chat CKPT``.

Two forms of the same checkpoint:

- ``merged``: the merged model at the checkpoint's root, loaded with plain transformers;
- ``adapter``: the LoRA adapter applied to the NF4 base it was trained on (what training computed),
  loaded in bounded memory as ``finetune`` loads it (NF4 row by row, adapters in fp32).

Prompts are rendered as training rendered them: messages with the checkpoint tokenizer's chat template
(the fallback ``<|role|>`` template when the base tokenizer had none), a plain prompt in the format the
training data used (chat, Alpaca, or raw text) as recorded in the checkpoint's ``slimtune_format.json``.
A vision-language checkpoint also takes images (``--image``): its processor renders the first user turn
with them (``image_prompt``), as training rendered vision rows, and makes their pixel values.

Example::

    loaded = load_for_generation(MergeSource(checkpoint=Path("runs/1/step-000100")))
    text = generate(loaded, prompt_ids(loaded, prompt="Name the format."), SamplingOptions(temperature=0))
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.generation.streamers import BaseStreamer

from slimtune.data import FALLBACK_CHAT_TEMPLATE, PIXEL_INPUTS, ImageRef, alpaca_prompt, decode_image, parse_json, read_image_bytes
from slimtune.errors import SlimtuneError, first_line
from slimtune.formats.format_record import read_format_record
from slimtune.formats.hf import read_config_dict
from slimtune.formats.hub import is_hub_id, resolve_model
from slimtune.formats.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS, CheckpointLayout
from slimtune.formats.manifest import checks_done, read_check
from slimtune.formats.merge_source import MergeSource
from slimtune.formats.peft import read_adapter
from slimtune.lora import LoRAConfig
from slimtune.model import load_adapter_weights, load_processor, load_qlora_model, load_tokenizer, pick_device, pick_dtype
from slimtune.vision_families import vision_parts

PROMPT_FORMATS = ("chat", "alpaca", "text")


@dataclass(frozen=True)
class SamplingOptions:
    """How tokens are drawn: temperature 0 is greedy; ``seed`` makes sampling repeatable."""

    max_new_tokens: int = 128
    temperature: float = 0.7
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Loaded:
    """A model ready to generate, with its tokenizer and the prompt format its training used."""

    model: nn.Module
    tokenizer: object
    form: str  # "merged" or "adapter"
    prompt_format: str  # chat, alpaca or text
    device: torch.device
    processor: object | None = None  # a vision-language checkpoint's (AutoProcessor): prompts with images


def load_for_generation(source: MergeSource, form: str = "auto", device: str = "auto", dtype: str = "bf16") -> Loaded:
    """The checkpoint of ``source`` (a ``step-N`` directory, a merged model directory or an adapter
    directory) loaded as ``form``: merged, adapter (on the NF4 base: ``source.base``, else the one training
    used), or auto (merged when there is one). With ``source.verify``, the files read from a checkpoint
    with a manifest are hashed while the model loads, and a mismatch is one error line before anything
    is generated."""
    path, verify = source.checkpoint, source.verify
    if path is None or not path.is_dir():
        raise SlimtuneError(f"{path}: no such checkpoint directory")
    adapter_dir, has_merged = source.adapter_dir, CheckpointLayout(path).has_merged
    if form == "auto":
        form = "merged" if has_merged else "adapter"
    if form == "merged" and not has_merged:
        raise SlimtuneError(f"{path}: no merged model here (config.json and *.safetensors); use --form adapter")
    if form == "adapter" and adapter_dir is None:
        raise SlimtuneError(f"{path}: no adapter here (adapter/adapter_config.json)")
    dev = pick_device(device)
    compute = pick_dtype(dtype, dev)
    checks = [read_check(path if form == "merged" else adapter_dir, verify)]
    if form == "merged":
        vision = vision_parts(str(read_config_dict(path).get("model_type", ""))) is not None
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        try:
            model = auto.from_pretrained(str(path), dtype=compute, local_files_only=True)
        except (OSError, ValueError) as e:
            raise SlimtuneError(f"{path}: cannot load the merged model ({e})") from None
        tokenizer_dir = path
    else:
        model, tokenizer_dir = _load_adapter_on_nf4(source, compute, lambda d: checks.append(read_check(d, verify)))
    checks_done(*checks)
    model.to(dev).eval()
    tokenizer = load_tokenizer(tokenizer_dir)
    processor = load_processor(tokenizer_dir) if vision_parts(getattr(model.config, "model_type", "")) else None
    return Loaded(model, tokenizer, form, _recorded_prompt_format(path, tokenizer), dev, processor)


def _load_adapter_on_nf4(source: MergeSource, dtype: torch.dtype, on_base: Callable[[Path], None]) -> tuple[nn.Module, Path]:
    path, adapter_dir, base = source.checkpoint, source.adapter_dir, source.base
    config = read_adapter(adapter_dir).config
    if config.get("rank_pattern") or config.get("alpha_pattern") or config.get("use_dora"):
        raise SlimtuneError(
            f"{adapter_dir}: rank/alpha patterns and DoRA are not supported on the NF4 base; merge it and use --form merged"
        )
    base_dir = resolve_model(base).path if base is not None else _recorded_base(path, adapter_dir, config)
    targets = config.get("target_modules")
    targets = list(targets) if isinstance(targets, list) else None
    if not targets:
        raise SlimtuneError(f"{adapter_dir / ADAPTER_CONFIG}: target_modules must be a list of module names here")
    on_base(base_dir)
    parts = vision_parts(str(read_config_dict(base_dir).get("model_type", "")))
    vision = parts is not None and any(parts.in_tower(name) for name in read_adapter(adapter_dir).modules)  # trained with lora.vision
    lora = LoRAConfig(int(config["r"]), float(config["lora_alpha"]), 0.0, bool(config.get("use_rslora")), targets, vision=vision)
    model = load_qlora_model(base_dir, lora, seed=0, progress=False, dtype=dtype)
    weights = adapter_dir / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise SlimtuneError(f"{weights}: missing (the NF4 form reads the adapter's safetensors file)")
    load_adapter_weights(model, weights)
    return model, source.tokenizer_dir(base_dir)


def _recorded_base(path: Path, adapter_dir: Path, config: dict) -> Path:
    """The base the adapter was trained on: the recipe state's model.path (at the hub commit training
    resolved it to), else the adapter config's base_model_name_or_path (a directory or a hub id)."""
    candidates = []
    state = CheckpointLayout(path).recipe_state
    if state.is_file():
        try:
            saved = torch.load(state, map_location="cpu", weights_only=True)
            recorded = saved.get("base") or {}
            pinned = f"{recorded['name']}@{recorded['revision']}" if is_hub_id(recorded.get("name")) and recorded.get("revision") else None
            candidates += [c for c in (pinned, saved["config"]["model.path"]) if c]
        except Exception:  # an unreadable state only loses this hint
            pass
    candidates.append(config.get("base_model_name_or_path"))
    for candidate in candidates:
        if isinstance(candidate, str) and candidate and (Path(candidate) / "config.json").is_file():
            return Path(candidate)
        if is_hub_id(candidate):
            return resolve_model(candidate).path
    raise SlimtuneError(f"{adapter_dir}: cannot find the base model it was trained on ({candidates}); pass --base DIR")


def _recorded_prompt_format(path: Path, tokenizer) -> str:
    recorded = read_format_record(path).get("prompt_format")
    if recorded in PROMPT_FORMATS:
        return recorded
    return "chat" if getattr(tokenizer, "chat_template", None) else "text"


def read_messages(path: str | Path) -> list[dict[str, str]]:
    """A conversation from a JSON file: a list of {role, content}, or an object with "messages"."""
    path = Path(path)
    if not path.is_file():
        raise SlimtuneError(f"{path}: no such messages file")
    data = parse_json(path.read_bytes(), str(path))
    if isinstance(data, dict):
        data = data.get("messages")
    if not isinstance(data, list) or not data:
        raise SlimtuneError(f'{path}: expected a JSON list of {{role, content}} objects (or {{"messages": [...]}})')
    for i, m in enumerate(data):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise SlimtuneError(f"{path}: messages[{i}] must be an object with string 'role' and 'content'")
    return [{"role": m["role"], "content": m["content"]} for m in data]


def prompt_ids(
    loaded: Loaded, prompt: str | None = None, messages: list[dict[str, str]] | None = None, fmt: str | None = None
) -> list[int]:
    """Token ids of a prompt rendered as training rendered its data (``fmt`` overrides the recorded format)."""
    tokenizer = loaded.tokenizer
    fmt = fmt or loaded.prompt_format
    if messages is None and fmt == "chat":
        messages = [{"role": "user", "content": prompt or ""}]
    if messages is not None and loaded.processor is not None:  # a vision checkpoint: as training rendered chat rows
        return image_prompt(loaded, [], messages=messages)[0]
    if messages is not None:
        template = getattr(tokenizer, "chat_template", None) or FALLBACK_CHAT_TEMPLATE
        try:
            text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja errors
            raise SlimtuneError(f"the chat template failed on these messages ({e})") from None
        return tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token or ""
    text = bos + (alpaca_prompt(prompt or "") if fmt == "alpaca" else prompt or "")
    return tokenizer.encode(text, add_special_tokens=False)


def image_prompt(
    loaded: Loaded, images: list[Path], prompt: str | None = None, messages: list[dict] | None = None
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Token ids and image inputs of a prompt with ``images`` on a vision-language checkpoint: the images
    go first in the first user turn (TRL's content parts), the conversation is rendered by the processor's
    chat template and each image expanded into its tokens, as training rendered vision rows. A missing or
    unreadable image, or a text-only checkpoint, is one line.

    Example: ``ids, pixels = image_prompt(loaded, [Path("chart.png")], prompt="What does it show?")``"""
    if loaded.processor is None:
        raise SlimtuneError(f"--image needs a vision-language checkpoint; this one's model ({loaded.model.config.model_type}) is text-only")
    opened = [decode_image(read_image_bytes(ImageRef(str(p), f"--image {p}")), f"--image {p}") for p in images]
    turns = [dict(m) for m in (messages or [{"role": "user", "content": prompt or ""}])]
    first = next((i for i, m in enumerate(turns) if m["role"] == "user"), None)
    if first is None:
        raise SlimtuneError("--image needs a user message to attach the images to")
    for i, m in enumerate(turns):
        text = [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else list(m["content"])
        m["content"] = [{"type": "image"}] * len(images) * (i == first) + text
    processor = loaded.processor
    try:
        text = processor.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        out = processor(text=[text], images=[opened] if opened else None, add_special_tokens=False, return_tensors="pt")
    except Exception as e:  # noqa: BLE001 - jinja errors, images the processor cannot take
        raise SlimtuneError(f"the processor failed on this prompt and its images ({first_line(e)})") from None
    return out["input_ids"][0].tolist(), {k: v for k, v in out.items() if k in PIXEL_INPUTS}


def generate(
    loaded: Loaded, ids: list[int], options: SamplingOptions, on_text: Callable[[str], None] | None = None, pixels: dict | None = None
) -> str:
    """The continuation of ``ids`` (without the prompt), streamed piece by piece to ``on_text``; ``pixels``:
    the image inputs of a vision prompt (``image_prompt``). The global RNG is left as it was (sampling
    draws from a forked, seeded generator).

    Example: ``generate(loaded, *image_prompt(loaded, [Path("cat.png")], prompt="What is it?"), SamplingOptions())``"""
    tokenizer = loaded.tokenizer
    produced: list[int] = []
    shown = [""]

    def _emit(text: str) -> None:
        if on_text is not None and text.startswith(shown[0]) and len(text) > len(shown[0]):
            on_text(text[len(shown[0]) :])
            shown[0] = text

    class _Stream(BaseStreamer):
        started = False

        def put(self, value):
            if not self.started:  # the first call is the prompt
                self.started = True
                return
            produced.extend(int(v) for v in value.flatten())
            text = tokenizer.decode(produced, skip_special_tokens=True)
            if not text.endswith("\ufffd"):  # a character whose bytes are still coming is shown once complete
                _emit(text)

        def end(self):
            pass

    sample = options.temperature > 0
    kwargs = {"do_sample": sample, "max_new_tokens": options.max_new_tokens}
    if sample:
        kwargs.update(temperature=options.temperature, top_p=options.top_p, top_k=0)
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    pad = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    input_ids = torch.tensor([ids], dtype=torch.long, device=loaded.device)
    devices = [loaded.device] if loaded.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(options.seed)
        out = loaded.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
            use_cache=True,
            streamer=_Stream(),
            **{k: v.to(loaded.device) for k, v in (pixels or {}).items()},
            **kwargs,
        )
    text = tokenizer.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)
    _emit(text)
    return text


def chat_loop(
    loaded: Loaded,
    options: SamplingOptions,
    read: Callable[[str], str] = input,
    write: Callable[[str], None] | None = None,
    images: list[Path] | None = None,
) -> None:
    """An interactive conversation: each reply streamed as it is generated; /reset starts over, /exit
    (or end of input) leaves. Without a chat format (trained on Alpaca or plain text) each turn stands alone.
    ``images`` (a vision-language checkpoint) go with the conversation's first user turn.

    Example: ``chat_loop(load_for_generation(MergeSource(checkpoint=Path("runs/1/step-000100"))), SamplingOptions())``"""

    def out(text: str) -> None:
        (write or sys.stdout.write)(text)
        if write is None:
            sys.stdout.flush()

    messages: list[dict[str, str]] = []
    out(f"chat with {loaded.form} model ({loaded.prompt_format} format); /reset to start over, /exit to leave\n")
    while True:
        try:
            line = read("> ")
        except EOFError:
            out("\n")
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            messages = []
            continue
        if not line.strip():
            continue
        pixels = None
        if images:
            messages.append({"role": "user", "content": line})
            ids, pixels = image_prompt(loaded, images, messages=messages)
        elif loaded.prompt_format == "chat":
            messages.append({"role": "user", "content": line})
            ids = prompt_ids(loaded, messages=messages)
        else:
            ids = prompt_ids(loaded, prompt=line)
        reply = generate(loaded, ids, options, on_text=out, pixels=pixels)
        out("\n")
        if loaded.prompt_format == "chat" or images:
            messages.append({"role": "assistant", "content": reply})
