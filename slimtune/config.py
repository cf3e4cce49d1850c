"""Recipe configuration: one schema (key, type, default, description, whether it may change on resume)
from which validation, `slimtune finetune --help` and the key table of docs/configuration.md are all derived.

A config is a YAML file of nested sections (``optimizer: {lr: 2e-4}``), or the name of a shipped one
(``tiny``), plus dotted ``key=value`` overrides whose values are read as YAML scalars. Every key is
checked before any work starts: an unknown key or a value of the wrong type is an error naming the key."""

from __future__ import annotations

import difflib
import math
import re
import textwrap
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from slimtune.errors import SlimtuneError
from slimtune.lora import DEFAULT_TARGETS
from slimtune.memory import DEFAULT_SHARD_SIZE, parse_size

PLACEHOLDER = "{output_dir}"


@dataclass(frozen=True)
class Key:
    """One config key. ``kind`` is int, float, bool, str, path or list[str]; ``fixed`` keys must not
    change when a run is resumed (they define the model, the data order or the step arithmetic)."""

    name: str
    kind: str
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    nullable: bool = False
    required: bool = False
    minimum: float | None = None
    maximum: float | None = None  # exclusive
    fixed: bool = False


SCHEMA: tuple[Key, ...] = (
    Key("output_dir", "path", None, "Run directory: checkpoints step-NNNNNN/, metrics.jsonl and loss.png.", required=True),
    Key("seed", "int", 0, "Seeds the LoRA initialisation, the data order and dropout.", fixed=True),
    Key("device", "str", "auto", "Where to train; auto picks cuda when available, else cpu.", choices=("auto", "cpu", "cuda")),
    Key(
        "dtype",
        "str",
        "auto",
        "Compute dtype of the frozen base (NF4 weights are dequantized to it; adapters stay fp32). auto: bf16 on CPU and on GPUs "
        "with native bf16, fp16 (with loss scaling) on older GPUs.",
        choices=("auto", "bf16", "fp16", "fp32"),
    ),
    Key("resume", "bool", False, "Continue from the newest complete checkpoint in output_dir (starts fresh when there is none)."),
    Key("overwrite", "bool", False, "Start over when output_dir already holds checkpoints (they are deleted); otherwise that is an error."),
    Key(
        "model.path",
        "path",
        None,
        f"Local Hugging Face checkpoint directory of a supported family (README: Model families); '{PLACEHOLDER}' "
        "is replaced by output_dir.",
        required=True,
        fixed=True,
    ),
    Key("model.create_tiny", "bool", False, "When model.path does not exist, write the embedded tiny Llama there (offline demo)."),
    Key("lora.rank", "int", 8, "LoRA rank r.", minimum=1, fixed=True),
    Key("lora.alpha", "float", 16.0, "LoRA alpha; the update is scaled by alpha / r (alpha / sqrt(r) with rsLoRA).", minimum=0, fixed=True),
    Key("lora.dropout", "float", 0.0, "Dropout on the adapter input during training.", minimum=0, maximum=1),
    Key("lora.use_rslora", "bool", False, "Rank-stabilised scaling alpha / sqrt(r).", fixed=True),
    Key(
        "lora.target_modules",
        "list[str]",
        list(DEFAULT_TARGETS),
        "Layers that get an adapter (NF4 base): all-linear (PEFT's convention: every linear layer except the output head, "
        "resolved per family and printed at start) or layer names such as [q_proj, v_proj].",
        fixed=True,
    ),
    Key(
        "dataset.path",
        "path",
        None,
        "Local data file: JSONL (one object per line), a JSON array, Parquet, Arrow or CSV, with rows of one of the shapes of "
        f"dataset.format; '{PLACEHOLDER}' is replaced by output_dir.",
        required=True,
        fixed=True,
    ),
    Key(
        "dataset.mix",
        "list[path]",
        None,
        "More data files trained on together with dataset.path (same types and shapes).",
        nullable=True,
        fixed=True,
    ),
    Key(
        "dataset.weights",
        "list[float]",
        None,
        "One weight per file (dataset.path, then dataset.mix): each epoch holds weight x the file's examples (whole repeats, "
        "then a seeded subset); null: 1 each.",
        nullable=True,
        fixed=True,
    ),
    Key(
        "dataset.columns",
        "map",
        None,
        "Rename columns to the shape's keys, e.g. {instruction: question, output: answer} (or instruction=question,output=answer).",
        nullable=True,
        fixed=True,
    ),
    Key(
        "dataset.format",
        "str",
        "auto",
        "Row shape: alpaca, chat (messages), sharegpt (conversations from/value), completion (prompt/completion) or text; "
        "auto decides per row from its keys.",
        choices=("auto", "alpaca", "chat", "sharegpt", "completion", "text"),
        fixed=True,
    ),
    Key("dataset.max_seq_len", "int", 512, "Sequences are truncated to this many tokens.", minimum=2, fixed=True),
    Key("dataset.shuffle", "bool", True, "Shuffle the examples each epoch (seeded by seed and the epoch).", fixed=True),
    Key(
        "dataset.train_on_inputs",
        "bool",
        False,
        "Train on every token, prompts and user turns included (default: responses only).",
        fixed=True,
    ),
    Key(
        "dataset.packed",
        "bool",
        False,
        "Pack examples into rows of max_seq_len tokens; attention never crosses a document boundary (position ids restart).",
        fixed=True,
    ),
    Key(
        "dataset.eval_path",
        "path",
        None,
        f"Held-out data file for evaluation (any supported type); '{PLACEHOLDER}' is replaced by output_dir.",
        nullable=True,
    ),
    Key(
        "dataset.eval_fraction",
        "float",
        0.0,
        "Without eval_path: hold out this fraction of each file (a seeded split) for evaluation; 0: no evaluation.",
        minimum=0,
        maximum=1,
        fixed=True,
    ),
    Key("dataset.create_builtin", "bool", False, "When dataset.path does not exist, write the small built-in dataset there."),
    Key(
        "training.batch_size",
        "int",
        2,
        "Sequences per micro-batch, all ranks together (each takes its slice): the same global batch on any number of ranks.",
        minimum=1,
        fixed=True,
    ),
    Key(
        "training.gradient_accumulation_steps",
        "int",
        1,
        "Micro-batches per optimizer step; the loss is averaged over all their trained tokens.",
        minimum=1,
        fixed=True,
    ),
    Key("training.total_epochs", "int", 1, "Passes over the dataset.", minimum=1),
    Key(
        "training.max_steps",
        "int",
        None,
        "Last optimizer step of the run (caps total_epochs); with total_epochs it sets the length of the cosine schedule.",
        nullable=True,
        minimum=1,
    ),
    Key(
        "training.stop_after_steps",
        "int",
        None,
        "End this invocation after this global step, with a checkpoint; the schedule is unchanged, so resume=true continues "
        "the run exactly (split a long run over sessions).",
        nullable=True,
        minimum=1,
    ),
    Key("training.max_grad_norm", "float", 1.0, "Clip the adapters' gradient norm to this; null: no clipping.", nullable=True, minimum=0),
    Key(
        "training.eval_every_n_steps",
        "int",
        None,
        "Evaluate every n optimizer steps (and at every checkpoint) when there is eval data.",
        nullable=True,
        minimum=1,
    ),
    Key(
        "training.sample_prompts",
        "list[str]",
        None,
        "Prompts generated from (greedy) at each checkpoint, into metrics.jsonl and the log.",
        nullable=True,
    ),
    Key("training.sample_max_new_tokens", "int", 32, "Tokens generated per sample prompt.", minimum=1),
    Key("training.activation_checkpointing", "bool", False, "Recompute layer activations in the backward pass: less memory, more compute."),
    Key(
        "training.compile",
        "bool",
        False,
        "torch.compile each decoder layer (regional compilation, as torchtune does): inductor on CPU and CUDA; the first "
        "steps pay a one-off compile (logged), later ones run faster.",
    ),
    Key(
        "training.num_threads",
        "int",
        None,
        "CPU threads torch uses; null: the cores this process may use (its CPU affinity), divided among the ranks on this "
        "machine under torchrun (never the momentary load: runs stay reproducible). Set it lower where other processes share the cores.",
        nullable=True,
        minimum=1,
    ),
    Key("optimizer.lr", "float", 2e-4, "Peak learning rate of AdamW (adapter parameters only).", minimum=0),
    Key("optimizer.weight_decay", "float", 0.0, "AdamW decoupled weight decay.", minimum=0),
    Key("scheduler.warmup_steps", "int", 0, "Linear warmup steps before the cosine decay.", minimum=0),
    Key("scheduler.min_lr_ratio", "float", 0.0, "The cosine decays to lr * min_lr_ratio at the end of the run.", minimum=0),
    Key(
        "checkpoint.save_every_n_steps",
        "int",
        None,
        "Also save every n optimizer steps (a checkpoint is always saved at each epoch end and when the run stops).",
        nullable=True,
        minimum=1,
    ),
    Key(
        "checkpoint.merged",
        "str",
        "every",
        "Which checkpoints hold the merged model beside the adapter: every, final (only the run's last) or never.",
        choices=("every", "final", "never"),
    ),
    Key(
        "checkpoint.merged_dtype",
        "str",
        None,
        "dtype of the merged model's weights (null: the base checkpoint's). W' + B A is computed in fp32 and rounded once "
        "to this dtype; fp32 skips that rounding (eval_loss_merged in metrics.jsonl measures what it costs).",
        choices=("fp32", "fp16", "bf16"),
        nullable=True,
    ),
    Key(
        "checkpoint.keep_last_n",
        "int",
        None,
        "Keep only the newest n complete checkpoints (the newest is never deleted); null keeps all.",
        nullable=True,
        minimum=1,
    ),
    Key("checkpoint.max_shard_size", "str", DEFAULT_SHARD_SIZE, "Largest merged safetensors shard, e.g. 2GB or 500MiB."),
    Key(
        "checkpoint.async",
        "bool",
        True,
        "Save in the background: training blocks only to snapshot the adapters and training state, a writer process writes the "
        "checkpoint (on the CPU forked at each save point, sharing the trainer's memory; with a GPU or under torchrun one writer per "
        "rank, started with the run, each writing that rank's part of the cooperative save); only when a save point comes before "
        "the run's last step.",
    ),
    Key(
        "checkpoint.gguf",
        "str",
        None,
        "Also write model-TYPE.gguf (+ an Ollama Modelfile) beside the run's final checkpoint, for llama.cpp/Ollama (docs/gguf.md).",
        nullable=True,
        choices=("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"),
    ),
    Key(
        "checkpoint.gguf_verify",
        "bool",
        True,
        "Check the final checkpoint's sha256 against its manifest while checkpoint.gguf reads it (false: read it unchecked).",
    ),
    Key(
        "logging.progress_bar",
        "bool",
        True,
        "Show a tqdm bar (loss, eval loss, lr, tokens/s; ckpt=saving while a background save runs) on stderr.",
    ),
    Key("logging.tensorboard", "bool", False, "Also write TensorBoard event files under output_dir/tensorboard (extra: tensorboard)."),
    Key("logging.wandb.project", "str", None, "Also log to this Weights & Biases project (extra: wandb).", nullable=True),
    Key("logging.wandb.mode", "str", "offline", "W&B mode: offline (no network; sync later) or online.", choices=("offline", "online")),
)

KEYS: dict[str, Key] = {k.name: k for k in SCHEMA}
_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


class Config(SimpleNamespace):
    """Validated values: ``cfg.optimizer.lr`` reads like the YAML; ``cfg.values`` is the flat dotted dict."""

    def __init__(self, values: dict[str, Any]):
        nested: dict[str, Any] = {}
        for key, value in values.items():
            *sections, leaf = key.split(".")
            node = nested
            for section in sections:
                node = node.setdefault(section, SimpleNamespace()).__dict__
            node[leaf] = value
        super().__init__(**nested)
        self.values = dict(values)


def shipped_configs() -> list[str]:
    """Names of the configs that come with the package (slimtune/configs/*.yaml)."""
    folder = resources.files("slimtune") / "configs"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def read_config_source(path_or_name: str) -> tuple[str, dict]:
    """The raw YAML mapping of a config file, or of a shipped config by name."""
    if "\x00" in path_or_name:
        raise SlimtuneError(f"config path {path_or_name!r} contains a NUL byte")
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        raise SlimtuneError(f"{path}: is a directory, expected a YAML config file")
    if path.is_file():
        label = str(path)
        try:
            if path.stat().st_size > MAX_CONFIG_BYTES:
                raise SlimtuneError(f"{path}: {path.stat().st_size:,} bytes; a config file may have at most {MAX_CONFIG_BYTES:,}")
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise SlimtuneError(f"{path}: not UTF-8 text (byte {e.start})") from None
        except OSError as e:
            raise SlimtuneError(f"{path}: cannot read: {e.strerror or e}") from None
    elif path_or_name in shipped_configs():
        text = (resources.files("slimtune") / "configs" / f"{path_or_name}.yaml").read_text()
        label = f"{path_or_name}.yaml"
    else:
        raise SlimtuneError(
            f"no config file {path_or_name!r}, and no shipped config of that name (shipped: {', '.join(shipped_configs())})"
        )
    data = _safe_yaml(text, label)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SlimtuneError(f"{label}: expected a mapping of config keys at the top level, got {type(data).__name__}")
    return label, data


def flatten(data: dict, label: str, prefix: str = "") -> dict[str, Any]:
    """{"optimizer": {"lr": 1}} -> {"optimizer.lr": 1}; sections are the prefixes of schema keys."""
    sections = {k.name.rsplit(".", n)[0] for k in SCHEMA for n in range(1, k.name.count(".") + 1)}
    flat: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = f"{prefix}{raw_key}"
        if key in sections:
            if not isinstance(value, dict):
                raise SlimtuneError(f"{label}: {key} must be a mapping of its keys ({_section_keys(key)}), got {value!r}")
            flat.update(flatten(value, label, f"{key}."))
        else:
            _check_known(key, label)
            flat[key] = value
    return flat


def parse_override(text: str) -> tuple[str, Any]:
    """'optimizer.lr=1e-4' -> ('optimizer.lr', 1e-4): the value is a YAML scalar (or flow list)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise SlimtuneError(f"override {text!r} must look like key=value (e.g. optimizer.lr=1e-4)")
    _check_known(key, f"override {text!r}")
    value = _safe_yaml(raw, f"override {text!r}") if raw.strip() else None
    return key, value


MAX_CONFIG_BYTES = 1024 * 1024
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _safe_yaml(text: str, label: str) -> Any:
    """yaml.safe_load, refusing what a config never needs and PyYAML handles badly: anchors and aliases
    (exponential expansion), nesting deeper than 64, integers of thousands of digits."""
    if _flow_depth(text) > 64:  # PyYAML's scanner is quadratic in flow nesting: refuse before it runs
        raise SlimtuneError(f"{label}: YAML nested deeper than 64 levels")
    try:
        depth = 0
        for event in yaml.parse(text, Loader=_LOADER):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                raise SlimtuneError(f"{label}: YAML anchors and aliases (& and *) are not allowed in a config")
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > 64:
                    raise SlimtuneError(f"{label}: YAML nested deeper than 64 levels")
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
        return yaml.load(text, Loader=_LOADER)  # noqa: S506 - a safe loader (libyaml's when present)
    except yaml.YAMLError as e:
        raise SlimtuneError(f"{label}: not valid YAML ({' '.join(str(e).split())[:300]})") from None
    except (ValueError, RecursionError, OverflowError) as e:  # e.g. int() of a 5,000-digit number
        raise SlimtuneError(f"{label}: YAML value cannot be read ({type(e).__name__}: {str(e)[:200]})") from None


def load_config(path_or_name: str, overrides: list[str] | tuple[str, ...] = (), values: dict[str, Any] | None = None) -> Config:
    """Read, override (``key=value`` texts, then ``values`` from code), type-check and resolve a config.
    Raises SlimtuneError naming the key on any problem."""
    label, data = read_config_source(path_or_name)
    merged = {k.name: k.default for k in SCHEMA}
    merged.update(flatten(data, label))
    for text in overrides:
        key, value = parse_override(text)
        merged[key] = value
    for key, value in (values or {}).items():
        _check_known(key, label)
        merged[key] = value
    return validate(merged, label)


def validate(values: dict[str, Any], label: str = "config") -> Config:
    """Coerce and check every value against the schema; resolve paths (placeholder, ~, absolute)."""
    checked = {}
    for key in SCHEMA:
        checked[key.name] = _check_value(key, values.get(key.name, key.default), label)
    try:
        output_dir = Path(checked["output_dir"]).expanduser().resolve()
        for parent in (output_dir, *output_dir.parents):
            if parent.exists():
                if not parent.is_dir():
                    what = "output_dir" if parent == output_dir else f"output_dir's parent {parent}"
                    raise SlimtuneError(f"{label}: config key 'output_dir' = {output_dir}: {what} exists and is not a directory")
                break
        checked["output_dir"] = str(output_dir)
        for key in SCHEMA:
            if key.kind == "path" and key.name != "output_dir" and checked[key.name] is not None:
                checked[key.name] = _resolve(checked[key.name], output_dir)
            if key.kind == "list[path]" and checked[key.name] is not None:
                checked[key.name] = [_resolve(p, output_dir) for p in checked[key.name]]
    except (OSError, RuntimeError, ValueError) as e:  # a name too long, a loop of links, ...
        raise SlimtuneError(f"{label}: a path in the config cannot be used ({type(e).__name__}: {e})"[:400]) from None
    return Config(checked)


def _resolve(path: str, output_dir: Path) -> str:
    return str(Path(path.replace(PLACEHOLDER, str(output_dir))).expanduser().resolve())


def _check_known(key: str, label: str) -> None:
    if key in KEYS:
        return
    close = difflib.get_close_matches(key, list(KEYS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else f"; known keys: {', '.join(KEYS)}"
    raise SlimtuneError(f"{label}: unknown config key {key!r}{hint}")


def _section_keys(section: str) -> str:
    return ", ".join(k.name.rpartition(".")[2] for k in SCHEMA if k.name.rpartition(".")[0] == section)


def _type_error(key: Key, value: Any, label: str, expected: str) -> SlimtuneError:
    return SlimtuneError(f"{label}: config key {key.name!r} must be {expected}, got {value!r} ({type(value).__name__})")


def _check_value(key: Key, value: Any, label: str) -> Any:
    if value is None:
        if key.required:
            raise SlimtuneError(f"{label}: config key {key.name!r} is required: {key.help} (set it with {key.name}=...)")
        if key.nullable or key.default is None:
            return None
        raise _type_error(key, value, label, _expected(key))
    if key.kind == "bool":
        if not isinstance(value, bool):
            raise _type_error(key, value, label, "true or false")
    elif key.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(key, value, label, "an integer")
        if not -(2**63) <= value < 2**64 or (key.name == "seed" and value < 0):
            raise SlimtuneError(
                f"{label}: config key {key.name!r} must be {'in [0, 2**64)' if key.name == 'seed' else 'a 64-bit integer'}, got {value}"
            )
    elif key.kind == "float":
        if isinstance(value, str) and _NUMBER.match(value.strip()):
            value = float(value)  # PyYAML reads 1e-4 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
            raise _type_error(key, value, label, "a number")
        value = float(value)
    elif key.kind in ("str", "path"):
        if not isinstance(value, str) or not value.strip():
            raise _type_error(key, value, label, "a non-empty string")
        if "\x00" in value or not _encodable(value):
            raise SlimtuneError(f"{label}: config key {key.name!r} holds a NUL byte or invalid Unicode")
    elif key.kind in ("list[str]", "list[path]"):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise _type_error(key, value, label, "a non-empty list of strings")
    elif key.kind == "list[float]":
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        value = [float(v) if isinstance(v, str) and _NUMBER.match(v.strip()) else v for v in value] if isinstance(value, list) else value
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in value)
        ):
            raise _type_error(key, value, label, "a non-empty list of numbers >= 0")
        value = [float(v) for v in value]
    elif key.kind == "map":
        if isinstance(value, str):
            pairs = [p.partition("=") for p in value.split(",") if p.strip()]
            if not all(sep for _, sep, _ in pairs):
                raise _type_error(key, value, label, "a mapping, or key=column pairs separated by commas")
            value = {k.strip(): v.strip() for k, _, v in pairs}
        if not isinstance(value, dict) or not all(isinstance(k, str) and k and isinstance(v, str) and v for k, v in value.items()):
            raise _type_error(key, value, label, "a mapping of strings to strings")
    if key.choices and value not in key.choices:
        raise SlimtuneError(f"{label}: config key {key.name!r} must be one of {', '.join(key.choices)}, got {value!r}")
    if key.minimum is not None and value < key.minimum:
        raise SlimtuneError(f"{label}: config key {key.name!r} must be >= {key.minimum:g}, got {value!r}")
    if key.maximum is not None and value >= key.maximum:
        raise SlimtuneError(f"{label}: config key {key.name!r} must be < {key.maximum:g}, got {value!r}")
    if key.name == "checkpoint.max_shard_size":
        try:
            parse_size(value)
        except ValueError as e:
            raise SlimtuneError(f"{label}: config key {key.name!r}: {e}") from None
    return value


_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\']|\'\')*\'', re.S)


def _flow_depth(text: str) -> int:
    depth = deepest = 0
    for ch in re.sub(r"[^\[\]{}]+", "", _QUOTED.sub("", text)):
        depth = depth + 1 if ch in "[{" else max(0, depth - 1)
        deepest = max(deepest, depth)
    return deepest


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond the float range
        return False


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _expected(key: Key) -> str:
    kinds = {"bool": "true or false", "int": "an integer", "float": "a number", "list[float]": "a list of numbers", "map": "a mapping"}
    return kinds.get(key.kind, "a list of strings" if key.kind.startswith("list") else "a string")


def _default_text(key: Key) -> str:
    if key.required:
        return "required"
    if key.default is None:
        return "null"
    if isinstance(key.default, list | dict):
        return "[" + ", ".join(key.default) + "]"
    return str(key.default).lower() if isinstance(key.default, bool) else str(key.default)


def schema_help() -> str:
    """Plain-text description of every key, for `slimtune finetune --help`."""
    lines = [
        "config keys: YAML sections (optimizer: {lr: 2.0e-4}) or key=value overrides read as YAML scalars.",
        "A default applies where the config file does not set the key; 'fixed on resume' keys must match the checkpoint.",
    ]
    for key in SCHEMA:
        kind = "|".join(key.choices) if key.choices else key.kind
        notes = [kind, f"default {_default_text(key)}" if not key.required else "required"]
        if key.fixed:
            notes.append("fixed on resume")
        lines.append(f"  {key.name}  ({'; '.join(notes)})")
        lines += textwrap.wrap(key.help, width=100, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def schema_markdown() -> str:
    """The same descriptions as a Markdown table, for docs/configuration.md (tests keep the two in step)."""
    rows = ["| key | type | default | resume | description |", "| --- | --- | --- | --- | --- |"]
    for key in SCHEMA:
        kind = " \\| ".join(key.choices) if key.choices else key.kind
        rows.append(f"| `{key.name}` | {kind} | {_default_text(key)} | {'fixed' if key.fixed else 'may change'} | {key.help} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(schema_markdown())
