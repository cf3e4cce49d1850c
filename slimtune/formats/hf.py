"""Hugging Face checkpoint directories: config.json, safetensors shards and their index, tokenizer and processor files."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from slimtune.errors import SlimtuneError, first_line
from slimtune.formats.safetensors import COMPUTE_DTYPES, SafetensorsHeader, read_header
from slimtune.formats.strict_json import json_kind, load_json, safe_name, safe_text

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from slimtune.tensors import StreamTensor

INDEX_NAME = "model.safetensors.index.json"
# A vision-language model's processor (AutoProcessor): image and video preprocessing, its chat template.
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json", "chat_template.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
    *PROCESSOR_FILES,
)


# Sizes a config.json may declare: far beyond any released model, far below what would take the machine
# down while the (meta) skeleton is built. Checked before transformers sees the file.
CONFIG_BOUNDS = {
    "hidden_size": 1 << 17, "n_embd": 1 << 17, "d_model": 1 << 17,
    "intermediate_size": 1 << 20, "n_inner": 1 << 20, "ffn_dim": 1 << 20, "moe_intermediate_size": 1 << 20,
    "num_hidden_layers": 1024, "n_layer": 1024, "num_layers": 1024,
    "num_attention_heads": 1024, "n_head": 1024, "num_key_value_heads": 1024,
    "head_dim": 1 << 14, "vocab_size": 1 << 22,
    "max_position_embeddings": 1 << 24, "n_positions": 1 << 24, "n_ctx": 1 << 24,
    "num_experts": 1 << 12, "num_local_experts": 1 << 12, "n_routed_experts": 1 << 12, "num_experts_per_tok": 1 << 12,
}  # fmt: skip
MAX_CONFIG_PARAMETERS = 10**13  # 10 T parameters
CONFIG_FILE_BYTES = 4 * 1024 * 1024


def read_config_dict(model_dir: str | Path) -> dict:
    """config.json of a local checkpoint as checked JSON: an object, ``model_type`` a string, every size
    field transformers would build from a positive integer within CONFIG_BOUNDS (no floats, booleans or
    strings), and the parameter count it implies within MAX_CONFIG_PARAMETERS. Nothing is built."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise SlimtuneError(f"{safe_name(str(model_dir))}: no such model directory")
    path = model_dir / "config.json"
    if not path.exists():
        raise SlimtuneError(f"{path}: missing (a Hugging Face checkpoint directory needs config.json)")
    data = load_json(path, expect=dict, max_bytes=CONFIG_FILE_BYTES, what="config.json")
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise SlimtuneError(f"{path}: model_type must be a non-empty string, found {json_kind(model_type)}")
    _check_sizes(data, str(path))
    _check_dtype_names(data, str(path))
    for key in ("text_config",):  # multimodal configs nest the language model's sizes
        if isinstance(data.get(key), dict):
            _check_sizes(data[key], f"{path}: {key}")
            _check_dtype_names(data[key], f"{path}: {key}")
    params = estimate_parameters(data)
    if params > MAX_CONFIG_PARAMETERS:
        raise SlimtuneError(f"{path}: the sizes declare about {params:.3g} parameters, more than the {MAX_CONFIG_PARAMETERS:.0e} allowed")
    return data


def _check_sizes(data: dict, where: str) -> None:
    for key, bound in CONFIG_BOUNDS.items():
        if key not in data or (data[key] is None and key in ("head_dim", "n_inner", "num_key_value_heads")):
            continue
        value = data[key]
        if type(value) is not int or not 0 < value <= bound:
            shown = value if isinstance(value, (int, float)) and not isinstance(value, bool) else json_kind(value)
            raise SlimtuneError(f"{where}: {key} must be an integer in [1, {bound:,}], found {shown}")
    heads = data.get("num_attention_heads", data.get("n_head"))
    hidden = data.get("hidden_size", data.get("n_embd"))
    if heads and hidden and data.get("head_dim") is None and hidden % heads:
        raise SlimtuneError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} (and no head_dim is given)")
    kv = data.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise SlimtuneError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")


def _check_dtype_names(data: dict, where: str) -> None:
    """dtype / torch_dtype: null or the name of a torch dtype ("bfloat16"), as transformers writes them."""
    for key in ("dtype", "torch_dtype"):
        value = data.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or not isinstance(getattr(torch, value, None), torch.dtype):
            shown = repr(safe_text(value)) if isinstance(value, str) else json_kind(value)
            raise SlimtuneError(f'{where}: {key} must be a dtype name such as "bfloat16", found {shown}')


def _check_buildable(config: PretrainedConfig, data: dict, path: Path) -> None:
    """What transformers reads only when it builds the model (a KeyError, TypeError or AssertionError deep
    inside): the activation and RoPE type must be ones this transformers implements, RoPE parameters
    numbers, pad_token_id a row of the embedding. Values as transformers read them (after its own renaming
    of legacy keys); messages name the key as the file spells it."""
    import transformers  # seconds to import: only where a config object is checked (read_model_config)

    newer = f"this transformers ({transformers.__version__}) does not know it; a newer transformers may"
    for prefix, cfg, raw in (("", config, data), ("text_config.", getattr(config, "text_config", None), data.get("text_config"))):
        if cfg is None or not isinstance(raw, dict):
            continue
        where = f"{path}: {prefix}"
        _check_activation(cfg, where, newer)
        file_key = next((k for k in ("rope_scaling", "rope_parameters") if raw.get(k) is not None), "rope_parameters")
        _check_rope(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None), f"{where}{file_key}.", newer)
        pad, vocab = getattr(cfg, "pad_token_id", None), getattr(cfg, "vocab_size", None)
        if type(pad) is int and type(vocab) is int and not -vocab <= pad < vocab:
            raise SlimtuneError(f"{where}pad_token_id {pad} is not a token of the vocabulary (vocab_size {vocab})")


def _check_activation(cfg, where: str, newer: str) -> None:
    from transformers.activations import ACT2FN  # transformers: as above, only from read_model_config

    for key in ("hidden_act", "hidden_activation", "activation_function"):
        value = getattr(cfg, key, None)
        if isinstance(value, str) and value not in ACT2FN:
            raise SlimtuneError(f"{where}{key} {safe_text(value)!r} is not a known activation ({newer})")
        if value is not None and not isinstance(value, str):
            raise SlimtuneError(f"{where}{key} must be an activation name, found {json_kind(value)}")


def _check_rope(rope, where: str, newer: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # transformers: as above, only from read_model_config

    if not isinstance(rope, dict):
        return
    groups = [("", rope)] if "rope_type" in rope or "type" in rope else []
    if not groups:  # per layer type (sliding / full attention)
        groups = [(f"{name}.", params) for name, params in rope.items() if isinstance(params, dict)]
    for sub, params in groups:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default" and (not isinstance(rope_type, str) or rope_type not in ROPE_INIT_FUNCTIONS):
            shown = repr(safe_text(rope_type)) if isinstance(rope_type, str) else json_kind(rope_type)
            raise SlimtuneError(f"{where}{sub}rope_type {shown} is not a known RoPE type ({newer})")
        for key, value in params.items():
            if key not in ("rope_type", "type") and isinstance(value, str):
                raise SlimtuneError(f"{where}{sub}{safe_text(key)} must be a number, found string {safe_text(value)!r}")


def estimate_parameters(data: dict) -> int:
    """A generous upper estimate of a decoder's parameter count from its config (for bounds only)."""
    cfg = data.get("text_config") if isinstance(data.get("text_config"), dict) else data

    def get(*keys: str, default: int = 0) -> int:
        for k in keys:
            if type(cfg.get(k)) is int:
                return cfg[k]
        return default

    hidden = get("hidden_size", "n_embd", "d_model", default=1)
    layers = get("num_hidden_layers", "n_layer", "num_layers", default=1)
    heads = get("num_attention_heads", "n_head", default=1)
    head_dim = get("head_dim", default=max(1, hidden // max(1, heads)))
    inter = get("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)
    experts = max(1, get("num_experts", "num_local_experts", "n_routed_experts", default=1))
    vocab = get("vocab_size", default=1)
    attention = 4 * hidden * heads * head_dim
    mlp = 3 * hidden * inter * experts
    return 2 * vocab * hidden + layers * (attention + mlp + 4 * hidden)


def read_model_config(model_dir: str | Path) -> PretrainedConfig:
    """config.json of a local checkpoint, checked by ``read_config_dict`` first, then by transformers
    (never a hub lookup); every failure names the file."""
    model_dir = Path(model_dir)
    data = read_config_dict(model_dir)
    path = model_dir / "config.json"
    from transformers import AutoConfig  # transformers (seconds to import) only where a model config object is needed

    try:
        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad config; all are bad input
        raise SlimtuneError(f"{path}: not a usable model config ({type(e).__name__}: {safe_text(first_line(e))[:300]})") from None
    _check_buildable(config, data, path)
    return config


# transformers' model families whose projections are Conv1D ([in, out] weights; PEFT forces fan_in_fan_out)
CONV1D_MODEL_TYPES = ("gpt2", "openai-gpt", "imagegpt", "decision_transformer")
# leaf names of nn.Embedding modules in transformers' decoder families
EMBEDDING_NAMES = ("embed_tokens", "wte", "wpe", "embed_in", "word_embeddings", "tok_embeddings", "embed_positions")
OUTPUT_EMBEDDING_NAMES = ("lm_head", "embed_out", "output")


def module_kinds(config: dict, shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, str], str | None]:
    """What each module of the checkpoint is as PEFT sees it ("linear", "conv1d", "embedding" or
    "other") and the output embedding's name, from config.json and the tensor names and shapes alone
    (transformers' conventions for its decoder families; nothing is imported or built). Example:
    ``module_kinds({"model_type": "llama"}, {"model.layers.0.mlp.up_proj.weight": (512, 128), "lm_head.weight": (300, 128)})``
    -> ``({"model.layers.0.mlp.up_proj": "linear", "lm_head": "linear"}, "lm_head")``."""
    model_type = config.get("model_type")
    if isinstance(config.get("text_config"), dict):
        model_type = config["text_config"].get("model_type", model_type)
    kinds: dict[str, str] = {}
    for key, shape in shapes.items():
        module, _, param = key.rpartition(".")
        if param != "weight" or not module:
            continue
        leaf = module.rpartition(".")[2]
        if len(shape) != 2:
            kinds[module] = "other"
        elif leaf in EMBEDDING_NAMES:
            kinds[module] = "embedding"
        elif model_type in CONV1D_MODEL_TYPES and leaf not in OUTPUT_EMBEDDING_NAMES:
            kinds[module] = "conv1d"
        else:
            kinds[module] = "linear"
    output = next((m for m in kinds if m in OUTPUT_EMBEDDING_NAMES), None)
    if output is None and config.get("tie_word_embeddings", True) is not False and "lm_head" not in kinds:
        output = "lm_head"  # tied: lm_head shares the input embedding and is not stored
        kinds.setdefault("lm_head", "linear")
    return kinds, output


def export_config_dict(config: dict | PretrainedConfig, tensors: Iterable[StreamTensor] = ()) -> dict:
    """The config.json written beside merged weights: one rule for the in-training save, the offline
    merge and the distributed export, so they write the same bytes. It is the base's config as given
    (its config.json as ``read_config_dict`` reads it; a transformers config only for a model built
    without one, by ``to_dict``), keys in their order, less ``quantization_config`` and
    ``_name_or_path``; ``dtype`` and ``torch_dtype`` name the float dtype that holds most of the
    written bytes; ``tie_word_embeddings`` is false when the output embedding is written as a tensor of
    its own (an adapter that changes it unties it). ``tensors``: what is written (stream entries).

    Example: ``export_config_dict(read_config_dict(base_dir), merged_stream)``"""
    data = dict(config) if isinstance(config, dict) else config.to_dict()
    data.pop("quantization_config", None)
    data.pop("_name_or_path", None)
    names, float_bytes = set(), {}
    for t in tensors:
        names.add(t.name)
        if t.dtype in COMPUTE_DTYPES:  # the dtypes a merge computes in and casts to
            float_bytes[t.dtype] = float_bytes.get(t.dtype, 0) + t.nbytes
    if float_bytes:
        dtype = max(float_bytes, key=lambda d: (float_bytes[d], str(d)))
        data["torch_dtype"] = data["dtype"] = str(dtype).removeprefix("torch.")
    if data.get("tie_word_embeddings", True) is not False and any(f"{n}.weight" in names for n in OUTPUT_EMBEDDING_NAMES):
        data["tie_word_embeddings"] = False
    return data


def read_index(index: str | Path) -> tuple[dict[str, str], int | None]:
    """A sharded checkpoint's index: ``weight_map`` an object of tensor name -> shard file name (a plain
    name in the same directory), ``metadata.total_size`` an integer if present. Returns both."""
    index = Path(index)
    data = load_json(index, expect=dict, what="safetensors index")
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict):
        raise SlimtuneError(f"{index}: weight_map must be an object of tensor name -> file name, found {json_kind(weight_map)}")
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
            found = safe_name(name) if isinstance(name, str) else json_kind(name)
            raise SlimtuneError(f"{index}: tensor {safe_name(key)} maps to {found}, expected a file name beside the index")
    metadata = data.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise SlimtuneError(f"{index}: metadata must be an object, found {json_kind(metadata)}")
    total = (metadata or {}).get("total_size")
    if total is not None and (type(total) is not int or total < 0):
        raise SlimtuneError(f"{index}: metadata.total_size must be a non-negative integer, found {json_kind(total)}")
    return weight_map, total


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError as e:  # a name too long for the filesystem, a loop of links, ...
        raise SlimtuneError(f"{path}: cannot access: {e.strerror or e}") from None


def index_problems(
    index: Path, weight_map: dict[str, str], headers: dict[str, SafetensorsHeader], total: int | None = None
) -> Iterator[str]:
    """The one check of an index against its shards, every disagreement in turn: a shard the index lists
    that is missing; a tensor of a shard in ``headers`` (file name -> readable header) that the index maps
    elsewhere or nowhere; a mapped tensor its shard does not hold; with ``total``, ``metadata.total_size``
    against the bytes of the mapped tensors. Loaders raise the first (``checkpoint_files``); ``verify``
    reports them all.

    Example: ``problems = list(index_problems(d / INDEX_NAME, weight_map, {h.path.name: h for h in headers}))``"""
    directory = index.parent
    for name in dict.fromkeys(weight_map.values()):
        if name not in headers and not _is_file(directory / name):
            yield f"{index}: lists {safe_name(name)}, which is missing from {directory}"
    for name, header in headers.items():
        for key in header.tensors:
            if weight_map.get(key) != name:
                yield f"{index}: tensor {safe_name(key)} is in {name} but the index says {safe_name(weight_map.get(key) or 'nothing')}"
    for key, name in weight_map.items():
        if name in headers and key not in headers[name].tensors:
            yield f"{index}: maps tensor {safe_name(key)} to {safe_name(name)}, which does not hold it"
    held = sum(headers[name].tensors[key].nbytes for key, name in weight_map.items() if name in headers and key in headers[name].tensors)
    complete = all(name in headers for name in weight_map.values())
    if total is not None and complete and held != total:
        yield f"{index}: total_size {total} but the shards hold {held} bytes of tensors"


def checkpoint_files(model_dir: str | Path) -> list[SafetensorsHeader]:
    """Headers of the checkpoint's safetensors files, checked, in index order (or name order). With an
    index, every shard it names must exist and hold exactly the tensors it maps there; without one, no
    tensor may appear in two files (which copy would win is undefined)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_NAME
    if index.exists():
        weight_map, _ = read_index(index)
        names = list(dict.fromkeys(weight_map.values()))
        for name in names:  # missing shards first: before any header is read
            if not _is_file(model_dir / name):
                raise SlimtuneError(f"{index}: lists {safe_name(name)}, which is missing from {model_dir}")
        headers = [read_header(model_dir / name) for name in names]
        problem = next(index_problems(index, weight_map, {h.path.name: h for h in headers}), None)
        if problem is not None:
            raise SlimtuneError(problem)
        return headers
    files = sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())
    if not files:
        bins = sorted(model_dir.glob("*.bin"))
        hint = " (found .bin weights: convert them to safetensors first)" if bins else ""
        raise SlimtuneError(f"{model_dir}: no *.safetensors weights{hint}")
    headers = [read_header(f) for f in files]
    seen: dict[str, Path] = {}
    for h in headers:
        for key in h.tensors:
            if key in seen:
                raise SlimtuneError(
                    f"{model_dir}: tensor {safe_name(key)} is in both {seen[key].name} and {h.path.name}, "
                    f"and no {INDEX_NAME} says which is meant"
                )
            seen[key] = h.path
    return headers


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def index_dict(weight_map: dict[str, str], total_size: int) -> dict:
    return {"metadata": {"total_size": total_size}, "weight_map": weight_map}


def tokenizer_files(model_dir: str | Path) -> list[Path]:
    """The tokenizer's and processor's files (``TOKENIZER_FILES``) that ``model_dir`` holds: what a merged
    checkpoint carries beside its weights so ``AutoTokenizer`` / ``AutoProcessor`` load it unchanged.

    Example: ``[p.name for p in tokenizer_files("base")]`` -> ``["tokenizer.json", "tokenizer_config.json"]``"""
    model_dir = Path(model_dir)
    return [model_dir / n for n in TOKENIZER_FILES if (model_dir / n).is_file()]
