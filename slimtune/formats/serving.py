"""Serving an adapter with vLLM or SGLang: what each server's LoRA loader does with ``adapter_config.json``
(refuses it, or loads it and drops or ignores a part), as one list of rules per server, each citing the
loader code it comes from; and the command line that loads the adapter (``serve_commands``).

Read from vLLM's ``vllm/lora/peft_helper.py`` (``PEFTHelper.from_dict``, ``_validate_features``,
``validate_legal``), ``vllm/lora/lora_model.py`` (``LoRAModel.from_local_checkpoint``,
``from_lora_tensors``), ``vllm/lora/worker_manager.py`` (``WorkerLoRAManager._load_adapter``) and
``vllm/config/lora.py`` (``LoRAConfig.max_lora_rank``, ``MaxLoRARanks``); SGLang's ``python/sglang/srt/lora/``
(``lora_config.LoRAConfig``, ``lora.LoRAAdapter``, ``lora_manager.LoRAManager.validate_new_adapter``).

LoRA on ``embed_tokens`` and ``lm_head`` is no refusal: vLLM lists both among the modules it expects on
Llama-family models (``embedding_modules``, which ``_load_adapter`` adds to ``expected_lora_modules``), as
long as the embedding's ``lora_A`` spans the base's vocabulary (``from_lora_tensors``), as every PEFT
embedding adapter's does.

Example::

    problems = serving_problems({"r": 32, "lora_alpha": 64, "target_modules": ["q_proj", "v_proj"]})  # []
    serve_commands({"r": 32}, "org/base", "runs/1/step-100/adapter")[0]
    # 'vllm serve org/base --enable-lora --max-lora-rank 32 --lora-modules step-100=runs/1/step-100/adapter'
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slimtune.formats.layout import ADAPTER_CONFIG, CheckpointLayout
from slimtune.formats.strict_json import load_json

# vllm/config/lora.py: MaxLoRARanks, the values --max-lora-rank takes; LoRAConfig.max_lora_rank defaults to 16.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
VLLM_DEFAULT_MAX_LORA_RANK = 16
# PEFTHelper._init_is_supported: init_lora_weights strings vLLM accepts (they only set the initial weights).
_VLLM_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")


@dataclass(frozen=True)
class Rule:
    """One thing a server's loader does with an adapter config: ``broken(config)`` says why it applies (or
    None); ``refuses``: the adapter does not load (else it loads with that part dropped or ignored)."""

    server: str
    refuses: bool
    broken: Callable[[dict], str | None]


def _targets(config: dict) -> list[str]:
    targets = config.get("target_modules")
    named = [targets] if isinstance(targets, str) else targets if isinstance(targets, list) else []
    return [t.rsplit(".", 1)[-1] for t in named if isinstance(t, str)]


def _ranks(config: dict) -> list[int]:
    pattern = config.get("rank_pattern") if isinstance(config.get("rank_pattern"), dict) else {}
    return [r for r in (config.get("r"), *pattern.values()) if type(r) is int]


def _missing_fields(c: dict) -> str | None:
    # PEFTHelper.from_dict: r, lora_alpha and target_modules are its fields without defaults ("Missing required
    # configuration fields")
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in c]
    return f"{', '.join(missing)} missing (required fields)" if missing else None


def _vllm_rank(c: dict) -> str | None:
    # PEFTHelper.validate_legal: max(r, *rank_pattern.values()) > max_lora_rank; --max-lora-rank takes at most 512
    top = max(_ranks(c), default=0)
    return f"rank {top} is above {VLLM_MAX_LORA_RANKS[-1]}, the largest --max-lora-rank" if top > VLLM_MAX_LORA_RANKS[-1] else None


def _vllm_modules_to_save(c: dict) -> str | None:
    # PEFTHelper._validate_features: modules_to_save other than "classifier" / "score" (classification heads)
    saved = c.get("modules_to_save")
    other = [m for m in saved if m not in ("classifier", "score")] if isinstance(saved, list) else [saved] if saved else []
    return f"modules_to_save {other} (only classifier/score are loaded)" if other else None


def _vllm_init(c: dict) -> str | None:
    # PEFTHelper._validate_features / _init_is_supported: inits that change the base weights (PiSSA, OLoRA, ...)
    init = c.get("init_lora_weights", True)
    return f"init_lora_weights={init!r} (changes the base weights)" if isinstance(init, str) and init.lower() not in _VLLM_INITS else None


def _flag(key: str, what: str) -> Callable[[dict], str | None]:
    return lambda c: f"{what} ({key} is set)" if c.get(key) else None


VLLM_RULES = (
    Rule("vLLM", True, _missing_fields),
    # PEFTHelper.__post_init__: "LoRA rank `r` must be a positive integer"
    Rule("vLLM", True, lambda c: f"r={c['r']!r} (a positive rank)" if isinstance(c.get("r"), int) and c["r"] <= 0 else None),
    Rule("vLLM", True, _vllm_rank),
    Rule("vLLM", True, _vllm_modules_to_save),
    # PEFTHelper._validate_features ("vLLM does not yet support DoRA"); LoRAModel.from_lora_tensors refuses it too
    Rule("vLLM", True, _flag("use_dora", "DoRA")),
    # PEFTHelper._validate_features: "vLLM does not support LoRA bias (lora_bias)"
    Rule("vLLM", True, _flag("lora_bias", "LoRA bias")),
    Rule("vLLM", True, _vllm_init),
    # PEFTHelper._validate_features: aLoRA, layer_replication, BD-LoRA, QALoRA
    Rule("vLLM", True, _flag("alora_invocation_tokens", "Activated LoRA")),
    Rule("vLLM", True, _flag("layer_replication", "layer_replication")),
    Rule("vLLM", True, _flag("use_bdlora", "block-diagonal LoRA")),
    Rule("vLLM", True, _flag("use_qalora", "QALoRA")),
    # PEFTHelper.validate_legal: "Adapter bias is not supported" for any bias but "none"
    Rule("vLLM", True, lambda c: f"bias={c['bias']!r} (only 'none')" if c.get("bias", "none") != "none" else None),
)


def _sglang_qkv(c: dict) -> str | None:
    # LoRAAdapter.normalize_qkv_proj: a q_proj weight is stacked with weights[v_name]; no v_proj is a KeyError
    targets = set(_targets(c))
    return (
        "q_proj without v_proj (its loader stacks q, k, v and fails on the missing v_proj)"
        if "q_proj" in targets and "v_proj" not in targets
        else None
    )


SGLANG_RULES = (
    # lora_config.LoRAConfig.__init__: hf_config["target_modules"], ["r"], ["lora_alpha"] (a KeyError without them)
    Rule("SGLang", True, _missing_fields),
    # lora.LoRAAdapter.__init__: assert peft_type == "lora"
    Rule(
        "SGLang",
        True,
        lambda c: f"peft_type {c.get('peft_type')!r} (only LORA)" if str(c.get("peft_type", "LORA")).lower() != "lora" else None,
    ),
    Rule("SGLang", True, _sglang_qkv),
    # lora_manager.LoRAManager.validate_new_adapter: "doesn't support DoRA adapters"
    Rule("SGLang", True, _flag("use_dora", "DoRA")),
    # lora.LoRAAdapter._process_weight keeps layer weights and embed_tokens/lm_head only: modules_to_save are dropped
    Rule("SGLang", False, lambda c: f"modules_to_save {c['modules_to_save']} dropped" if c.get("modules_to_save") else None),
    # lora_config.LoRAConfig reads r, lora_alpha, target_modules, the patterns and use_dora: bias is ignored
    Rule(
        "SGLang",
        False,
        lambda c: (
            f"biases ignored (bias={c.get('bias', 'none')!r}, lora_bias={bool(c.get('lora_bias'))})"
            if c.get("bias", "none") != "none" or c.get("lora_bias")
            else None
        ),
    ),
    # lora.LoRAAdapter.__init__: scaling = lora_alpha / r, whatever use_rslora says
    Rule("SGLang", False, lambda c: "use_rslora ignored (scales by lora_alpha / r, not / sqrt(r))" if c.get("use_rslora") else None),
)

RULES = {"vLLM": VLLM_RULES, "SGLang": SGLANG_RULES}


def serving_problems(config: dict, server: str | None = None) -> list[str]:
    """What ``server``'s loader (vLLM, SGLang; both when None) would refuse, drop or ignore in
    ``adapter_config.json``, one line each naming the server; ``[]`` when it loads the adapter as PEFT does
    (with the flags ``serve_commands`` gives).

    Example: ``serving_problems({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}) == []``"""
    lines = []
    for name, rules in RULES.items():
        if server not in (None, name):
            continue
        for rule in rules:
            why = rule.broken(config)
            if why:
                lines.append(f"{name} {'will not load it' if rule.refuses else 'loads it'}: {why}")
    return lines


def vllm_max_lora_rank(r: int) -> int | None:
    """The smallest ``--max-lora-rank`` vLLM must be started with to load a rank-``r`` adapter (None: none can).

    Example: ``vllm_max_lora_rank(12) == 16``"""
    return next((m for m in VLLM_MAX_LORA_RANKS if m >= r), None)


def serve_commands(config: dict, base: str, adapter: str | Path, name: str | None = None) -> list[str]:
    """The vLLM and SGLang command lines that serve ``base`` with the adapter at ``adapter`` as model ``name``
    (the adapter's parent directory's name by default): ``--max-lora-rank`` where the rank is above vLLM's
    default 16.

    Example: ``serve_commands({"r": 32}, "org/m", "ckpt/adapter", "mine")[0]``
    -> ``'vllm serve org/m --enable-lora --max-lora-rank 32 --lora-modules mine=ckpt/adapter'``"""
    name = name or Path(adapter).parent.name or "adapter"
    module = shlex.quote(f"{name}={adapter}")
    rank = vllm_max_lora_rank(max(_ranks(config), default=1))
    rank_flag = f" --max-lora-rank {rank}" if rank is not None and rank > VLLM_DEFAULT_MAX_LORA_RANK else ""
    return [
        f"vllm serve {shlex.quote(base)} --enable-lora{rank_flag} --lora-modules {module}",
        f"python -m sglang.launch_server --model-path {shlex.quote(base)} --enable-lora --lora-paths {module}",
    ]


def serving_report(checkpoint: str | Path, base: str) -> tuple[list[str], list[str]]:
    """For the adapter of ``checkpoint`` (a ``step-N`` directory) trained on ``base`` (a hub id or a
    directory): the commands that serve it (``serve_commands``) and what a server would refuse, drop or
    ignore (``serving_problems``). ``([], [])`` when the checkpoint has no adapter.

    Example: ``commands, problems = serving_report("runs/1/step-000100", "org/base")``"""
    adapter = CheckpointLayout(checkpoint).adapter_dir
    if adapter is None:
        return [], []
    config = load_json(Path(adapter) / ADAPTER_CONFIG, max_bytes=16 * 1024 * 1024, what=ADAPTER_CONFIG)
    return serve_commands(config, base, adapter, Path(checkpoint).name), serving_problems(config)
