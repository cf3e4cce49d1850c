"""The training objectives by name (``training.objective``): each is one module of this package that
implements ``recipes/objective.py``'s ``Objective``, plus its config section; this registry is where its
name is entered.

Example: ``objective_for(load_config("tiny", ["training.objective=dpo"]))`` -> a ``PreferenceObjective``"""

from __future__ import annotations

from slimtune.config import Config
from slimtune.recipes.objective import Objective
from slimtune.recipes.objectives.grpo import GRPOObjective
from slimtune.recipes.objectives.preference import PreferenceObjective
from slimtune.recipes.objectives.sft import SupervisedObjective

OBJECTIVES: dict[str, type[Objective]] = {
    "sft": SupervisedObjective,
    "dpo": PreferenceObjective,
    "ipo": PreferenceObjective,
    "simpo": PreferenceObjective,
    "grpo": GRPOObjective,
}


def objective_for(cfg: Config) -> Objective:
    """The run's objective, made from ``cfg`` (training.objective names it; the config's own check has
    refused any other name).

    Example: ``objective = objective_for(cfg)``"""
    return OBJECTIVES[cfg.training.objective](cfg)
