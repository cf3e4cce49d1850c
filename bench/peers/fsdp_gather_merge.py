"""torchtune's distributed save, emulated on slimtune's sharded model for `dist-save`'s comparison:

    python -m bench.peers.fsdp_gather_merge --preset llama3-8b --layers 4 --nproc 2 --out DIR

runs ``python -m bench dist-save`` (the same JSON line) with, on every rank after slimtune's own
export of the FSDP2-sharded synthetic model, what torchtune's distributed LoRA recipe does at save time:
the full state dict gathered to rank 0's CPU, NF4 weights upcast to bf16, then ``get_merged_lora_ckpt``'s
merge (torchtune is not in the main venv: hand-written after its lines). Rank 0's figures are under
``peer_rank0``; nothing is written, so its peak is a lower bound of the peer's save."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from bench.save import bench_dist_save
from slimtune.lora import lora_modules
from slimtune.memory import peak_rss_mb, reset_peak_rss, rss_mb
from slimtune.quant import is_nf4
from slimtune.synthetic import PRESETS


def gather_and_merge(model: torch.nn.Module, ranks) -> dict:
    """What torchtune's distributed LoRA recipe does at save time, on the same sharded model: the full
    state dict gathered to rank 0's CPU (torch's ``get_model_state_dict(full_state_dict=True,
    cpu_offload=True)``), NF4 weights upcast to bf16, then ``get_merged_lora_ckpt``'s merge
    (W += alpha / r * B @ A, LoRA keys dropped). Rank 0's peak RSS over it (nothing written)."""

    before = rss_mb()
    reset_peak_rss()
    t0 = time.perf_counter()
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ranks.is_coordinator:
        for key in list(sd):
            if is_nf4(sd[key]):
                sd[key] = sd[key].to(torch.bfloat16)
        for name, module in lora_modules(model).items():
            a, b = sd.pop(f"{name}.lora_a.weight"), sd.pop(f"{name}.lora_b.weight")
            sd[f"{name}.weight"] += module.scaling * b @ a
    merged_bytes = sum(v.numel() * v.element_size() for v in sd.values())
    seconds = time.perf_counter() - t0
    del sd
    peak = peak_rss_mb()
    return {
        "rss_before_mb": round(before, 1),
        "peak_rss_mb": round(peak, 1),
        "overhead_mb": round(peak - before, 1),
        "state_dict_bytes": merged_bytes,
        "seconds": round(seconds, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3.2-1b")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--layers", type=int, default=None, help="override the number of layers")
    args = parser.parse_args()
    print(json.dumps(bench_dist_save(args.preset, args.out, args.nproc, args.layers, peer=gather_and_merge)))


if __name__ == "__main__":
    main()
