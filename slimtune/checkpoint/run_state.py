"""The state a fine-tuning checkpoint carries, and every rule resume applies to it: one module, so a
second recipe writes and checks the same state.

- ``recipe_state``: the run's facts (``recipe_state.pt``: format, step, config, data hash, example count,
  world size), checked before anything is loaded; plain containers, so it loads with
  ``torch.load(weights_only=True)``. Paths under output_dir are stored relative to it (``portable_config``).
- ``training_state``: what the next step depends on (adapters, optimizer, scheduler, loss scaler, data
  position, each rank's RNG), the tree ``checkpoint/train_state.py`` writes through DCP.
- The checks: ``state_problem`` (a recipe state this version reads), ``check_resumable`` (keys that must not
  change on resume; the others' changes logged), ``check_data`` (the same data, tokenized alike);
  ``restore_training`` then loads the training state into the run's model and optimizer.

Example::

    check_resumable(cfg, point)                      # before the data is read
    check_data(point, data)                          # before the model is loaded
    step, position = restore_training(point, model, optim, cfg, ranks)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from slimtune.checkpoint.train_state import load_train_state, rng_state, seed_everything, set_rng_state
from slimtune.config import DATA, KEYS, MODEL, PATH, PLACEHOLDER, Config
from slimtune.distributed import Ranks
from slimtune.errors import SlimtuneError

log = logging.getLogger(__name__)

STATE_FORMAT = "slimtune-recipe-state/2"


@dataclass(frozen=True)
class ResumePoint:
    """The newest complete checkpoint of a run and the recipe state saved in it."""

    path: Path
    state: dict


@dataclass
class Optimization:
    """What trains the adapters beside the model: AdamW, its schedule (``lr_factor`` of the step, the
    scheduler's lambda) and the loss scaler (enabled for fp16 only)."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    lr_factor: Callable[[int], float]


def portable_config(values: dict) -> dict:
    """Config values with paths under output_dir written as ``{output_dir}/...``: what a checkpoint stores
    and what resume compares, so a run directory that was moved still resumes.

    Example: ``portable_config({"output_dir": "/r", "model.path": "/r/base"})["model.path"] == "{output_dir}/base"``"""
    root = values.get("output_dir")
    if not root:
        return dict(values)
    portable = {}
    for k, v in values.items():
        key = KEYS.get(k)
        if key is not None and key.kind in (PATH, MODEL, DATA) and isinstance(v, str):
            v = v.replace(PLACEHOLDER, root)
            if Path(v).is_relative_to(root):
                v = str(PLACEHOLDER / Path(v).relative_to(root))
        portable[k] = v
    return portable


def recipe_state(cfg: Config, global_step: int, dataset_sha: str, num_examples: int, total_steps: int, ranks: Ranks) -> dict:
    """The run's facts resume checks before anything is loaded: plain containers only, so it loads with
    ``torch.load(weights_only=True)``. The training state itself is ``training_state``'s.

    Example: ``state = recipe_state(cfg, 10, data.sha256, len(data.train), 100, ranks)``"""
    return {
        "format": STATE_FORMAT,
        "global_step": global_step,
        "total_steps": total_steps,
        "world_size": ranks.world_size,
        "config": dict(cfg.values),
        "dataset_sha256": dataset_sha,
        "num_examples": num_examples,
    }


def training_state(model: nn.Module, optim: Optimization, position: tuple[int, int], ranks: Ranks) -> dict:
    """What the next step depends on beyond the run's facts, laid out for torch.distributed.checkpoint:
    the adapters and the optimizer state by parameter name (DTensor shards under FSDP2, whole tensors in
    one process: DCP reshards between the two), scheduler, loss scaler, the data position (epoch, 0-based,
    and step within it) and this rank's RNG states under its rank. Built fresh for a save; for a resume
    it is the template DCP fills in place.

    Example: ``manager.save(model, step, state, options, training_state(model, optim, (0, 5), ranks), ranks)``"""
    adapters = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    return {
        "adapter": adapters,
        "optimizer": get_optimizer_state_dict(model, optim.optimizer),
        "scheduler": optim.scheduler.state_dict(),
        "grad_scaler": optim.scaler.state_dict(),
        "position": {"epoch": position[0], "step_in_epoch": position[1]},
        "rng": {str(ranks.rank): rng_state()},
    }


def state_problem(state: object) -> str | None:
    """Why a loaded ``recipe_state.pt`` cannot be resumed from (None if it can).

    Example: ``state_problem({"format": "slimtune-recipe-state/1"}) == "is not slimtune-recipe-state/2"``"""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        return f"is not {STATE_FORMAT}"
    return None


def check_resumable(cfg: Config, point: ResumePoint) -> None:
    """Fields that define the model, the data order or the step arithmetic must match the checkpoint's;
    the others may change (each change is logged).

    Example: ``check_resumable(load_config("tiny", ["resume=true"]), point)``"""
    then, now = portable_config(point.state["config"]), portable_config(cfg.values)
    fixed = [k for k, key in KEYS.items() if key.fixed and k in then and then[k] != now[k]]
    if fixed:
        changes = "; ".join(f"{k} is {now[k]!r}, the checkpoint has {then[k]!r}" for k in fixed)
        raise SlimtuneError(f"cannot resume from {point.path}: {changes} (these must not change on resume)")
    for k, key in KEYS.items():
        if not key.fixed and k not in ("resume", "overwrite") and k in then and then[k] != now[k]:
            log.info(f"resume: {k} changed from {then[k]!r} to {now[k]!r} (allowed)")


def check_data(point: ResumePoint, data) -> None:
    """The data read now must be the checkpoint's: the same file contents, tokenized to as many examples.

    Example: ``check_data(point, load_data(spec, tokenizer))``"""
    saved = point.state
    if saved["dataset_sha256"] != data.sha256:
        raise SlimtuneError(f"cannot resume from {point.path}: the content of the data files changed since the checkpoint was taken")
    if saved["num_examples"] != len(data.train):
        raise SlimtuneError(
            f"cannot resume from {point.path}: the data tokenizes to {len(data.train)} examples now, {saved['num_examples']} then"
        )


def restore_training(point: ResumePoint, model: nn.Module, optim: Optimization, cfg: Config, ranks: Ranks) -> tuple[int, tuple[int, int]]:
    """The checkpoint's training state into the run: adapters and optimizer state in place (resharded by
    DCP to this number of ranks), scheduler and loss scaler through their ``load_state_dict``, and this
    rank's RNG streams last. The learning rate and weight decay may change on resume: they come from the
    config (the scheduler's base rates replaced before its state is loaded). Returns the step and the
    data position (epoch, step within it) to continue from.

    Example: ``global_step, (epoch, step_in_epoch) = restore_training(point, model, optim, cfg, ranks)``"""
    optimizer, scheduler = optim.optimizer, optim.scheduler
    restored = load_train_state(point.path, training_state(model, optim, (0, 0), ranks))  # in place, resharded
    set_optimizer_state_dict(model, optimizer, restored["optimizer"])
    scheduler.load_state_dict({**restored["scheduler"], "base_lrs": [cfg.optimizer.lr] * len(optimizer.param_groups)})
    for group in optimizer.param_groups:  # the rate of the next step, from the config's lr (the scheduler's next step agrees)
        group["weight_decay"] = cfg.optimizer.weight_decay
        group["lr"] = cfg.optimizer.lr * optim.lr_factor(scheduler.last_epoch)
    if optim.scaler.is_enabled() and restored.get("grad_scaler"):
        optim.scaler.load_state_dict(restored["grad_scaler"])
    global_step = point.state["global_step"]
    world_then = point.state.get("world_size", 1)
    if world_then != ranks.world_size:
        log.info(f"resume: the checkpoint was written by {world_then} rank(s), this run has {ranks.world_size}: state resharded by DCP")
    rng = restored.get("rng", {}).get(str(ranks.rank))
    if rng is not None:
        set_rng_state(rng)  # last: nothing may draw random numbers between here and the next step
    else:  # a rank the checkpoint did not have: a fresh stream of its own
        seed_everything(cfg.seed + ranks.rank + 1_000_003 * global_step)
    return global_step, (restored["position"]["epoch"], restored["position"]["step_in_epoch"])
