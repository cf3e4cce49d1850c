"""The CUDA path: dequantize + merge on the GPU chunk by chunk, pinned staging to the host. Skipped
cleanly where no GPU is present (this suite's home machine has none; bench/gpu_check.sh runs it)."""

import pytest
import torch
from safetensors.torch import load_file

from slimtune import save_checkpoint
from slimtune.checkpoint.writer import WriteOptions
from slimtune.diskio import DEFAULT_CHUNK_BYTES
from slimtune.formats.merge_source import MergeSource
from slimtune.merge import merge_from_files

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def bf16_ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place: bf16 bit patterns mapped to ordered integers."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.to(torch.bfloat16).view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


def assert_within_one_ulp(cpu: dict, gpu: dict) -> None:
    """GPU and CPU sum the r products of B @ A in different orders: the fp32 result may differ in its last
    bits, which can move the single bf16 rounding by one unit. Where base and delta almost cancel, the
    result is far smaller than its terms and those fp32 bits are several of its own bf16 units: there the
    difference must stay within a few fp32 units of the tensor's scale (a wrong merge is off by the delta)."""
    assert cpu.keys() == gpu.keys()
    worst, moved, total, cancel = 0, 0, 0, 0
    for name in cpu:
        d = bf16_ulp_distance(cpu[name], gpu[name])
        scale = float(cpu[name].float().abs().max())
        close = (cpu[name].float() - gpu[name].float()).abs() <= scale * 2**-18
        bad = (d > 1) & ~close
        worst, moved, total, cancel = max(worst, int(d.max())), moved + int((d > 0).sum()), total + d.numel(), cancel + int((d > 1).sum())
        assert not bool(bad.any()), f"{name}: {int(bad.sum())} elements more than 1 bf16 ulp and 2**-18 of the scale apart"
    print(f"GPU vs CPU: {moved} of {total} elements moved by one bf16 ulp, {cancel} near-cancellations further (max {worst} ulps)")


def test_ulp_distance_counts_units():
    a = {"w": torch.tensor([0.02, 1e-6], dtype=torch.bfloat16)}
    with pytest.raises(AssertionError):  # off by a LoRA-sized delta: caught
        assert_within_one_ulp(a, {"w": torch.tensor([0.021, 1e-6], dtype=torch.bfloat16)})
    assert_within_one_ulp(a, {"w": torch.tensor([0.02, 1.03e-6], dtype=torch.bfloat16)})  # a cancellation: fine
    one = torch.tensor([1.0, -1.0, 0.0], dtype=torch.bfloat16)
    nxt = torch.tensor([1.0078125, -1.0078125, -0.0], dtype=torch.bfloat16)  # 1 + 2**-7: one bf16 ulp up
    assert bf16_ulp_distance(one, nxt).tolist() == [1, 1, 0]


@pytest.mark.gpu
@needs_cuda
def test_cuda_save_matches_cpu_save_with_bounded_vram(qlora_model, tmp_path):
    save_checkpoint(qlora_model, tmp_path / "cpu", WriteOptions(progress=False))
    model = qlora_model.to("cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    save_checkpoint(model, tmp_path / "cuda", WriteOptions(progress=False))
    vram_overhead = torch.cuda.max_memory_allocated() - before
    print(f"VRAM overhead of the save: {vram_overhead / 2**20:.1f} MiB (chunk {DEFAULT_CHUNK_BYTES / 2**20:.0f} MiB)")
    assert vram_overhead <= 12 * DEFAULT_CHUNK_BYTES
    print(f"TF32 matmul allowed: {torch.backends.cuda.matmul.allow_tf32}")
    cpu = load_file(tmp_path / "cpu" / "model-00001-of-00001.safetensors")
    gpu = load_file(tmp_path / "cuda" / "model-00001-of-00001.safetensors")
    assert_within_one_ulp(cpu, gpu)


@pytest.mark.gpu
@needs_cuda
def test_cuda_merge_matches_cpu_merge(tiny_base, tmp_path):
    from tests.test_merge import make_peft_adapter

    make_peft_adapter(tiny_base, tmp_path / "adapter", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    merge_from_files(MergeSource(tiny_base, tmp_path / "adapter"), tmp_path / "cpu", WriteOptions(progress=False))
    merge_from_files(MergeSource(tiny_base, tmp_path / "adapter"), tmp_path / "cuda", WriteOptions(device="cuda", progress=False))
    cpu = load_file(tmp_path / "cpu" / "model-00001-of-00001.safetensors")
    gpu = load_file(tmp_path / "cuda" / "model-00001-of-00001.safetensors")
    assert_within_one_ulp(cpu, gpu)
