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
Under torchrun (FSDP2) each rank samples, scores and trains its contiguous slice of every micro-batch's
prompts, each with all its num_generations completions (a group is never split); the reward tables are
gathered, so the advantages, rewards and length figures are the whole batch's, as in one process. Each
completion draws from its own generator (``rollout.row_generators``: the run's seed, the step and its
place in the batch), so 2 ranks sample what one process samples and follow its curve. A rank whose slice
of a micro-batch is empty trains one masked filler row (FSDP2 needs every rank in every forward).

Example: ``run_finetune(load_config("llama3.2-1b_grpo", ["model.path=...", "dataset.path=prompts.jsonl"]))``
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from slimtune.data import PromptRow, parse_json
from slimtune.distributed import split_rows
from slimtune.errors import SlimtuneError
from slimtune.grpo_loss import GRPOLoss, StepCounts, completion_batch, completion_logps, group_advantages, grpo_metric_means, policy_loss
from slimtune.lora import adapter_weights, qlora_linears, swapped_adapters
from slimtune.recipes.objective import Objective, StepBatches
from slimtune.recipes.run import Run
from slimtune.rewards import RewardOptions, Scored, load_rewards, reward_means, score, weights_of
from slimtune.rollout import SamplingSpec, row_generators, sample, stop_ids_of

log = logging.getLogger(__name__)

ROLLOUT_KEY = "grpo_rollout"  # in recipe_state.pt when num_iterations > 1: each rank's generation batch being reused
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
            self.rollout = _resumed_rollout(run, run.resume.state[ROLLOUT_KEY], g.num_iterations)
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
            if mu > 1:  # every rank's, for the checkpoints of this cycle (the coordinator writes the recipe state)
                run.extra_state[ROLLOUT_KEY] = run.where.ranks.gather(self.rollout, "the generation batch")
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
        rows, g, ranks = run.inputs.data.eval, self.cfg.grpo, run.where.ranks
        start, end = split_rows(len(rows), ranks.world_size)[ranks.rank]
        shown = g.eval_samples * ranks.is_coordinator  # the coordinator writes the first ones; every rank sends its share
        seed, step = self.cfg.seed + EVAL_SEED_OFFSET, run.at.global_step
        batch = self._sample_and_score(run, rows[start:end], list(range(start, end)), seed, step, shown=g.eval_samples)
        rewards = self._rewards(batch.table)
        adv = group_advantages(rewards, g.num_generations, g.scale_rewards)
        out = {"eval_reward": adv.reward, "eval_reward_std": adv.reward_std, **reward_means(batch.table, self.rewards, prefix="eval_")}
        out.update(_length_figures(batch.lengths, batch.truncated, prefix="eval_"))
        merged = any(m.merged_weight is not None for m in qlora_linears(run.model).values())
        if shown and not merged:
            _append_samples(run, batch.shown, rewards)
        return out

    def figures(self, run: Run) -> dict:
        """The step's mean reward and the last eval's."""
        shown = {"reward": f"{run.record['reward']:.3f}"}
        if run.last_eval and "eval_reward" in run.last_eval:
            shown["eval_reward"] = f"{run.last_eval['eval_reward']:.3f}"
        return shown

    # -----------------------------------------------------------------------------------------------

    def _sample_and_score(self, run: Run, rows: list[PromptRow], positions: list[int], seed: int, step: int, shown: int = 0) -> _Sampled:
        """This rank's ``rows`` (at prompt ``positions`` of the batch over every rank), num_generations
        completions each, sampled (completion j from ``row_generators(seed, j, 1)``) and scored (errors name
        ``step``); the reward tables, lengths and the first ``shown`` (prompt, completion) pairs gathered
        from every rank, in the batch's order."""
        g, ranks = self.cfg.grpo, run.where.ranks
        started = time.perf_counter()
        mine = [p * g.num_generations + k for p in positions for k in range(g.num_generations)]
        prompts = [row.prompt_ids for row in rows for _ in range(g.num_generations)]
        generators = [gen for j in mine for gen in row_generators(seed, j, 1, run.where.device)]
        completions = sample(run.model, prompts, self.spec, generators, ranks)
        seconds = time.perf_counter() - started
        texts = run.inputs.tokenizer.batch_decode(completions.ids, skip_special_tokens=True)
        repeated = [row for row in rows for _ in range(g.num_generations)]
        conversational = bool(rows) and rows[0].shape == "conversational"
        said = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        keys = sorted({k for row in rows for k in row.columns})
        columns = {k: [row.columns.get(k) for row in repeated] for k in keys}
        scored = Scored([row.prompt for row in repeated], said, completions.ids, columns, [row.where for row in repeated])
        table = score(self.rewards, scored, step) if rows else torch.zeros((0, len(self.rewards)))
        lengths = [len(i) for i in completions.ids]
        first = [(j, scored.prompts[i], scored.completions[i]) for i, j in enumerate(mine) if j < shown]
        parts = ranks.gather((mine, table, lengths, completions.truncated, first), "the rewards")
        size = 1 + max((j for part in parts for j in part[0]), default=-1)  # the last prompt is on some rank
        out = _Sampled(torch.full((size, len(self.rewards)), float("nan")), [0] * size, [False] * size, mine, completions.ids)
        out.seconds = seconds
        for indices, part, counts, cut, pairs in parts:
            out.table[indices] = part.float()
            for j, n, c in zip(indices, counts, cut, strict=True):
                out.lengths[j], out.truncated[j] = n, c
            out.shown += pairs
        out.shown.sort(key=lambda x: x[0])
        return out

    def _rewards(self, table: torch.Tensor) -> torch.Tensor:
        """Each completion's weighted reward; NaN where no function scored it (TRL leaves it out)."""
        rewards = (table * weights_of(self.rewards)).nansum(dim=1)
        rewards[torch.isnan(table).all(dim=1)] = float("nan")
        return rewards

    def _generate(self, run: Run, batch: list[list[int]], step_no: int) -> dict:
        """This step's generation batch (this rank's micro-batches): completions, advantages over the whole
        batch, old and reference log-probabilities, as plain containers (it may go into a checkpoint's
        recipe state); the counts and figures are every rank's."""
        g, rows, ranks, pad = self.cfg.grpo, run.inputs.data.train, run.where.ranks, run.inputs.pad_id
        flat = [i for mb in batch for i in mb]
        spans, offset = [], 0  # this rank's prompt positions in each micro-batch
        for mb in batch:
            start, end = split_rows(len(mb), ranks.world_size)[ranks.rank]
            spans.append(range(offset + start, offset + end))
            offset += len(mb)
        positions = [p for span in spans for p in span]
        sampled = self._sample_and_score(run, [rows[flat[p]] for p in positions], positions, self.cfg.seed * 1_000_003 + step_no, step_no)
        adv = group_advantages(self._rewards(sampled.table), g.num_generations, g.scale_rewards)
        masked = [t and g.mask_truncated_completions for t in sampled.truncated]
        own = dict(zip(sampled.mine, sampled.ids, strict=True))
        micro_batches = []
        for span, mb in zip(spans, batch, strict=True):
            done = [p * g.num_generations + k for p in span for k in range(g.num_generations)]
            if done:
                prompts = [rows[flat[j // g.num_generations]].prompt_ids for j in done]
                mbatch = completion_batch(prompts, [own[j] for j in done], [masked[j] for j in done], pad)
                mbatch["advantages"] = adv.advantages[done].clone()
            else:  # no prompt of this micro-batch on this rank: one masked row that adds nothing
                mbatch = completion_batch([rows[mb[0]].prompt_ids], [[pad]], [True], pad)
                mbatch.update(advantages=torch.zeros(1), live=torch.zeros(1))
            micro_batches.append(self._stored_logps(run, mbatch))
        trained = sum(n for n, m in zip(sampled.lengths, masked, strict=True) if not m)
        prompt_tokens = sum(len(rows[i].prompt_ids) for i in flat) * g.num_generations
        metrics = {"reward": adv.reward, "reward_std": adv.reward_std, "frac_reward_zero_std": adv.frac_reward_zero_std}
        metrics.update(reward_means(sampled.table, self.rewards))
        metrics.update(_length_figures(sampled.lengths, sampled.truncated))
        metrics["generation_tokens_per_s"] = sum(sampled.lengths) / max(sampled.seconds, 1e-9)
        counts = {"sequences": len(sampled.lengths), "tokens": trained, "micro_batches": len(batch)}
        return {"step": step_no, "micro_batches": micro_batches, "tokens": prompt_tokens + trained, "counts": counts, "metrics": metrics}

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


def _length_figures(lengths: list[int], truncated: list[bool], prefix: str = "") -> dict:
    """TRL's completions/* figures: mean, min and max length, and the share cut at max_completion_length."""
    lengths = lengths or [0]
    return {
        f"{prefix}completions/mean_length": sum(lengths) / len(lengths),
        f"{prefix}completions/min_length": float(min(lengths)),
        f"{prefix}completions/max_length": float(max(lengths)),
        f"{prefix}completions/clipped_ratio": sum(truncated) / max(1, len(truncated)),
    }


def _append_samples(run: Run, shown: list[tuple], rewards: torch.Tensor) -> None:
    """The first held-out completions ((index, prompt, completion) with their rewards) appended to
    completions.jsonl, fsynced."""
    path = run.manager.out / COMPLETIONS_FILE
    lines = []
    for j, prompt, completion in shown:
        record = {"step": run.at.global_step, "prompt": prompt, "completion": completion, "reward": float(rewards[j])}
        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(lines))
        f.flush()
        os.fsync(f.fileno())


def _resumed_rollout(run: Run, saved: list[dict] | dict, mu: int) -> dict | None:
    """This rank's generation batch from the checkpoint's (one per rank; a lone dict: one process's), or
    None when the run resumes past its cycle; a cycle cut midway continues only on the number of ranks
    that sampled it."""
    saved = [saved] if isinstance(saved, dict) else saved
    step = int(run.resume.state.get("global_step", 0))
    if len(saved) == run.where.ranks.world_size:
        return saved[run.where.ranks.rank]
    if step + 1 < saved[0]["step"] + mu:
        raise SlimtuneError(
            f"{run.resume.path}: a grpo.num_iterations cycle sampled on {len(saved)} rank(s) is unfinished at step {step}; "
            f"resume it on {len(saved)} rank(s) or from a checkpoint at a cycle's end"
        )
    return None


@dataclass
class _Sampled:
    """A generation batch over every rank (the batch's order: each prompt's completions adjacent): the
    reward table, lengths and truncation flags of every completion, this rank's completions (global
    indices ``mine``, token ids ``ids``), the first eval samples (index, prompt, completion), seconds."""

    table: torch.Tensor
    lengths: list[int]
    truncated: list[bool]
    mine: list[int]
    ids: list[list[int]]
    shown: list[tuple] = field(default_factory=list)
    seconds: float = 0.0
