"""Run by tests/test_distributed.py under torchrun (2 ranks, gloo) and by bench/gpu_check.sh (NCCL): the
same QLoRA model on every rank, saved once by one process (rank 0, before sharding), then FSDP2-sharded
and exported by every rank together. Each rank writes its RSS before and at peak during the export to
OUT/rank-R.json; rank 0 prints whether the two checkpoints are the same files, byte for byte.
Usage: python -m torch.distributed.run --standalone --nproc-per-node N tests/dist_worker.py BASE OUT [cuda]"""

import json
import sys
from pathlib import Path

import torch

from slimtune import save_checkpoint
from slimtune.checkpoint.atomic import read_manifest
from slimtune.checkpoint.writer import WriteOptions
from slimtune.distributed import init_distributed, shard_model, shutdown
from slimtune.lora import LoRAConfig
from slimtune.memory import peak_rss_mb, reset_peak_rss, rss_mb
from slimtune.model import load_qlora_model
from tests.conftest import perturb_adapters

base, out = Path(sys.argv[1]), Path(sys.argv[2])
device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
ranks = init_distributed(device)
model = load_qlora_model(base, LoRAConfig(rank=8, alpha=16), seed=0, progress=False)
perturb_adapters(model)
if device == "cuda":
    model.to(f"cuda:{torch.cuda.current_device()}")
if ranks.is_coordinator:
    save_checkpoint(model, out / "single", WriteOptions(max_shard_size="400KB", progress=False))
shard_model(model, ranks)
assert all(type(p).__name__ == "DTensor" for p in model.parameters())  # every weight is sharded
before = rss_mb()
reset_peak_rss()
save_checkpoint(model, out / "dist", WriteOptions(max_shard_size="400KB", progress=False), ranks=ranks)
(out / f"rank-{ranks.rank}.json").write_text(json.dumps({"rss_before_mb": before, "peak_rss_mb": peak_rss_mb()}))
if ranks.is_coordinator:
    same = read_manifest(out / "single")["files"] == read_manifest(out / "dist")["files"]
    print(f"{ranks.world_size}-rank {device} export identical to the single-process save: {same}")
    if not same:
        sys.exit(1)
shutdown(wait=True)
