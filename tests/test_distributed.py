"""The cooperative writer: one plan on every rank, every rank writing its rows at their offsets.

Multi-process tests run 2 ranks on the CPU with gloo through ``slimtune merge --nproc 2`` (torch's
elastic launcher, as torchrun) or torchrun itself; they are marked ``multiprocess``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slimtune import save_checkpoint
from slimtune.checkpoint.atomic import MANIFEST_NAME, atomic_directory, sha256_file
from slimtune.checkpoint.plan import plan_save
from slimtune.checkpoint.stream import merged_tensor_stream
from slimtune.checkpoint.writer import WriteOptions
from slimtune.distributed import raise_on_sigterm, split_rows
from slimtune.errors import SlimtuneError
from slimtune.tensors import StreamTensor
from tests.conftest import ROOT, run_cli, run_python


def _stream(shapes: dict[str, tuple[int, ...]]) -> list[StreamTensor]:
    def zeros(shape):
        return lambda a, b: torch.zeros((b - a, *shape[1:]), dtype=torch.bfloat16)

    return [StreamTensor(n, s, torch.bfloat16, zeros(s)) for n, s in shapes.items()]


def test_split_rows_follows_fsdp_chunks():
    for rows in (0, 1, 5, 8, 13, 4096):
        for world in (1, 2, 3, 8):
            ranges = split_rows(rows, world)
            expected = [c.shape[0] for c in torch.arange(max(rows, 1))[:rows].chunk(world)] if rows else []
            sizes = [b - a for a, b in ranges]
            assert sizes[: len(expected)] == expected and sum(sizes) == rows
            assert all(ranges[i][1] == ranges[i + 1][0] for i in range(world - 1))


def test_nf4_splits_follows_torchaos_rule():
    from slimtune.distributed import nf4_splits

    assert nf4_splits((256, 256), 2) and nf4_splits((4096, 4096), 8)
    assert not nf4_splits((128, 128), 2)  # one group of scaler blocks: nothing to halve
    assert not nf4_splits((256, 256), 3)  # rows and blocks do not divide by 3
    assert not nf4_splits((256, 256), 1)  # one rank: held whole (FSDP2's one-rank gather does not split NF4)
    # the oracle: torchao's own split of an NF4 tensor into equal parts, as FSDP2 cuts it
    from slimtune.quant.nf4 import quantize_nf4

    assert nf4_splits((576, 576), 2) and nf4_splits((576, 576), 3)  # 24 scaler blocks of 216
    assert not nf4_splits((576, 576), 5)
    for shape in ((128, 128), (256, 256), (512, 256), (384, 256), (256, 384), (1024, 64), (576, 576), (192, 576), (960, 960), (100, 96)):
        weight = quantize_nf4(torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16))
        for world in (2, 3, 4):
            try:
                parts = torch.split(weight, shape[0] // world) if shape[0] % world == 0 else None
                splits = parts is not None and len(parts) == world
            except (AssertionError, RuntimeError, NotImplementedError):
                splits = False
            assert nf4_splits(shape, world) == splits, (shape, world)


def test_plan_covers_every_byte_once_and_is_rank_independent():
    shapes = {"emb": (1000, 64), "norm": (64,), "scalar": (), "w": (7, 64), "big": (3000, 64)}
    plans = [plan_save(_stream(shapes), None, max_shard_bytes=300_000, world_size=3, whole_below=1024) for _ in range(2)]
    assert plans[0].digest() == plans[1].digest()
    plan = plans[0]
    assert [f.path for f in plan.files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for f in plan.files:
        assert sum(f.bytes_of(r) for r in range(3)) == f.size - len(f.header)
    slots = {s.name: s for f in plan.files for s in f.slots}
    assert sum(1 for a, b in slots["norm"].ranges if b > a) == 1  # small: one owner writes it whole
    assert sum(1 for a, b in slots["scalar"].ranges if b > a) == 1
    assert slots["big"].ranges == split_rows(3000, 3)
    # every file is hashed by exactly one rank; the one read back here is the only file no rank writes whole
    assert len(plan.hashers) == len(plan.files) and all(0 <= h < 3 for h in plan.hashers)
    assert plan.weight_map == {n: f.path for f in plan.files for n in (s.name for s in f.slots)}
    assert plan_save(_stream(shapes), None, 300_000, world_size=2).digest() != plan.digest()


def test_plan_order_is_canonical_whatever_the_stream_order():
    """Shards are packed in natural name order (layers.2 before layers.10); inside a file, larger
    elements first (alignment, as safetensors' serialize), then natural order. Any stream order, one plan."""
    names = [f"model.layers.{i}.{p}" for i in (10, 2, 0, 1) for p in ("mlp.weight", "input_layernorm.weight")]
    stream = _stream({n: (64, 64) for n in names} | {"lm_head.weight": (64, 64), "model.norm.weight": (64,)})
    stream.append(StreamTensor("model.layers.1.mask", (4,), torch.float32, lambda a, b: torch.zeros(b - a)))
    plans = [plan_save(s, None, max_shard_bytes=3 * 64 * 64 * 2) for s in (stream, stream[::-1], sorted(stream, key=lambda t: t.name))]
    assert len({p.digest() for p in plans}) == 1
    order = [s.name for f in plans[0].files for s in f.slots]
    assert order[:2] == ["lm_head.weight", "model.layers.0.input_layernorm.weight"]
    assert order.index("model.layers.2.mlp.weight") < order.index("model.layers.10.input_layernorm.weight")
    assert order[-1] == "model.norm.weight"
    (with_mask,) = [f for f in plans[0].files if any(s.name == "model.layers.1.mask" for s in f.slots)]
    assert with_mask.slots[0].name == "model.layers.1.mask"  # fp32 before the bf16 tensors of its file
    assert list(plans[0].weight_map) == order


def test_world_size_one_writes_through_the_plan(qlora_model, tmp_path, monkeypatch):
    """The single-process save is the world of size 1: every shard hashed as it is written (a thread trailing
    the writer, from the page cache), never by a read-back pass of its own."""
    import slimtune.checkpoint.writer as writer

    def no_read_back(path, *a, **k):
        raise AssertionError(f"{path} was read back")

    monkeypatch.setattr(writer, "sha256_file", no_read_back)
    result = save_checkpoint(qlora_model, tmp_path / "ckpt", WriteOptions(max_shard_size="300KB", progress=False))
    monkeypatch.undo()
    plan = plan_save(merged_tensor_stream(qlora_model), [], 300_000)
    assert plan.read_back_bytes(0) == 0 and len(plan.files) >= 3
    for record in result.files:
        assert sha256_file(tmp_path / "ckpt" / record.path) == record.sha256


def _manifest(path: Path) -> dict[str, str]:
    return {f["path"]: f["sha256"] for f in json.loads((path / MANIFEST_NAME).read_text())["files"]}


@pytest.fixture(scope="module")
def adapter_ckpt(tiny_base, tmp_path_factory) -> Path:
    from slimtune.lora import LoRAConfig
    from slimtune.model import load_qlora_model
    from tests.conftest import perturb_adapters

    model = load_qlora_model(tiny_base, LoRAConfig(rank=8, alpha=16), seed=0, progress=False)
    perturb_adapters(model)
    out = tmp_path_factory.mktemp("dist") / "adapter-ckpt"
    save_checkpoint(model, out, WriteOptions(adapter_only=True, progress=False))
    return out


@pytest.mark.multiprocess
def test_merge_nproc_2_is_bit_identical_to_one_process_and_verifies(tiny_base, adapter_ckpt, tmp_path):
    common = ["--base", str(tiny_base), "--adapter", str(adapter_ckpt), "--merge-base", "quantized", "--max-shard-size", "300KB"]
    one = run_cli("merge", *common, "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    two = run_cli("merge", *common, "--out", str(tmp_path / "two"), "--nproc", "2")
    assert two.returncode == 0, two.stderr
    assert "by 2 processes" in two.stdout and two.stdout.count("wrote ") == 1  # only the coordinator prints
    a, b = _manifest(tmp_path / "one"), _manifest(tmp_path / "two")
    assert len([p for p in a if p.endswith(".safetensors")]) >= 3  # several shards, rows split in each
    assert a == b
    for name in a:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    verify = run_cli("verify", str(tmp_path / "two"), "--base", str(tiny_base), "--adapter", str(adapter_ckpt), "--merge-base", "quantized")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert ": OK" in verify.stdout


@pytest.mark.multiprocess
def test_sigkill_of_one_rank_mid_export_leaves_earlier_checkpoint(tiny_base, adapter_ckpt, tmp_path):
    out = tmp_path / "merged"
    first = run_cli("merge", "--base", str(tiny_base), "--adapter", str(adapter_ckpt), "--out", str(out), "--max-shard-size", "300KB")
    assert first.returncode == 0, first.stderr
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'tests' / 'killer'}{os.pathsep}{ROOT}",
        "SLIMTUNE_KILL_RANK": "1",
        "SLIMTUNE_KILL_AT": "6",  # rank 1 dies in the middle of its rows, after some were written
    }
    args = ["merge", "--base", str(tiny_base), "--adapter", str(adapter_ckpt), "--out", str(out), "--overwrite"]
    args += ["--max-shard-size", "300KB", "--dtype", "fp32", "--nproc", "2"]
    proc = subprocess.run([sys.executable, "-m", "slimtune", *args], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("slimtune merge: error:")]
    assert len(errors) == 1, proc.stderr  # rank 0's one line; rank 1 died silently
    assert "rank 1 killed by SIGKILL" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]  # no temporary directory left, no new manifest


@pytest.mark.multiprocess
@pytest.mark.parametrize("width,mlp", [(256, 512), (576, 1536)])
def test_fsdp2_sharded_export_is_bit_identical_to_single_process_save_and_to_merge(tmp_path, width, mlp):
    """2 ranks, FSDP2 on every decoder layer and the root (NF4 base and fp32 adapters sharded): each rank
    writes the merged rows it holds. Same files, byte for byte, as one process saving the same weights;
    the same as `slimtune merge --merge-base quantized` of the adapter it wrote; and it verifies."""
    from slimtune.formats.merge_source import MergeSource
    from slimtune.merge import merge_from_files
    from slimtune.tiny import make_tiny_checkpoint
    from slimtune.verify import verify_checkpoint

    # every NF4 weight has an even number of scaler blocks, as FSDP2's split of NF4 needs: 256 wide with
    # scaler blocks of 256; 576 wide (SmolLM2-135M's) with 216 for the 576 x 576 projections (24 of them)
    base = make_tiny_checkpoint(tmp_path / "base", seed=1, hidden_size=width, intermediate_size=mlp)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "tests" / "dist_worker.py"), str(base), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    single, dist = _manifest(tmp_path / "single"), _manifest(tmp_path / "dist")
    assert len([p for p in dist if p.startswith("model-")]) >= 3
    assert single == dist
    for name in dist:
        assert (tmp_path / "single" / name).read_bytes() == (tmp_path / "dist" / name).read_bytes()
    # the offline merge of the adapter the export wrote: every file both write is the same file (one
    # canonical tensor order in plan_save, one config rule), though its stream comes in the base's order
    merge_from_files(
        MergeSource(base, tmp_path / "dist", "quantized"), tmp_path / "merged", WriteOptions(max_shard_size="400KB", progress=False)
    )
    merged = _manifest(tmp_path / "merged")
    assert set(merged) == {p for p in dist if not p.startswith("adapter/")}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= set(merged)
    assert {p: dist[p] for p in merged} == merged
    for name in merged:
        assert (tmp_path / "merged" / name).read_bytes() == (tmp_path / "dist" / name).read_bytes()
    report = verify_checkpoint(tmp_path / "dist", MergeSource(base, tmp_path / "dist", "quantized"), progress=False)
    assert report.ok, report.problems
    for rank in (0, 1):
        stats = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert stats["peak_rss_mb"] <= stats["rss_before_mb"] + 256


DIST_RSS_SCRIPT = """
import json, shutil, sys
from pathlib import Path
from bench.save import dist_export
from slimtune.synthetic import preset_config, synthetic_qlora_model
from slimtune.checkpoint.atomic import read_manifest
out = Path(sys.argv[1])
# Llama-3-8B widths, 3 layers, a small vocabulary: ~330 MB of NF4 in memory, 1.33 GB merged in bf16
model = synthetic_qlora_model(preset_config("llama3-8b", num_hidden_layers=3, vocab_size=1024))
try:
    rows = dist_export(model, out, nproc=2, max_shard_size="400MB")
    files = read_manifest(out)["files"]
    print(json.dumps({"ranks": rows, "merged_bytes": sum(f["size"] for f in files if f["path"].startswith("model-")),
                      "output_bytes": sum(f["size"] for f in files) + (out / "slimtune_manifest.json").stat().st_size}))
finally:
    shutil.rmtree(out, ignore_errors=True)
"""


@pytest.mark.multiprocess
def test_fsdp2_export_of_a_gigabyte_model_keeps_every_rank_within_256_mb(tmp_path):
    """2 gloo ranks FSDP2-shard a synthetic QLoRA model (``bench.save.dist_export``: forked from one
    process, as the training ranks hold it) and export it together: merged output >= 1 GiB; each rank's
    peak RSS during the export (VmHWM, reset before the save, measured in the rank) <= its RSS before
    the save + 256 MB; every byte written once, about half by each rank."""
    out = tmp_path / "export"
    try:
        r = run_python(f"import sys; sys.argv = ['x', {str(out)!r}]; exec({DIST_RSS_SCRIPT!r})")
        assert r.returncode == 0, r.stderr[-3000:]
        result = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(out, ignore_errors=True)
    assert result["merged_bytes"] >= 2**30, result
    for row in result["ranks"]:
        assert row["peak_rss_mb"] <= row["rss_before_mb"] + 256, result
        assert row["bytes_written"] >= 0.4 * result["merged_bytes"], result  # rows split: both ranks write
    written = sum(row["bytes_written"] for row in result["ranks"])
    assert abs(written - result["output_bytes"]) <= 0.01 * result["output_bytes"], result


def test_a_sigterm_during_the_cleanup_of_a_temporary_directory_waits_for_it(tmp_path, monkeypatch):
    """torchrun sends SIGTERM to the surviving ranks while they clean up after a lost peer (under load it
    came mid-rmtree, and the temporary directory of the interrupted export stayed): the clean-up runs to
    its end, and the error on its way is the one raised."""
    rmtree = shutil.rmtree

    def rmtree_hit_by_sigterm(path, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs at the next bytecode, here
        return rmtree(path, *args, **kwargs)

    previous = signal.getsignal(signal.SIGTERM)
    raise_on_sigterm("rank 0: stopped by SIGTERM")
    monkeypatch.setattr(shutil, "rmtree", rmtree_hit_by_sigterm)
    try:
        with pytest.raises(SlimtuneError, match="lost contact"), atomic_directory(tmp_path / "step-000004") as tmp:
            (tmp / "model-00001-of-00002.safetensors").write_bytes(b"rows")
            raise SlimtuneError("rank 0: lost contact with the other ranks during writing (did one die?)")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert list(tmp_path.iterdir()) == []  # neither the temporary directory nor its lock


_GROUP_ENDS = """
import os, sys
import torch
import torch.distributed as dist
from slimtune.distributed import init_distributed, shutdown

def threads():
    return len(os.listdir("/proc/self/task"))

torch.ones(4).sum()
before = threads()
ranks = init_distributed("cpu")
group = dist.group.WORLD
import torch.distributed.fsdp  # what torch's dynamo imports on first use, after the group exists
ranks.gather(ranks.rank, "a test exchange")
shutdown(wait=True)
held = sys.getrefcount(group) - 1  # less getrefcount's own argument
del group
print(f"rank {ranks.rank}: references {held}, threads {before} -> {threads()}")
assert held == 1 and threads() == before
"""


@pytest.mark.multiprocess
def test_shutdown_ends_the_groups_threads_even_after_torch_distributed_nn_is_imported(tmp_path):
    """torch.distributed.nn binds group.WORLD as a default argument when imported: imported after the
    group exists it kept the group (and its gloo worker threads) alive past ``destroy_process_group``,
    and a worker freeing its last work at interpreter exit aborted the rank (``join_group``)."""
    script = tmp_path / "group_ends.py"
    script.write_text(_GROUP_ENDS)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: references 1, threads" in result.stdout
