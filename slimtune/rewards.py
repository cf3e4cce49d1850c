"""GRPO's reward functions as plain Python, with TRL's signature: ``f(prompts, completions, completion_ids,
**columns) -> list[float | None]``, one value per completion, the row's other columns (``answer`` ...)
as keyword lists; None leaves the function out for that completion (TRL's rule). A function written for
TRL's ``GRPOTrainer`` runs unchanged.

``grpo.reward_funcs`` names built-ins and/or ``module:function`` references (the module importable from
the working directory or an installed package); ``load_rewards`` resolves them, ``score`` calls them and
checks what comes back. The built-ins need no code:

- ``exact_answer``: 1.0 when ``grpo.answer_pattern``'s first group, found in the completion, equals the
  row's ``grpo.answer_column`` (both stripped), else 0.0;
- ``format``: 1.0 when the completion matches ``grpo.format_pattern`` (``re.fullmatch``, DOTALL), else 0.0;
- ``length_penalty``: -(completion tokens / grpo.max_completion_length), in [-1, 0].

A function that raises, returns the wrong number of values, or a NaN / inf / non-number stops the run
with one line naming the function, the step and the row (``SlimtuneError``, exit 2): nothing is written
after it, so the newest checkpoint stays the newest.

Example: ``table = score(load_rewards(RewardOptions(["exact_answer"])), batch, step=3)  # [completions, functions]``
"""

from __future__ import annotations

import importlib
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from slimtune.errors import SlimtuneError, first_line

BUILTINS = ("exact_answer", "format", "length_penalty")


@dataclass(frozen=True)
class RewardOptions:
    """The reward keys of the config's grpo section, as ``load_rewards`` takes them."""

    funcs: list[str] = field(default_factory=lambda: ["exact_answer"])
    weights: list[float] | None = None
    answer_pattern: str = r"(-?\d+(?:\.\d+)?)\s*$"
    answer_column: str = "answer"
    format_pattern: str = r".*"
    max_completion_length: int = 256


@dataclass(frozen=True)
class Reward:
    """One resolved reward function: its name in the metrics (``rewards/<name>/mean``), the callable and its weight."""

    name: str
    func: Callable
    weight: float


@dataclass(frozen=True)
class Scored:
    """What the reward functions are called with for one generation batch: the prompts, completions and
    completion token ids (one per completion, TRL's forms), the rows' other columns as lists, and each
    completion's row as the error lines name it (``train.jsonl: row 7``)."""

    prompts: list
    completions: list
    completion_ids: list[list[int]]
    columns: dict[str, list]
    rows: list[str]


def load_rewards(options: RewardOptions) -> list[Reward]:
    """The functions ``options.funcs`` names (built-ins, ``module:function``), weighted by
    ``options.weights`` (1 each when None); a bad name, module, pattern or weight count is one line.

    Example: ``[r.name for r in load_rewards(RewardOptions(["format", "my_rewards:short"]))]  # ['format', 'short']``"""
    if not options.funcs:
        raise SlimtuneError("grpo.reward_funcs is empty: name at least one reward function (a built-in or module:function)")
    weights = options.weights if options.weights is not None else [1.0] * len(options.funcs)
    if len(weights) != len(options.funcs):
        raise SlimtuneError(f"grpo.reward_weights has {len(weights)} value(s); grpo.reward_funcs names {len(options.funcs)} function(s)")
    return [Reward(*_resolve(spec, options), float(w)) for spec, w in zip(options.funcs, weights, strict=True)]


def score(rewards: list[Reward], scored: Scored, step: int) -> torch.Tensor:
    """[completions, functions] fp32: each function's rewards (NaN where it returned None), checked: a
    function that raises, returns the wrong count or a NaN / inf / non-number stops with one line.

    Example: ``table = score(rewards, scored, step=5); total = (table * weights).nansum(dim=1)``"""
    n = len(scored.completions)
    table = torch.full((n, len(rewards)), float("nan"), dtype=torch.float32)
    for j, reward in enumerate(rewards):
        values = _call(reward, scored, step)
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = f"{len(values)} value(s)" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
            raise SlimtuneError(
                f"reward function {reward.name} returned {got} for {n} completion(s) at step {step}; expected a list of {n}"
            )
        for i, v in enumerate(values):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise SlimtuneError(
                    f"reward function {reward.name} returned {v!r} at step {step} for {scored.rows[i]} (completion {i}); "
                    "expected a finite number or None"
                )
            table[i, j] = float(v)
    return table


def weights_of(rewards: list[Reward]) -> torch.Tensor:
    """[functions] fp32: the rewards' weights, as TRL's reward_weights."""
    return torch.tensor([r.weight for r in rewards], dtype=torch.float32)


def reward_means(table: torch.Tensor, rewards: list[Reward], prefix: str = "") -> dict[str, float]:
    """TRL's ``rewards/<name>/mean`` and ``/std`` (NaN-skipping, unbiased) of a ``score`` table.

    Example: ``record.update(reward_means(table, rewards))``"""
    out = {}
    for j, reward in enumerate(rewards):
        column = table[:, j]
        live = column[~torch.isnan(column)]
        out[f"{prefix}rewards/{reward.name}/mean"] = float(live.mean()) if len(live) else float("nan")
        out[f"{prefix}rewards/{reward.name}/std"] = float(live.std()) if len(live) > 1 else float("nan")
    return out


def completion_text(completion) -> str:
    """A completion's text: itself (standard), or its last message's content (conversational)."""
    if isinstance(completion, list):
        return str(completion[-1].get("content", "")) if completion else ""
    return str(completion)


# ---------------------------------------------------------------------------------------------------
# Built-ins and resolution


def exact_answer(prompts, completions, completion_ids, *, pattern: re.Pattern, column: str, **columns) -> list[float]:
    """1.0 where ``pattern``'s first group in the completion equals the row's ``column`` value, else 0.0."""
    if column not in columns:
        raise KeyError(f"the rows have no column {column!r} (grpo.answer_column)")
    out = []
    for completion, answer in zip(completions, columns[column], strict=True):
        found = pattern.search(completion_text(completion))
        got = (found.group(1) if found.groups() else found.group(0)).strip() if found else None
        out.append(1.0 if got is not None and got == str(answer).strip() else 0.0)
    return out


def format_reward(prompts, completions, completion_ids, *, pattern: re.Pattern, **columns) -> list[float]:
    """1.0 where the whole completion matches ``pattern``, else 0.0."""
    return [1.0 if pattern.fullmatch(completion_text(c)) else 0.0 for c in completions]


def length_penalty(prompts, completions, completion_ids, *, max_length: int, **columns) -> list[float]:
    """-(completion tokens / max_length): 0 for an empty completion, -1 for one cut at the limit."""
    return [-min(1.0, len(ids) / max_length) for ids in completion_ids]


def _resolve(spec: str, options: RewardOptions) -> tuple[str, Callable]:
    """(metric name, callable) of one grpo.reward_funcs entry."""
    if spec == "exact_answer":
        return spec, partial(exact_answer, pattern=_compile(options.answer_pattern, "grpo.answer_pattern"), column=options.answer_column)
    if spec == "format":
        return spec, partial(format_reward, pattern=_compile(options.format_pattern, "grpo.format_pattern", re.DOTALL))
    if spec == "length_penalty":
        return spec, partial(length_penalty, max_length=options.max_completion_length)
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise SlimtuneError(f"grpo.reward_funcs: {spec!r} is neither a built-in ({', '.join(BUILTINS)}) nor module:function")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's module
        raise SlimtuneError(f"grpo.reward_funcs: cannot import {module_name} for {spec}: {type(e).__name__}: {first_line(e)}") from None
    func = getattr(module, attr, None)
    if not callable(func):
        raise SlimtuneError(f"grpo.reward_funcs: module {module_name} ({module.__file__}) has no function {attr}")
    return getattr(func, "__name__", attr), func


def _compile(pattern: str, key: str, flags: int = 0) -> re.Pattern:
    try:
        return re.compile(pattern, flags)
    except re.error as e:
        raise SlimtuneError(f"{key}: {pattern!r} is not a regular expression ({e})") from None


def _call(reward: Reward, scored: Scored, step: int):
    """The function's values for the whole batch; when it raises, the first row it raises on alone names the row."""
    try:
        return reward.func(prompts=scored.prompts, completions=scored.completions, completion_ids=scored.completion_ids, **scored.columns)
    except Exception as e:  # noqa: BLE001 - a user's function: its failure is one line
        where = _failing_row(reward, scored)
        raise SlimtuneError(f"reward function {reward.name} raised at step {step}{where}: {type(e).__name__}: {first_line(e)}") from None


def _failing_row(reward: Reward, scored: Scored) -> str:
    """' for <row> (completion i)' of the first completion the function raises on by itself, else the
    batch's rows (a function that raises only on the whole batch)."""
    for i in range(len(scored.completions)):
        one = {k: v[i : i + 1] for k, v in scored.columns.items()}
        try:
            reward.func(
                prompts=scored.prompts[i : i + 1],
                completions=scored.completions[i : i + 1],
                completion_ids=scored.completion_ids[i : i + 1],
                **one,
            )
        except Exception:  # noqa: BLE001
            return f" for {scored.rows[i]} (completion {i})"
    rows = scored.rows
    return f" on the batch of {len(rows)} completions ({rows[0]} ... {rows[-1]})" if rows else ""
