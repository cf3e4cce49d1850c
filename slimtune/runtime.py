"""How training uses the machine: torch's CPU thread count, regional compilation of the decoder layers and
activation checkpointing.

Threads: torch sizes its intra-op pool from the machine's cores, not from the cores this process may
run on, and under torchrun every rank does so. When processes share the cores their spinning pools
oversubscribe them (the step slows many times over). ``choose_num_threads`` takes the cores
this process may use (``os.sched_getaffinity``), divided among the ranks on this machine
(``LOCAL_WORLD_SIZE``), unless ``training.num_threads`` says otherwise. The count is a function of the
affinity mask and the launch only, never of the machine's momentary load: the thread count can change
the order of floating-point reductions, and a resumed run must compute what the uninterrupted one did.
Where other processes share the cores, set ``training.num_threads``: a pool that spins at every barrier
while its threads wait for a core is many times slower than one thread (docs/benchmarks.md).

Compilation: ``compile_decoder_layers`` calls ``torch.compile`` on each decoder layer, in place
(``nn.Module.compile``: names, parameters and state-dict keys unchanged), as torchtune's regional
compilation does: every layer runs the same code, so one compiled graph serves them all and the cold
start stays a few seconds to minutes instead of a whole-model compile. Inductor on CPU and CUDA."""

from __future__ import annotations

import os

import torch
from torch import nn


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; os.cpu_count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def choose_num_threads(override: int | None = None) -> int:
    """Set torch's intra-op thread count and return it: ``override``, else the usable cores divided among
    the ranks on this machine (``LOCAL_WORLD_SIZE``; at least 1).

    Example: ``choose_num_threads(None)`` -> 2 where the process may use 2 cores, 1 per rank under torchrun with 2"""
    if override is None:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
        override = max(1, usable_cores() // local_ranks)
    torch.set_num_threads(override)
    return override


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a transformers model (``*DecoderLayer`` modules), in order."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def compile_decoder_layers(model: nn.Module) -> int:
    """``torch.compile`` each decoder layer in place (regional compilation); returns how many.
    The compile itself happens at the first forward pass (the cold start the recipe logs).

    Example: ``compile_decoder_layers(model)`` -> 16 for Llama-3.2-1B"""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile()
    return len(layers)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Non-reentrant checkpointing per decoder layer: works with frozen inputs and restores the RNG for
    the recomputation, so dropout masks (and exact resume) are unchanged. transformers 5 renamed the call.

    Example: ``enable_activation_checkpointing(model)``"""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
