"""GRPO on the same QLoRA model (``training.objective`` grpo): the online ``Objective`` the one loop of
``recipes/finetune.py`` runs, beside SFT's and the preference objectives'.

Each optimizer step (``prepare_step``) takes the step's prompts (training.batch_size prompts per
micro-batch), samples ``grpo.num_generations`` completions of each from the current policy
(``rollout.sample``: the model's own forward with a KV cache, chunked by grpo.generation_batch_tokens,
dropout off, drawn from a generator seeded by the run's seed and the step, so a resumed run samples what
the uninterrupted one did), scores them with the reward functions (``rewards.score``: TRL's signature,
weighted, every value checked), computes the group-relative advantages and, when they are needed, the
old log-probabilities (num_iterations > 1) and the reference's (beta > 0). The loop's micro-batch loop
then runs ``micro_batch_loss``: ``grpo_loss.policy_loss`` over each micro-batch's completions.

The reference is the model as loaded: the NF4 base with fresh adapters (B = 0: exactly the base) or
``model.adapter``'s, kept as a copy of the adapters (``lora.adapter_weights``, taken before training and
before a resume restores the trained ones) and swapped in for one no-grad forward per step
(``lora.swapped_adapters``): no second copy of the frozen weights. With beta 0 no reference pass runs.

With num_iterations mu > 1 one generation batch serves mu optimizer steps (TRL's mu; the prompts of the
steps in between are not sampled, where TRL repeats each batch mu times), against the log-probabilities
stored at generation time; that batch also goes into each checkpoint's recipe state, so a resume between
two of its steps continues with it.

Evaluation samples each held-out prompt's completions from a generator seeded by the run's seed alone
(the same draws at every evaluation, and for the merged model: ``eval_reward_merged``), reports TRL's
figures ``eval_``-prefixed and appends grpo.eval_samples of them to ``completions.jsonl`` in output_dir.
One process only for now: under torchrun the set-up refuses in one line.

Example: ``run_finetune(load_config("llama3.2-1b_grpo", ["model.path=...", "dataset.path=prompts.jsonl"]))``
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

from slimtune.data import PromptRow, parse_json
from slimtune.errors import SlimtuneError
from slimtune.grpo_loss import GRPOLoss, StepCounts, completion_batch, completion_logps, group_advantages, grpo_metric_means, policy_loss
from slimtune.lora import adapter_weights, qlora_linears, swapped_adapters
from slimtune.recipes.objective import Objective, StepBatches
from slimtune.recipes.run import Run
from slimtune.rewards import RewardOptions, Scored, load_rewards, reward_means, score, weights_of
from slimtune.rollout import SamplingSpec, sample, stop_ids_of

log = logging.getLogger(__name__)

ROLLOUT_KEY = "grpo_rollout"  # in recipe_state.pt when num_iterations > 1: the generation batch being reused
COMPLETIONS_FILE = "completions.jsonl"
EVAL_SEED_OFFSET = 7_777_777


class GRPOObjective(Objective):
    """GRPO and its loss family on prompt-only rows, TRL 1.16's loss and metric names (``grpo.*``)."""

    dropped = "bad prompt row(s) dropped (grpo.bad_rows=drop)"
    merged_metric = "eval_reward"

    def __init__(self, cfg):
        super().__init__(cfg)
        g = cfg.grpo
        self.loss_of = GRPOLoss(
            g.loss_type,
            g.importance_sampling_level,
            g.epsilon,
            g.epsilon_high,
            g.beta,
            g.max_completion_length,
            g.temperature,
            g.use_bias_correction_kl,
        )
        options = RewardOptions(
            list(g.reward_funcs), g.reward_weights, g.answer_pattern, g.answer_column, g.format_pattern, g.max_completion_length
        )
        self.rewards = load_rewards(options)  # a bad name or module fails before the data and model are read
        self.spec = SamplingSpec(g.max_completion_length, g.temperature, g.top_p, g.top_k)
        self.reference: dict | None = None
        self.rollout: dict | None = None

    def setup(self, run: Run) -> None:
        """The stop tokens, the reference adapters' copy (beta > 0), a reused generation batch on resume, one line."""
        if run.where.ranks.distributed:
            raise SlimtuneError("training.objective=grpo runs on one process for now; run it without torchrun / --nproc")
        g = self.cfg.grpo
        stops = stop_ids_of(run.inputs.tokenizer, _generation_eos(run.inputs.base.path))
        if not stops:
            raise SlimtuneError(f"{run.inputs.base.path}: the tokenizer has no eos token and generation_config.json none: no stop token")
        self.spec = SamplingSpec(
            g.max_completion_length, g.temperature, g.top_p, g.top_k, stops, run.inputs.pad_id, g.generation_batch_tokens
        )
        if self.loss_of.beta != 0.0:
            self.reference = adapter_weights(run.model)  # the model as loaded: restore() has not put the trained adapters in yet
        if run.resume is not None and ROLLOUT_KEY in run.resume.state:
            self.rollout = run.resume.state[ROLLOUT_KEY]
        data = run.inputs.data
        log.info(
            f"grpo: {g.loss_type}, {len(data.train)} prompts x {g.num_generations} generations"
            + (f", {len(data.eval)} held out" if data.eval else "")
            + f", rewards {', '.join(r.name for r in self.rewards)}, stop tokens {list(stops)}, {run.span.total_steps} steps"
        )

    def collate(self, run: Run, rows: list, indices: list[int]) -> dict[str, torch.Tensor]:
        """The prompts of ``rows[indices]``, left-padded (what generation starts from)."""
        width = max(len(rows[i].prompt_ids) for i in indices)
        ids = torch.full((len(indices), width), run.inputs.pad_id, dtype=torch.long)
        mask = torch.zeros((len(indices), width), dtype=torch.long)
        for r, i in enumerate(indices):
            n = len(rows[i].prompt_ids)
            ids[r, width - n :], mask[r, width - n :] = rows[i].prompt_ids.long(), 1
        return {"input_ids": ids, "attention_mask": mask}

    def prepare_step(self, run: Run, batch: list[list[int]]) -> StepBatches:
        """A new generation batch every num_iterations steps (this step's prompts), else the stored one."""
        step_no, mu = run.at.global_step + 1, self.cfg.grpo.num_iterations
        first = step_no - (step_no - 1) % mu  # the step that generated this cycle's batch
        if self.rollout is None or self.rollout["step"] != first:
            self.rollout = self._generate(run, batch, step_no)
        if mu > 1:
            run.extra_state[ROLLOUT_KEY] = self.rollout
        r = self.rollout
        return StepBatches(r["micro_batches"], r["tokens"], {"counts": StepCounts(**r["counts"]), "metrics": r["metrics"]})

    def micro_batch_loss(self, model: nn.Module, inputs: dict, step: StepBatches) -> tuple[torch.Tensor, torch.Tensor]:
        logps, entropy = completion_logps(_forward(model, inputs), inputs["labels"], self.loss_of.temperature)
        parts = {**inputs, "entropy": entropy}
        return policy_loss(logps, parts, self.loss_of, step.counts["counts"])

    def step_metrics(self, sums: torch.Tensor, step: StepBatches) -> dict:
        """TRL's kl, entropy and clip ratios over the step's completions, then the generation's reward figures."""
        return {**grpo_metric_means(sums, self.loss_of), **step.counts["metrics"]}

    def evaluate(self, run: Run) -> dict:
        """The held-out prompts' completions (the same draws every time) scored: ``eval_reward`` ...; a few to completions.jsonl."""
        rows = run.inputs.data.eval
        g = self.cfg.grpo
        generator = torch.Generator(run.where.device).manual_seed(self.cfg.seed + EVAL_SEED_OFFSET)
        scored, completions, table, _ = self._sample_and_score(run, rows, generator, step=run.at.global_step)
        rewards = (table * weights_of(self.rewards)).nansum(dim=1)
        rewards[torch.isnan(table).all(dim=1)] = float("nan")
        adv = group_advantages(rewards, g.num_generations, g.scale_rewards)
        out = {"eval_reward": adv.reward, "eval_reward_std": adv.reward_std, **reward_means(table, self.rewards, prefix="eval_")}
        out.update(_length_figures(completions.ids, completions.truncated, prefix="eval_"))
        merged = any(m.merged_weight is not None for m in qlora_linears(run.model).values())
        if run.where.ranks.is_coordinator and g.eval_samples and not merged:
            _append_samples(run, scored, rewards, g.eval_samples)
        return out

    def figures(self, run: Run) -> dict:
        """The step's mean reward and the last eval's."""
        shown = {"reward": f"{run.record['reward']:.3f}"}
        if run.last_eval and "eval_reward" in run.last_eval:
            shown["eval_reward"] = f"{run.last_eval['eval_reward']:.3f}"
        return shown

    # -----------------------------------------------------------------------------------------------

    def _sample_and_score(self, run: Run, rows: list[PromptRow], generator: torch.Generator, step: int):
        """Each row's num_generations completions sampled and scored: (Scored, Completions, reward table, seconds)."""
        g = self.cfg.grpo
        started = time.perf_counter()
        prompts = [row.prompt_ids for row in rows for _ in range(g.num_generations)]
        completions = sample(run.model, prompts, self.spec, generator)
        seconds = time.perf_counter() - started
        tok = run.inputs.tokenizer
        texts = tok.batch_decode(completions.ids, skip_special_tokens=True)
        repeated = [row for row in rows for _ in range(g.num_generations)]
        conversational = bool(rows) and rows[0].shape == "conversational"
        shown = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        keys = sorted({k for row in rows for k in row.columns})
        columns = {k: [row.columns.get(k) for row in repeated] for k in keys}
        scored = Scored([row.prompt for row in repeated], shown, completions.ids, columns, [row.where for row in repeated])
        return scored, completions, score(self.rewards, scored, step), seconds

    def _generate(self, run: Run, batch: list[list[int]], step_no: int) -> dict:
        """This step's generation batch: completions, rewards, advantages, old and reference log-probabilities,
        as plain containers (it may go into a checkpoint's recipe state)."""
        g, rows = self.cfg.grpo, run.inputs.data.train
        prompt_rows = [rows[i] for mb in batch for i in mb]
        generator = torch.Generator(run.where.device).manual_seed(self.cfg.seed * 1_000_003 + step_no)
        scored, completions, table, seconds = self._sample_and_score(run, prompt_rows, generator, step_no)
        rewards = (table * weights_of(self.rewards)).nansum(dim=1)
        rewards[torch.isnan(table).all(dim=1)] = float("nan")  # no function scored it: TRL leaves it out
        adv = group_advantages(rewards, g.num_generations, g.scale_rewards)
        masked = [t and g.mask_truncated_completions for t in completions.truncated]
        micro_batches, start = [], 0
        for mb in batch:
            end = start + len(mb) * g.num_generations
            prompts = [rows[i].prompt_ids for i in mb for _ in range(g.num_generations)]
            mbatch = completion_batch(prompts, completions.ids[start:end], masked[start:end], run.inputs.pad_id)
            mbatch["advantages"] = adv.advantages[start:end].clone()
            micro_batches.append(self._stored_logps(run, mbatch))
            start = end
        trained = sum(int((m["labels"] != -100).sum()) for m in micro_batches)
        metrics = {"reward": adv.reward, "reward_std": adv.reward_std, "frac_reward_zero_std": adv.frac_reward_zero_std}
        metrics.update(reward_means(table, self.rewards))
        metrics.update(_length_figures(completions.ids, completions.truncated))
        metrics["generation_tokens_per_s"] = completions.tokens / max(seconds, 1e-9)
        tokens = sum(int(m["attention_mask"].sum()) for m in micro_batches)
        counts = {"sequences": len(completions.ids), "tokens": trained, "micro_batches": len(batch)}
        return {"step": step_no, "micro_batches": micro_batches, "tokens": tokens, "counts": counts, "metrics": metrics}

    def _stored_logps(self, run: Run, mbatch: dict) -> dict:
        """The micro-batch with the old log-probabilities (num_iterations > 1) and the reference's (beta > 0),
        each one no-grad forward of the current model as it trains (TRL's), the reference through its adapters."""
        temperature = self.loss_of.temperature
        device = run.where.device
        inputs = {k: v.to(device) for k, v in mbatch.items() if k in ("input_ids", "attention_mask")}
        with torch.no_grad():
            if self.cfg.grpo.num_iterations > 1:
                mbatch["old_logps"] = completion_logps(_forward(run.model, inputs), mbatch["labels"], temperature)[0].cpu()
            if self.reference is not None:
                with swapped_adapters(run.model, self.reference):
                    mbatch["ref_logps"] = completion_logps(_forward(run.model, inputs), mbatch["labels"], temperature)[0].cpu()
        return mbatch


def _forward(model: nn.Module, inputs: dict) -> torch.Tensor:
    """The logits of prompt + completion rows, as TRL's forward makes them (the attention mask, no cache)."""
    return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False).logits


def _generation_eos(base: Path) -> int | list[int] | None:
    """The base's generation_config.json eos_token_id (an id or a list), or None."""
    path = Path(base) / "generation_config.json"
    if not path.is_file():
        return None
    try:
        data = parse_json(path.read_bytes(), str(path))
    except OSError as e:
        raise SlimtuneError(f"{path}: cannot read the stop tokens ({e.strerror})") from None
    eos = data.get("eos_token_id") if isinstance(data, dict) else None
    ok = isinstance(eos, int) or (isinstance(eos, list) and all(isinstance(i, int) for i in eos))
    if eos is not None and not ok:
        raise SlimtuneError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return eos


def _length_figures(ids: list[list[int]], truncated: list[bool], prefix: str = "") -> dict:
    """TRL's completions/* figures: mean, min and max length, and the share cut at max_completion_length."""
    lengths = [len(i) for i in ids] or [0]
    return {
        f"{prefix}completions/mean_length": sum(lengths) / len(lengths),
        f"{prefix}completions/min_length": float(min(lengths)),
        f"{prefix}completions/max_length": float(max(lengths)),
        f"{prefix}completions/clipped_ratio": sum(truncated) / max(1, len(truncated)),
    }


def _append_samples(run: Run, scored: Scored, rewards: torch.Tensor, n: int) -> None:
    """The first ``n`` held-out completions (prompt, completion, reward) appended to completions.jsonl, fsynced."""
    path = run.manager.out / COMPLETIONS_FILE
    lines = []
    for i in range(min(n, len(scored.completions))):
        prompt, completion = scored.prompts[i], scored.completions[i]
        record = {"step": run.at.global_step, "prompt": prompt, "completion": completion, "reward": float(rewards[i])}
        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(lines))
        f.flush()
        os.fsync(f.fileno())
