"""`slimtune demo`: a real model learning, and the whole job around it.

By default: SmolLM2-135M-Instruct (fetched once into a cache and converted, ``slimtune.demo_model``), its
greedy answers to three held-out questions "What does `module.function` do in Python?", QLoRA
fine-tuning with the recipe on 240 such questions answered by the standard library's own docstrings
(stopped halfway and resumed from the checkpoint), the merged model's answers as plain transformers
loads it beside the base's, then the checks: the checkpoint's files, the save's time and peak RSS, the
merged model reloaded by transformers and the adapter by PEFT against the in-memory QLoRA model, the GGUF
export and llama.cpp's reply where llama-cpp-python is installed.

Offline (``--offline``, or when the fetch fails): the same on the embedded tiny Llama with the shipped
``tiny`` config and its built-in data, written under the output directory."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
import time
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slimtune.config import load_config
from slimtune.demo_model import NAME as MODEL_NAME
from slimtune.demo_model import ensure_model, write_docstring_data
from slimtune.errors import SlimtuneError
from slimtune.fileio import write_atomic
from slimtune.formats.hub import resolve_model
from slimtune.formats.layout import ADAPTER_DIR
from slimtune.formats.merge_source import MergeSource
from slimtune.generate import SamplingOptions, generate, load_for_generation, prompt_ids
from slimtune.model import pick_dtype
from slimtune.recipes.finetune import run_finetune
from slimtune.tiny import DEMO_TEXTS

TINY_STEPS = 60
REAL_STEPS = 20
GENERATE_PROMPT = "Can training resume?"  # the tiny demo's prompt (its built-in data is about slimtune)
SHOWN_QUESTIONS = (0, 25, 50)  # which held-out questions the real demo asks, before and after
ANSWER_TOKENS = 40
# The real demo's recipe settings over the shipped `tiny` config: the real-model tests' (tests/real_model.py):
# LoRA r=8 on every projection, batch 4 of at most 128 tokens, lr 2e-3 (a short run), one merged save at the end.
REAL_VALUES = {
    "model.create_tiny": False, "dataset.create_builtin": False, "dataset.max_seq_len": 128, "dtype": "bf16",
    "lora.rank": 8, "lora.alpha": 16.0, "optimizer.lr": 2e-3, "optimizer.weight_decay": 0.0, "scheduler.warmup_steps": 2,
    "scheduler.min_lr_ratio": 0.1, "checkpoint.merged": "final", "checkpoint.save_every_n_steps": None,
    "checkpoint.keep_last_n": None, "checkpoint.async": False, "logging.progress_bar": False,
}  # fmt: skip


def demo_batch(tokenizer, texts: list[str]) -> dict[str, torch.Tensor]:
    """``texts`` tokenized and padded on the tokenizer's side with its pad token (its eos when it has
    none: the tokenizer itself is left as it is), labels -100 on the padding."""
    pad_id = _pad_id(tokenizer)
    rows = [tokenizer(t)["input_ids"] for t in texts]
    width = max(len(r) for r in rows)
    left = tokenizer.padding_side == "left"
    ids = [[pad_id] * (width - len(r)) + r if left else r + [pad_id] * (width - len(r)) for r in rows]
    mask = [[int(i >= width - len(r)) if left else int(i < len(r)) for i in range(width)] for r in rows]
    batch = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
    labels = batch["input_ids"].clone()
    labels[batch["attention_mask"] == 0] = -100
    return {**batch, "labels": labels}


def run_demo(
    out_dir: str | Path = "slimtune-demo",
    base_dir: str | Path | None = None,
    steps: int | None = None,
    seed: int = 0,
    targets: list[str] | None = None,
    offline: bool = False,
) -> dict:
    """The demo: SmolLM2-135M-Instruct (fetched and converted once, ``slimtune.demo_model``) fine-tuned on
    questions about Python's standard library, its answers to held-out questions before and after; with
    ``offline``, ``base_dir``, or when the fetch fails, the embedded tiny model (or ``base_dir``) on the
    built-in data instead. Both then report the checkpoint and its checks. Returns the figures shown.

    Example: ``run_demo("slimtune-demo", offline=True)``"""
    if base_dir is None and not offline:
        try:
            base = ensure_model()
        except SlimtuneError as e:
            print(f"could not fetch {MODEL_NAME} ({e}): running the embedded tiny demo instead, offline", flush=True)
        else:
            return _real_demo(Path(out_dir).resolve(), base, steps or REAL_STEPS, seed, targets)
    return _tiny_demo(Path(out_dir).resolve(), base_dir, steps or TINY_STEPS, seed, targets)


def _tiny_demo(out_dir: Path, base_dir: str | Path | None, steps: int, seed: int, targets: list[str] | None) -> dict:
    """The fine-tuning recipe with the shipped ``tiny`` config (tiny base and built-in data created under
    ``out_dir``), then the checks: reload the merged model with transformers, the adapter with PEFT."""
    t0 = time.perf_counter()
    values = {"output_dir": str(out_dir), "training.max_steps": steps, "training.total_epochs": 10**6, "seed": seed, "overwrite": True}
    values["checkpoint.async"] = False  # the demo reports the peak RSS of the save itself, made in this process
    if base_dir is not None:  # a directory or a hub id
        values.update({"model.path": os.fspath(base_dir), "model.create_tiny": False})
    if targets is not None:
        values["lora.target_modules"] = targets
    cfg, run = _train(values, steps)
    ckpt = out_dir / "checkpoint"
    summary = _checks(cfg, run, ckpt, DEMO_TEXTS)[0]
    summary["generated"], merged = _show_generate(ckpt)
    _show_gguf(ckpt, out_dir / "model-f16.gguf", prompt_ids(merged, prompt=GENERATE_PROMPT), summary["generated"], merged.tokenizer)
    print(f"demo finished in {time.perf_counter() - t0:.1f} s; outputs under {out_dir}")
    return summary


def _real_demo(out_dir: Path, base: Path, steps: int, seed: int, targets: list[str] | None) -> dict:
    """SmolLM2-135M-Instruct: its greedy answers to three held-out questions, QLoRA fine-tuning on the
    docstring questions, the merged model's answers (plain transformers) beside the base's, the checks."""
    t0 = time.perf_counter()
    train, held_out = write_docstring_data(out_dir / "data")
    rows = [json.loads(line) for line in held_out.read_text().splitlines()]
    shown = [rows[i]["messages"] for i in SHOWN_QUESTIONS]
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    prompts = [_chat_ids(tokenizer, m[:1]) for m in shown]
    print(f"{MODEL_NAME} ({base}): its greedy answers and held-out loss before fine-tuning", flush=True)
    compute = pick_dtype("auto", torch.device("cpu"))  # the answers and checks: the recipe's dtype on this CPU
    original = AutoModelForCausalLM.from_pretrained(str(base), dtype=compute)
    before, loss_before = _answers(original, tokenizer, prompts), _held_out_loss(original, tokenizer, rows)
    del original
    count = len(train.read_text().splitlines())
    print(f'fine-tuning on {count} questions "What does `module.function` do in Python?" answered by its docstring', flush=True)
    values = dict(REAL_VALUES)
    values.update({"output_dir": str(out_dir), "model.path": str(base), "dataset.path": str(train), "training.max_steps": steps})
    values.update({"seed": seed, "training.total_epochs": 10**6, "overwrite": True})
    values["dtype"] = "auto"  # bf16 on a GPU and on a CPU that multiplies bf16 natively, else fp32 (model.pick_dtype)
    if targets is not None:
        values["lora.target_modules"] = targets
    cfg, run = _train(values, steps)
    ckpt = out_dir / "checkpoint"
    texts = [tokenizer.apply_chat_template(m, tokenize=False) for m in shown]
    summary, merged = _checks(cfg, run, ckpt, texts, compute)
    after, loss_after = _answers(merged, tokenizer, prompts), _held_out_loss(merged, tokenizer, rows)
    table = [
        {"question": m[0]["content"], "docstring": m[1]["content"], "base": b, "fine_tuned": a}
        for m, b, a in zip(shown, before, after, strict=True)
    ]
    record = {"held_out_loss": {"base": loss_before, "fine_tuned": loss_after, "questions": len(rows)}, "answers": table}
    write_atomic(out_dir / "answers.json", lambda tmp: tmp.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n"))
    _show_answers(table)
    print(
        f"\nloss of the {len(rows)} held-out docstring answers (token mean, teacher-forced): base {loss_before:.3f}, "
        f"fine-tuned {loss_after:.3f} ({loss_after - loss_before:+.3f} nats)"
    )
    summary.update(answers=table, held_out_loss_base=loss_before, held_out_loss_fine_tuned=loss_after)
    _show_gguf(ckpt, out_dir / "model-f16.gguf", prompts[0], after[0], tokenizer)
    print(f"demo finished in {time.perf_counter() - t0:.1f} s; outputs under {out_dir} (answers.json: the table above)")
    return summary


def _train(values: dict, steps: int):
    """The recipe in two invocations: the first stops at half the steps with a checkpoint, as if the
    session had ended; the second resumes from the newest complete checkpoint and continues exactly
    where the first stopped. Returns (the config, the run with both invocations' losses and peaks)."""
    config = values.pop("config", "tiny")
    half = max(1, steps // 2)

    def report(record: dict) -> None:
        if record["step"] == 1 or record["step"] % 5 == 0 or record["step"] in (half, steps):
            print(f"step {record['step']:3d}  loss {record['loss']:.4f}", flush=True)

    first = run_finetune(load_config(config, values={**values, "training.stop_after_steps": half}), on_step=report)
    if half >= steps:
        return load_config(config, values=values), first
    print(f"stopped after step {first.global_step}; resuming from {first.checkpoint.name} in a new recipe run", flush=True)
    cfg = load_config(config, values={**values, "overwrite": False, "resume": True})
    run = run_finetune(cfg, on_step=report)
    run.losses = first.losses + run.losses
    run.peak_rss_mb = max(run.peak_rss_mb, first.peak_rss_mb)
    return cfg, run


def _checks(cfg, run, ckpt: Path, texts: list[str], dtype: torch.dtype = torch.bfloat16) -> tuple[dict, torch.nn.Module]:
    """``ckpt`` linked to the run's newest checkpoint; its merged model reloaded by transformers (computing
    in ``dtype``) and its adapter by PEFT, both compared with the in-memory QLoRA model on ``texts``; the
    files, the save's time and memory printed. Returns (the figures, the merged model as transformers loaded it)."""
    model, tokenizer, result = run.model, run.tokenizer, run.last_save
    base_dir = resolve_model(cfg.model.path).path  # resolved once already by the recipe (no second fetch)
    _link(ckpt, run.checkpoint)
    batch = demo_batch(tokenizer, texts)
    device = next(p.device for p in model.parameters() if p.requires_grad)
    with torch.no_grad():
        qlora_logits = (
            model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)).logits.float().cpu()
        )
        merged = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype, local_files_only=True)
        merged_logits = merged(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    mask = batch["attention_mask"].bool()
    merged_diff = (qlora_logits - merged_logits)[mask].abs().max().item()
    peft_line = _peft_reload(base_dir, ckpt / ADAPTER_DIR, batch, qlora_logits, dtype)
    before, save_peak = run.rss_before_last_save_mb, run.peak_rss_last_save_mb
    print(f"\ncheckpoint written to {run.checkpoint} (linked as {ckpt})")
    for record in result.files:
        print(f"  {record.path:48s} {record.size:>12,d} bytes")
    print(f"  {'total':48s} {result.total_bytes:>12,d} bytes")
    print(f"loss {run.losses[0]:.4f} -> {run.losses[-1]:.4f} over {len(run.losses)} steps")
    print(f"save: {result.seconds:.2f} s, RSS before {before:.0f} MB, peak during save {save_peak:.0f} MB (+{save_peak - before:.0f} MB)")
    name = str(dtype).removeprefix("torch.")
    print(f"reloaded merged model with transformers: max |logit diff| vs in-memory QLoRA model = {merged_diff:.4f} ({name} compute)")
    print(peft_line)
    print(f"peak RSS of the whole run: {run.peak_rss_mb:.0f} MB")
    summary = {
        "loss_first": run.losses[0],
        "loss_last": run.losses[-1],
        "save_s": result.seconds,
        "rss_before_save_mb": before,
        "peak_rss_during_save_mb": save_peak,
        "max_abs_logit_diff_merged": merged_diff,
        "peak_rss_mb": run.peak_rss_mb,
    }
    return summary, merged


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt ids of ``messages`` through the tokenizer's own chat template, the assistant's turn opened."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _pad_id(tokenizer) -> int:
    """The tokenizer's pad token, its eos where it has none (the tokenizer itself is left as it is)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _answers(model, tokenizer, prompts: list[list[int]]) -> list[str]:
    """Greedy answers of a plain transformers model, ANSWER_TOKENS new tokens at most each: the prompts in
    one batch, left-padded (one decode step for all of them)."""
    eos = tokenizer.eos_token_id
    pad = _pad_id(tokenizer)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        y = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=ANSWER_TOKENS, pad_token_id=eos)
    return [tokenizer.decode(row[width:], skip_special_tokens=True).strip() for row in y]


LOSS_BATCH = 20  # held-out rows per forward of the held-out loss


def _held_out_loss(model, tokenizer, rows: list[dict]) -> float:
    """Token-mean cross-entropy of the rows' answers given their questions (chat template; the prompt's
    tokens are not counted): how likely the model finds the held-out docstrings. LOSS_BATCH rows a
    forward, right-padded (the padding masked out and not counted)."""
    total, count = 0.0, 0
    pad = _pad_id(tokenizer)
    with torch.no_grad():
        for first in range(0, len(rows), LOSS_BATCH):
            seqs, starts = [], []
            for row in rows[first : first + LOSS_BATCH]:
                starts.append(len(_chat_ids(tokenizer, row["messages"][:1])))
                text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
                seqs.append(tokenizer(text, add_special_tokens=False)["input_ids"])
            width = max(len(x) for x in seqs)
            ids = torch.tensor([x + [pad] * (width - len(x)) for x in seqs])
            mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in seqs])
            labels = torch.full_like(ids, -100)
            for r, (x, start) in enumerate(zip(seqs, starts, strict=True)):
                labels[r, start : len(x)] = ids[r, start : len(x)]
                count += len(x) - start
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            total += torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:], reduction="sum").item()
    return total / count


def _show_answers(table: list[dict]) -> None:
    """Each question and its docstring, then the two answers in two columns."""
    width = max(30, (shutil.get_terminal_size((120, 24)).columns - 3) // 2)
    print(f"\nthree held-out questions (not trained on), greedy, {ANSWER_TOKENS} new tokens at most:")
    for row in table:
        print(f"\n{row['question']}\n  docstring: {row['docstring']}")
        left = textwrap.wrap(row["base"], width) or [""]
        right = textwrap.wrap(row["fine_tuned"], width) or [""]
        print(f"{'base model':{width}s} | fine-tuned (merged, plain transformers)\n{'-' * width}-+-{'-' * width}")
        for i in range(max(len(left), len(right))):
            a, b = (left[i] if i < len(left) else ""), (right[i] if i < len(right) else "")
            print(f"{a:{width}s} | {b}".rstrip())


def _link(link: Path, target: Path) -> None:
    """``out/checkpoint`` -> the newest ``step-N`` (relative, replaced atomically); an older demo's
    real ``checkpoint`` directory is removed first."""
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)

    def make(tmp: Path) -> None:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target.name, target_is_directory=True)

    write_atomic(link, make, suffix=f".link-{os.getpid()}")


def _show_generate(ckpt: Path) -> tuple[str, object]:
    """What `slimtune generate` prints on the demo checkpoint, both forms (greedy, so they can be compared).
    Returns (the merged model's text, the merged model as loaded for generation)."""
    prompt = GENERATE_PROMPT
    rel = _shown_path(ckpt)
    print(f"\n$ slimtune generate {rel} --prompt {prompt!r} --temperature 0 --max-new-tokens 24")
    options = SamplingOptions(max_new_tokens=24, temperature=0.0)
    merged = load_for_generation(MergeSource(checkpoint=ckpt), form="merged", device="cpu")
    text = generate(merged, prompt_ids(merged, prompt=prompt), options)
    ids = merged.tokenizer(text, add_special_tokens=False)["input_ids"]
    # the text as Python writes it, so spaces and newlines show (slimtune generate prints it plainly)
    print(f"{text!r}\n(token ids: {ids})")
    print(
        "(the demo model is a random tiny Llama trained for seconds: expect noise, often spaces or repeated "
        "characters; on a real model this is its answer)"
    )
    adapter = load_for_generation(MergeSource(checkpoint=ckpt), form="adapter", device="cpu")
    same = generate(adapter, prompt_ids(adapter, prompt=prompt), options) == text
    print(
        f"(merged model, {merged.prompt_format} format; the adapter on the NF4 base (--form adapter) gives "
        f"{'the same text' if same else 'a different text'}; try: slimtune chat {rel})"
    )
    return text, merged


def _shown_path(path: Path) -> str:
    """``path`` relative to the working directory where it lies under it, else absolute."""
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else rel


def _show_gguf(ckpt: Path, out: Path, ids: list[int], transformers_text: str, tokenizer) -> None:
    """`slimtune export CKPT --format gguf` in a child process (its own peak RSS), then, where llama_cpp
    is installed, llama.cpp's greedy reply to the prompt ``ids`` next to transformers' text."""
    import subprocess
    import sys

    print(f"\n$ slimtune export {_shown_path(ckpt)} --format gguf --type f16 --out {out} --overwrite")
    cmd = [sys.executable, "-m", "slimtune", "export", str(ckpt), "--format", "gguf", "--type", "f16", "--out", str(out), "--overwrite"]
    child = subprocess.run(cmd, capture_output=True, text=True)
    print((child.stdout + child.stderr).strip())
    if child.returncode:
        return
    try:
        import llama_cpp
    except ImportError:
        print("llama.cpp's reply: not shown, llama-cpp-python is not installed (`make test` or `pip install -e '.[dev]'` installs it)")
        return
    llm = llama_cpp.Llama(str(out), verbose=False, n_ctx=512)
    reply = []
    for token in llm.generate(ids, temp=0.0, top_k=1):
        if token == llm.token_eos() or len(reply) >= 24:
            break
        reply.append(token)
    text = tokenizer.decode(reply, skip_special_tokens=True)
    print(f"llama.cpp (greedy, {len(reply)} tokens): {text!r}")
    print(f"transformers (greedy):           {transformers_text!r}")


def _peft_reload(base_dir: Path, adapter_dir: Path, batch: dict, qlora_logits: torch.Tensor, dtype: torch.dtype) -> str:
    """PEFT's reload of the adapter on the original base (computing in ``dtype``), compared with the QLoRA logits."""
    try:
        from peft import PeftModel  # optional (a dev extra): the demo's reload check only
    except ImportError:
        return "peft is not installed: adapter reload skipped (pip install peft)"
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=dtype, local_files_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft calls a deprecated transformers helper
        peft_model = PeftModel.from_pretrained(base, str(adapter_dir))
    n = sum(1 for name, _ in peft_model.named_modules() if name.endswith("lora_A"))
    with torch.no_grad():
        logits = peft_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    diff = (qlora_logits - logits)[batch["attention_mask"].bool()].abs().max().item()
    return (
        f"reloaded adapter with peft.PeftModel.from_pretrained: {n} LoRA modules on the original base "
        f"(max |logit diff| vs the QLoRA model = {diff:.4f}: W instead of dequant(NF4(W)))"
    )
