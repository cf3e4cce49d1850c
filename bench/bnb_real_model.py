"""Training from a bitsandbytes 4-bit copy of the real SmolLM2-135M-Instruct, with bitsandbytes and PEFT as the
oracles (issue 27; too slow for `make test`, so a bench): the copy is made by transformers + bitsandbytes
(``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True)``, NF4, compute dtype bf16,
``save_pretrained``); `slimtune finetune --config tiny model.path=COPY model.create_tiny=false ...` trains on it
with the real-model tests' settings (tests/real_model.SETTINGS) for --steps steps, one merged save at the end.
Prints, with the bounds of tests/test_recipe_real_model.py: how many of the 210 frozen weights equal
``bitsandbytes.functional.dequantize_4bit`` of the file bit for bit; the logits of slimtune's adapter form
against PEFT's, loading slimtune's adapter onto transformers' own 4-bit load of the copy; the step losses
against PEFT + bitsandbytes QLoRA from slimtune's initial adapters on the same batches; that the merged save
has no quantization_config and reloads in plain transformers (its eval loss against the recorded one).
One JSON line at the end, with the load average (a shared machine: loaded figures).

Usage: python bench/bnb_real_model.py [--steps 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.real_model: the model, data and PEFT reference the tests use

import torch  # noqa: E402
from bitsandbytes.functional import QuantState, dequantize_4bit  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from slimtune.cli import main as slimtune_main  # noqa: E402
from slimtune.config import load_config  # noqa: E402
from slimtune.data import DataSpec, collate, load_data  # noqa: E402
from slimtune.lora import LoRAConfig, qlora_linears  # noqa: E402
from slimtune.model import load_adapter_weights, load_qlora_model  # noqa: E402
from slimtune.quant import base_rows, is_bnb4  # noqa: E402
from tests.real_model import (  # noqa: E402
    SETTINGS,
    TARGETS,
    bnb_4bit_checkpoint,
    ensure_real_model,
    eval_loss,
    finetune_overrides,
    initial_adapters,
    peft_lora_model,
    peft_train,
    write_docstring_data,
)
from tests.test_recipe_real_model import FIRST_STEP_BOUND, LOGITS_BOUND, STEP_LOSS_BOUND  # noqa: E402


def _bit_exact(model, path: Path) -> tuple[int, int]:
    """(frozen 4-bit weights equal to bitsandbytes' dequantization of the file, 4-bit weights)."""
    equal = total = 0
    with safe_open(str(next(path.glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
        for name, m in qlora_linears(model).items():
            if not is_bnb4(m.weight):
                continue
            key = f"{name}.weight"
            aux = {k[len(key) + 1 :]: f.get_tensor(k) for k in names if k.startswith(key + ".")}
            reference = dequantize_4bit(f.get_tensor(key), QuantState.from_dict(aux, device=torch.device("cpu")))
            total += 1
            equal += torch.equal(base_rows(m.weight, 0, m.weight.shape[0]), reference)
    return equal, total


def bench(steps: int, out: Path) -> dict:
    base = ensure_real_model()
    bnb = bnb_4bit_checkpoint(
        base, out / "bnb", bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16
    )
    train, held_out = write_docstring_data(out / "data")
    overrides = finetune_overrides(bnb, train, held_out, out / "run", steps)
    load_before = os.getloadavg()
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        code = slimtune_main(["finetune", "--config", "tiny", *overrides])
    if code not in (0, None):
        raise SystemExit(f"slimtune finetune failed ({code}): {log.getvalue()[-2000:]}")
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    (ckpt,) = sorted((out / "run").glob("step-*"))
    tokenizer = AutoTokenizer.from_pretrained(str(bnb))
    data = load_data(DataSpec.from_config(load_config("tiny", overrides)), tokenizer)
    pad = tokenizer.pad_token_id

    ours_model = load_qlora_model(bnb, LoRAConfig(SETTINGS["rank"], SETTINGS["alpha"], 0.0, False, TARGETS), progress=False)
    load_adapter_weights(ours_model, ckpt / "adapter" / "adapter_model.safetensors")
    equal, total = _bit_exact(ours_model, bnb)
    batch = {k: v for k, v in collate(data.eval[:4], pad).items() if k != "labels"}
    mask = batch["attention_mask"].bool()
    from peft import PeftModel

    with torch.no_grad():
        ours = ours_model.eval()(**batch).logits.float()[mask]
        del ours_model
        hf = AutoModelForCausalLM.from_pretrained(str(bnb), device_map="cpu", dtype=torch.bfloat16)
        base_logits = hf.eval()(**batch).logits.float()[mask]
        theirs = PeftModel.from_pretrained(hf, ckpt / "adapter").eval()(**batch).logits.float()[mask]
    diff, moved = (theirs - ours).abs(), (base_logits - ours).abs()

    peft_losses, _ = peft_train(peft_lora_model(bnb, initial_adapters(bnb)), data.train, pad, steps, steps)
    step_diffs = [abs(a - r["loss"]) for a, r in zip(peft_losses, metrics, strict=True)]

    config = json.loads((ckpt / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16)
    reloaded = eval_loss(merged, data.eval, pad, batch_size=SETTINGS["batch_size"])
    final = metrics[-1]
    return {
        "steps": steps,
        "bit_exact_frozen_weights": f"{equal} of {total}",
        "logits_mean_abs_diff_vs_peft_bnb": round(diff.mean().item(), 5),
        "logits_bound": round(LOGITS_BOUND * moved.mean().item(), 5),
        "logits_max_abs_diff": round(diff.max().item(), 4),
        "logits_max_bound": round(0.1 * moved.max().item(), 4),
        "step_losses_slimtune": [round(r["loss"], 4) for r in metrics],
        "step_losses_peft_bnb": [round(x, 4) for x in peft_losses],
        "step_loss_max_abs_diff": round(max(step_diffs), 5),
        "step_loss_bound": STEP_LOSS_BOUND,
        "first_step_diff": round(step_diffs[0], 6),
        "first_step_bound": FIRST_STEP_BOUND,
        "merged_has_quantization_config": "quantization_config" in config,
        "merged_reloaded_in_transformers_eval_loss": round(reloaded, 4),
        "recorded_eval_loss_merged": round(final.get("eval_loss_merged", float("nan")), 4),
        "eval_loss_adapter_form": round(final.get("eval_loss", float("nan")), 4),
        "log_says_merge_base": "merge base of the merged saves: the base file's dequantized 4-bit weights" in log.getvalue(),
        "load_average_before_after": [round(load_before[0], 1), round(os.getloadavg()[0], 1)],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="work directory (default: a temporary one)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        print(json.dumps(bench(args.steps, out)))


if __name__ == "__main__":
    main()
