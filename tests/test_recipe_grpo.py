"""The GRPO objective (recipes/objectives/grpo.py, run by the one loop of recipes/finetune.py) as a user runs
it, `slimtune finetune training.objective=grpo`: TRL's metric names in metrics.jsonl, eval figures and
completions.jsonl, a merged save's eval_reward_merged; a run SIGKILLed mid-run resumes to the uninterrupted
run's adapter bit for bit and samples the same completions (the generation batch of num_iterations = 2
carried in the checkpoint, the reference through the start adapters); a reward that raises stops the run
in one line (exit 2) with the newest checkpoint intact; 2 ranks under torchrun (FSDP2) sample the same
completions as one process and follow its losses."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slimtune.checkpoint.atomic import is_complete_checkpoint
from slimtune.cli import main
from slimtune.config import load_config
from slimtune.formats.peft import lora_key
from slimtune.lora import lora_modules
from slimtune.recipes.finetune import setup
from tests.conftest import ROOT

ADAPTER = "adapter/adapter_model.safetensors"
STEPS = 4
LOSS_RTOL = 1e-3  # 2 ranks vs 1 in bf16 (tests/test_dist_train.py's bound: each rank pads its own slice)
LOSS_SCALE = 1.0
"""GRPO's loss is a mean of per-token terms A * ratio (group-scaled advantages: |A| ~ 1) that nearly cancel
on-policy, so the loss itself can be near 0 while its bf16 error is the terms': compared within LOSS_RTOL of
max(|loss|, 1)."""


def addition_rows(n: int, seed: int = 0) -> list[dict]:
    """Prompt-only rows with an answer column: small sums, exact-match checkable."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 4), rng.randint(0, 4)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def token_mean(prompts, completions, completion_ids, **kwargs):
    """A reward that differs between a random model's samples (its mean token id, scaled): advantages are not all 0."""
    return [sum(ids) / (258.0 * max(1, len(ids))) for ids in completion_ids]


@pytest.fixture(scope="module")
def settings(tiny_base, tmp_path_factory) -> list[str]:
    """10 prompts, 2 held out: batch 2 prompts x 2 generations, 4 steps; mu = 2 and beta > 0; checkpoints at 1, 2, 3, 4."""
    data = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in addition_rows(10)))
    return [
        f"model.path={tiny_base}",
        "model.create_tiny=false",
        f"dataset.path={data}",
        "dataset.create_builtin=false",
        "dataset.eval_fraction=0.2",
        "training.objective=grpo",
        "training.batch_size=2",
        f"training.max_steps={STEPS}",
        "grpo.num_generations=2",
        "grpo.max_completion_length=4",
        "grpo.num_iterations=2",
        "grpo.beta=0.04",
        "grpo.reward_funcs=[exact_answer, length_penalty, tests.test_recipe_grpo:token_mean]",
        "grpo.eval_samples=2",
        "checkpoint.save_every_n_steps=1",
        "checkpoint.merged=final",
        "checkpoint.keep_last_n=null",
        "optimizer.lr=5e-3",
        "logging.progress_bar=false",
    ]


def command(out: Path, settings: list[str], *extra: str, nproc: int = 1) -> tuple[list[str], dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launch = ["--nproc", str(nproc)] if nproc > 1 else []
    return [sys.executable, "-m", "slimtune", "finetune", "--config", "tiny", *launch, f"output_dir={out}", *settings, *extra], env


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def completions(out: Path) -> dict[int, list]:
    """completions.jsonl by step (a killed run's steps appear again after its resume: the last ones count)."""
    by_step: dict[int, list] = {}
    for line in (out / "completions.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["step"], [])
        by_step[record["step"]] = [r for r in by_step[record["step"]] if r != record] + [record]
    return by_step


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, settings) -> Path:
    out = tmp_path_factory.mktemp("straight") / "run"
    assert main(["finetune", "--config", "tiny", f"output_dir={out}", *settings, "checkpoint.gguf=q8_0"]) == 0
    return out


def test_grpo_run_logs_trl_metrics_and_completions(straight_run):
    records = metrics(straight_run)
    assert [m["step"] for m in records] == list(range(1, STEPS + 1))
    names = ("reward", "reward_std", "rewards/exact_answer/mean", "rewards/length_penalty/std", "completions/mean_length")
    names += ("completions/clipped_ratio", "kl", "entropy", "clip_ratio/region_mean")
    for m in records:
        assert all(n in m for n in names), m
        assert -1.0 <= m["reward"] <= 2.0 and 0 < m["completions/mean_length"] <= 4 and m["rewards/token_mean/std"] > 0
        assert all(f"eval_{n}" in m for n in ("reward", "rewards/exact_answer/mean", "completions/mean_length")), m
    assert records[0]["kl"] == 0.0 and records[0]["clip_ratio/region_mean"] == 0.0  # step 1: the policy is the reference and the old policy
    assert records[1]["completions/mean_length"] == records[0]["completions/mean_length"]  # mu = 2: step 2 reuses step 1's batch
    assert records[1]["kl"] > 0  # the policy moved after step 1
    last = records[-1]
    assert abs(last["eval_reward_merged"] - last["eval_reward"]) <= 0.1, last  # the merge's one rounding flips few samples
    samples = completions(straight_run)
    assert sorted(samples) == list(range(1, STEPS + 1)) and all(len(v) == 2 for v in samples.values())
    assert {"prompt", "completion", "reward"} <= set(samples[STEPS][0])
    assert (straight_run / "model-q8_0.gguf").is_file()  # the GGUF export at the end, as SFT's


def test_the_reference_is_a_frozen_copy_of_model_adapter(straight_run, settings, tmp_path):
    """Started from an adapter (model.adapter) with beta > 0, the reference the objective keeps is that
    adapter's weights, bit for bit, and the model holds them too before its first step."""
    start = straight_run / f"step-{STEPS:06d}"
    cfg = load_config("tiny", [f"output_dir={tmp_path / 'run'}", *settings, f"model.adapter={start}"])
    run = setup(cfg)
    saved = load_file(str(start / ADAPTER))
    reference = run.objective.reference
    assert reference is not None and len(reference) == len(lora_modules(run.model))
    for name, (a, b) in reference.items():
        assert torch.equal(a, saved[lora_key(name, "lora_A")].to(a.dtype)) and torch.equal(b, saved[lora_key(name, "lora_B")].to(b.dtype))
        assert torch.equal(lora_modules(run.model)[name].lora_b.weight, b)


def test_sigkill_then_resume_samples_the_same_and_ends_bit_exact(straight_run, settings, tmp_path):
    """Killed once step 1's checkpoint is complete (mid-cycle of mu = 2: step 2 reuses step 1's generation
    batch, read back from the checkpoint), resumed in a new process: the same completions and metrics at
    every step and the same final adapter, bit for bit."""
    out = tmp_path / "run"
    cmd, env = command(out, settings)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 240
    while not is_complete_checkpoint(out / "step-000001") and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not is_complete_checkpoint(out / f"step-{STEPS:06d}")
    r = subprocess.run([*command(out, settings)[0], "resume=true"], capture_output=True, text=True, env=env, timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "resumed from step-00000" in r.stdout + r.stderr
    reference, resumed = metrics(straight_run), metrics(out)
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(reference, resumed, strict=True):
        for key in ("loss", "reward", "kl", "completions/mean_length", "rewards/length_penalty/mean", "eval_reward"):
            assert a.get(key) == b.get(key), (a["step"], key, a.get(key), b.get(key))
    assert completions(straight_run) == completions(out)
    ta, tb = load_file(str(straight_run / f"step-{STEPS:06d}" / ADAPTER)), load_file(str(out / f"step-{STEPS:06d}" / ADAPTER))
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_a_reward_that_raises_stops_in_one_line_and_keeps_the_checkpoint(settings, tmp_path, monkeypatch, capsys):
    (tmp_path / "flaky_reward.py").write_text(
        "calls = []\n"
        "def flaky(prompts, completions, completion_ids, answer, trainer_state=None, **kwargs):\n"
        "    calls.append(len(completions))\n"
        "    if len(calls) >= 2:  # from the second step's batch on\n"
        "        raise ValueError('cannot parse ' + repr(completions[0]))\n"
        "    return [0.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    extra = ["grpo.reward_funcs=[flaky_reward:flaky]", "grpo.num_iterations=1", "dataset.eval_fraction=0", "checkpoint.async=false"]
    assert main(["finetune", "--config", "tiny", f"output_dir={out}", *settings, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "reward function flaky raised at step 2 for " in err and "prompts.jsonl" in err and "ValueError: cannot parse" in err, err
    assert is_complete_checkpoint(out / "step-000001") and not (out / "step-000002").exists()
    sys.modules.pop("flaky_reward", None)


@pytest.mark.multiprocess
def test_two_ranks_sample_what_one_does_and_follow_its_losses(straight_run, settings, tmp_path):
    """torchrun / FSDP2 with 2 ranks (gloo): each rank samples and trains its prompt of every micro-batch
    (batch 2: one each) with both its generations, the rewards gathered for the advantages; each completion
    draws from its own generator, so the completions and rewards are the one-process run's exactly and the
    losses (mu = 2's stored old log-probabilities, beta > 0's reference through the start adapters) agree
    within LOSS_RTOL."""
    out = tmp_path / "two"
    cmd, env = command(out, settings, nproc=2)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    one, two = metrics(straight_run), metrics(out)
    assert [m["step"] for m in two] == list(range(1, STEPS + 1))
    for a, b in zip(one, two, strict=True):
        same = ("reward", "reward_std", "rewards/token_mean/mean", "completions/mean_length", "eval_reward", "eval_rewards/token_mean/mean")
        for key in same:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])  # the same completions, scored by the same functions
        for key in ("loss", "kl", "entropy"):
            assert abs(a[key] - b[key]) <= LOSS_RTOL * max(abs(a[key]), LOSS_SCALE), (a["step"], key, a[key], b[key])
    assert {k: [(r["prompt"], r["completion"]) for r in v] for k, v in completions(out).items()} == {
        k: [(r["prompt"], r["completion"]) for r in v] for k, v in completions(straight_run).items()
    }


# ---------------------------------------------------------------------------------------------------
# A real model: SmolLM2-135M-Instruct (tests/real_model.py) learns a required answer format

REAL_STEPS = 4
REAL_PROMPTS = 4  # per step, x REAL_GENERATIONS completions
REAL_GENERATIONS = 4
REAL_HELD_OUT = 8
REAL_LR = 3e-3
BARE_NUMBER = r"\s*\d+\s*"  # the required format: the completion is the number alone (then the model stops)
REAL_RISE = 0.5  # the held-out mean reward (0 to 2) must rise by at least this much from the base's (measured: +1.19)
MERGED_TOLERANCE = 0.1  # |merged - adapter form| held-out reward: 32 draws, each flipping moves the mean by 1/32 per function


def sum_rows(pairs: list[tuple[int, int]]) -> list[dict]:
    """Standard prompt-only rows "Question: What is a plus b?\\nAnswer:" with the sum as the answer column."""
    return [{"prompt": f"Question: What is {a} plus {b}?\nAnswer:", "answer": str(a + b)} for a, b in pairs]


@pytest.mark.slow
@pytest.mark.real_model
def test_real_model_learns_the_answer_format_and_the_merge_keeps_it(smollm2_dir, tmp_path):
    """GRPO from the base on single-digit sums (generated: 16 training prompts, 8 others held out), rewards
    the built-in format check (the completion is a bare number, BARE_NUMBER) and exact_answer (that number
    is the sum), 4 completions of at most 4 tokens per prompt, fp32 compute (the CPU's fast path). The
    held-out mean reward (the same seeded draws at every evaluation) rises by REAL_RISE or more from the
    base's (the NF4 base: the adapters start at B = 0) after REAL_STEPS steps, and the merged model's
    (round(W' + B A), sampled with the same seed) is within MERGED_TOLERANCE of the adapter form's.
    The recipe's own steps run here (setup, restore, train_step, evaluate) so the base is evaluated on the
    loaded model before the first step, without a second load. Measured on the loaded machine (2 cores),
    2026-12-06: 76 s wall at load average 5.4 (OMP_NUM_THREADS=2), 32 s at 2.3 (OMP_NUM_THREADS=1), both with
    held-out reward base 0.375 (format 0.312) -> 1.562 (format 1.000, exact 0.562), merged 1.562; step
    rewards 0.19, 1.13, 1.63, 1.63."""
    from slimtune.data import epoch_order, epoch_steps
    from slimtune.recipes.finetune import evaluate, train_step
    from slimtune.recipes.run_steps import restore
    from tests.real_model import finetune_overrides

    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(0).shuffle(pairs)
    paths = {"train": tmp_path / "train.jsonl", "eval": tmp_path / "eval.jsonl"}
    for name, rows in (("train", sum_rows(pairs[: REAL_STEPS * REAL_PROMPTS])), ("eval", sum_rows(pairs[-REAL_HELD_OUT:]))):
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = finetune_overrides(smollm2_dir, paths["train"], paths["eval"], tmp_path / "run", REAL_STEPS)
    overrides += [
        "dtype=fp32",  # torch's bf16 matrix products take a scalar path on a CPU without AVX-512
        "training.objective=grpo",
        f"training.batch_size={REAL_PROMPTS}",
        f"grpo.num_generations={REAL_GENERATIONS}",
        "grpo.max_completion_length=4",
        "grpo.reward_funcs=[format, exact_answer]",
        f"grpo.format_pattern={BARE_NUMBER}",
        f"optimizer.lr={REAL_LR}",
        "scheduler.warmup_steps=0",
    ]
    started = time.perf_counter()
    run = setup(load_config("tiny", overrides))
    restore(run)
    base = evaluate(run)
    steps = epoch_steps(epoch_order(len(run.inputs.data.train), run.cfg.seed, 0, True), REAL_PROMPTS, 1)
    trained = [train_step(run, batch)["reward"] for batch in steps[:REAL_STEPS]]
    final = evaluate(run, merged=True)
    print(
        f"\nreal-model GRPO, {REAL_STEPS} steps: {time.perf_counter() - started:.0f} s wall, load average {os.getloadavg()[0]:.1f}; "
        f"held-out reward: base {base['eval_reward']:.3f} (format {base['eval_rewards/format/mean']:.3f}), "
        f"after {final['eval_reward']:.3f} (format {final['eval_rewards/format/mean']:.3f}, exact "
        f"{final['eval_rewards/exact_answer/mean']:.3f}), merged {final['eval_reward_merged']:.3f}; step rewards {trained}"
    )
    assert len(run.inputs.data.eval) == REAL_HELD_OUT and len(run.inputs.data.train) == REAL_STEPS * REAL_PROMPTS
    assert final["eval_reward"] >= base["eval_reward"] + REAL_RISE, (base, final)
    assert abs(final["eval_reward_merged"] - final["eval_reward"]) <= MERGED_TOLERANCE, final
