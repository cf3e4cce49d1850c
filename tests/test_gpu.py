"""The CUDA path: dequantize + merge on the GPU chunk by chunk, pinned staging to the host. Skipped
cleanly where no GPU is present (this suite's home machine has none; bench/gpu_check.sh runs it)."""

import pytest
import torch
from safetensors.torch import load_file

from slimtune import save_checkpoint
from slimtune.checkpoint.writer import DEFAULT_CHUNK_BYTES
from slimtune.merge import merge_from_files

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def within_one_ulp(a: torch.Tensor, b: torch.Tensor) -> bool:
    # GPU and CPU sum the r products of B @ A in different orders: the fp32 result may differ in its
    # last bit, which can move the single bf16 rounding by one unit.
    return bool(((a.double() - b.double()).abs() <= a.double().abs() * 2**-8 + 1e-30).all())


def test_cuda_save_matches_cpu_save_with_bounded_vram(qlora_model, tmp_path):
    save_checkpoint(qlora_model, tmp_path / "cpu", progress=False)
    model = qlora_model.to("cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    save_checkpoint(model, tmp_path / "cuda", progress=False)
    vram_overhead = torch.cuda.max_memory_allocated() - before
    print(f"VRAM overhead of the save: {vram_overhead / 2**20:.1f} MiB (chunk {DEFAULT_CHUNK_BYTES / 2**20:.0f} MiB)")
    assert vram_overhead <= 12 * DEFAULT_CHUNK_BYTES
    cpu = load_file(tmp_path / "cpu" / "model-00001-of-00001.safetensors")
    gpu = load_file(tmp_path / "cuda" / "model-00001-of-00001.safetensors")
    assert cpu.keys() == gpu.keys()
    for name in cpu:
        assert within_one_ulp(cpu[name], gpu[name]), name


def test_cuda_merge_matches_cpu_merge(tiny_base, tmp_path):
    from tests.test_merge import make_peft_adapter

    make_peft_adapter(tiny_base, tmp_path / "adapter", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    merge_from_files(tiny_base, tmp_path / "adapter", tmp_path / "cpu", progress=False)
    merge_from_files(tiny_base, tmp_path / "adapter", tmp_path / "cuda", device="cuda", progress=False)
    cpu = load_file(tmp_path / "cpu" / "model-00001-of-00001.safetensors")
    gpu = load_file(tmp_path / "cuda" / "model-00001-of-00001.safetensors")
    for name in cpu:
        assert within_one_ulp(cpu[name], gpu[name]), name
