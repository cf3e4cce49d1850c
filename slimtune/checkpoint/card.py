"""The model card (README.md) a fine-tuning checkpoint carries, at its root and in ``adapter/``: what it was
trained from and on, how far, how well, with which LoRA settings, and how to load each form of it.

Example::

    text = model_card(CardFacts(base="models/llama", step=100, total_steps=100, ...))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import metadata

VERSIONED = ("slimtune", "torch", "transformers", "peft", "huggingface_hub")


def software_versions(names: tuple[str, ...] = VERSIONED) -> dict[str, str]:
    """Installed versions of slimtune and the libraries a checkpoint's numbers depend on, read from the
    package metadata (nothing is imported); "not installed" where one is missing.

    Example: ``software_versions()["torch"]`` -> ``"2.13.0+cpu"``"""
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


@dataclass
class CardFacts:
    """Everything the card states; filled by the recipe at each checkpoint."""

    base: str  # the hub id, or the base directory
    model_type: str
    step: int
    total_steps: int
    epoch: int
    train_loss: float
    lora: dict  # rank, alpha, dropout, use_rslora, target_modules
    files: list[tuple[str, str]]  # (path, sha256)
    shapes: dict[str, int]
    prompt_format: str
    merged: bool
    merged_dtype: str
    eval: dict | None = None  # eval_loss, eval_ppl, eval_tokens
    settings: dict = field(default_factory=dict)  # a few more config values worth stating
    nf4: dict | None = None  # slimtune.model.nf4_report: NF4 count, scaler blocks, what kept its dtype
    base_revision: str | None = None  # the hub commit the base was resolved to (None: a local directory)
    datasets: list[str] = field(default_factory=list)  # hub dataset ids trained or evaluated on (the card's `datasets:`)
    versions: dict = field(default_factory=software_versions)


def model_card(f: CardFacts) -> str:
    """The card as Markdown (YAML front matter for the Hugging Face Hub)."""
    lora = f.lora
    scaling = "alpha / sqrt(r) (rsLoRA)" if lora["use_rslora"] else "alpha / r"
    evaluated = (
        (
            f"{f.eval['eval_loss']:.4f} (perplexity {f.eval['eval_ppl']:.2f}, {f.eval['eval_tokens']:,} tokens)"
            if f.eval
            else "not evaluated"
        )
        if not f.eval or "eval_ppl" in f.eval
        else _preference_eval(f.eval)
    )
    files = "\n".join(f"| `{path}` | `{sha}` |" for path, sha in f.files)
    shapes = ", ".join(f"{n} {shape}" for shape, n in sorted(f.shapes.items()))
    quantized = "a bitsandbytes 4-bit" if _prequantized(f) else "an NF4-quantized"
    return f"""---
base_model: {f.base}
{_datasets_field(f.datasets)}library_name: peft
tags: [slimtune, qlora, lora]
---

# QLoRA adapter for `{f.base}` (slimtune)

Fine-tuned with slimtune (QLoRA) on {quantized} `{f.model_type}` base: step {f.step} of {f.total_steps}
(epoch {f.epoch}). {_quantized_text(f.nf4)}

| | |
| --- | --- |
| base model | `{f.base}` |
| base revision | {f"`{f.base_revision}` (hub commit)" if f.base_revision else "a local directory (no hub revision)"} |
| steps | {f.step} of {f.total_steps} |
| train loss (this step) | {f.train_loss:.4f} |
| eval loss | {evaluated} |{_merged_eval_row(f)}
| LoRA | r = {lora["rank"]}, alpha = {lora["alpha"]:g}, scaling {scaling}, dropout {lora["dropout"]:g} |
| LoRA targets | {", ".join(lora["target_modules"])} |
| data rows | {shapes} |
| prompt format | {f.prompt_format} (see below) |
| merge base | {_merge_base_text(f)} |
| software | {", ".join(f"{name} {version}" for name, version in f.versions.items())} |

## Data files

Hub datasets are named `org/name@<commit>:split` (`:subset:split` with a subset); their sha256 is that name's.

| file | sha256 |
| --- | --- |
{files}

## Prompt format

Training rendered conversations with the chat template stored in this checkpoint's tokenizer files (the fallback
`<|role|>` template when the base tokenizer had none), Alpaca rows with the Alpaca prompt, text rows as
`bos + text + eos`. `slimtune_format.json` records which one a plain prompt should use ({f.prompt_format}).

{_how_to_load(f, scaling)}"""


def _datasets_field(names: list[str]) -> str:
    """The front matter's ``datasets:`` list (hub dataset ids, as the hub links them), or nothing."""
    return "datasets:\n" + "".join(f"- {name}\n" for name in names) if names else ""


def _prequantized(f: CardFacts) -> bool:
    """Trained from a bitsandbytes 4-bit checkpoint: its dequantized weights are the base (there is no other W)."""
    return bool(f.nf4 and f.nf4.get("bnb4"))


def _merge_base_text(f: CardFacts) -> str:
    if not f.merged:
        return "n/a (adapter only)"
    if _prequantized(f):
        return "the base file's dequantized weight (bitsandbytes 4-bit, bitsandbytes' own dequantization: what training saw)"
    return "quantized: dequant(NF4(W))"


def _how_to_load(f: CardFacts, scaling: str) -> str:
    """The card's last section: the merged model, the adapter on NF4, the adapter on W with PEFT."""
    base_weight = "dequant_bnb(W4)" if _prequantized(f) else "dequant(NF4(W))"
    merged_text = (
        f"The merged model at the checkpoint's root ({f.merged_dtype} safetensors) is W' = {base_weight} + {scaling} * B A, computed "
        "in fp32 and rounded once: the weights training computed with (merge base `quantized`), not the original W."
        if f.merged
        else "This checkpoint holds the adapter only (merge it with `slimtune merge --merge-base quantized`)."
    )
    if f.merged and _prequantized(f):
        merged_text = (
            f"The merged model at the checkpoint's root ({f.merged_dtype} safetensors) is W' = {base_weight} + {scaling} * B A, computed "
            "in fp32 and rounded once, where dequant_bnb(W4) is the base file's bitsandbytes 4-bit weight as bitsandbytes dequantizes "
            "it: what training computed with, and the only base weight there is (both `--merge-base` choices mean it). Its config "
            "has no `quantization_config`: a plain 16-bit model."
        )
    return f"""## How to load it

{merged_text}

Merged model, plain transformers:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("CHECKPOINT")
tokenizer = AutoTokenizer.from_pretrained("CHECKPOINT")
```

Adapter on the NF4 base, exactly what was trained (bounded memory, as `slimtune finetune` loads it):

```
slimtune generate CHECKPOINT --form adapter --prompt "..."
slimtune chat CHECKPOINT --form adapter
```

Adapter on the plain (unquantized) base with PEFT:

```python
from peft import PeftModel
from transformers import AutoModelForCausalLM
base = AutoModelForCausalLM.from_pretrained("{f.base}"{f', revision="{f.base_revision}"' if f.base_revision else ""})
model = PeftModel.from_pretrained(base, "CHECKPOINT/adapter")
```

This applies the adapter to W instead of dequant(NF4(W)), the weights it was trained against: outputs shift by the
base's quantization error (`slimtune demo` prints how far on the tiny model). Prefer the merged model or the NF4
form when you want what training measured; `slimtune merge --merge-base original` makes a merged model on W.
"""


def _quantized_text(nf4: dict | None) -> str:
    """One sentence: how many targeted linears were NF4, with which scaler blocks, and which were not."""
    if not nf4:
        return ""
    if nf4.get("bnb4"):
        return (
            f"The base is a bitsandbytes 4-bit checkpoint: {nf4['bnb4']} of {nf4['targets']} frozen linears are its 4-bit "
            "weights as stored, dequantized as bitsandbytes dequantizes them."
        )
    blocks = ", ".join(f"{sbs} x {n}" for sbs, n in nf4["scaler_blocks"].items())
    text = f"NF4 (blocks of {nf4['block_size']}): {nf4['nf4']} of {nf4['targets']} targeted linears"
    text += f"; scaler block (64-element blocks per double-quantized scale) x tensors: {blocks}" if blocks else ""
    kept = nf4["kept"]
    if kept:
        text += f"; kept in their dtype: {', '.join(f'`{k}` ({why})' for k, why in kept.items())}"
    return text + ". Per-tensor scaler blocks: `slimtune_format.json`, key `nf4`."


def _preference_eval(e: dict) -> str:
    """A preference run's evaluation: its loss, reward accuracy and margin (TRL's eval_ names)."""
    return f"{e['eval_loss']:.4f} (reward accuracy {e['eval_rewards/accuracies']:.3f}, margin {e['eval_rewards/margins']:.4f})"


def _merged_eval_row(f: CardFacts) -> str:
    """The table row of eval_loss_merged, with what its difference from eval_loss means ("" without it)."""
    if not f.eval or "eval_loss_merged" not in f.eval:
        return ""
    diff = f.eval["eval_loss_merged"] - f.eval["eval_loss"]
    return (
        f"\n| eval loss, merged model | {f.eval['eval_loss_merged']:.4f} ({diff:+.4f} vs the adapter on the NF4 base: the cost of "
        f"rounding W' + B A once to {f.merged_dtype}; `checkpoint.merged_dtype: fp32` avoids it) |"
    )
