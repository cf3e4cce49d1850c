import pytest
import torch

from slimtune.lora import lora_scaling, merge_lora_rows
from slimtune.quant.nf4 import _torchao_linear_nf4, dequantize_nf4_rows, linear_nf4, quantize_nf4


@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((128, 128), torch.bfloat16),
        ((512, 128), torch.bfloat16),
        ((1024, 48), torch.bfloat16),  # rows are not whole 64-blocks: chunks start mid-block
        ((256, 192), torch.float16),
        ((64, 1024), torch.float32),
    ],
)
def test_dequantize_rows_bit_identical_to_torchao(shape, dtype):
    torch.manual_seed(0)
    weight = torch.randn(shape, dtype=torch.float32).mul(0.05).to(dtype)
    nf4 = quantize_nf4(weight)
    reference = nf4.get_original_weight()
    rows = shape[0]
    ranges = [(0, rows), (0, 1), (3, 7), (rows // 3, rows // 2 + 5), (rows - 1, rows)]
    for start, end in ranges:
        got = dequantize_nf4_rows(nf4, start, end)
        assert got.dtype == dtype
        assert got.shape == (end - start, shape[1])
        # compare bits, not values: -0.0 vs 0.0 or NaN payloads would hide in a value comparison
        assert torch.equal(got.view(torch.uint8), reference[start:end].contiguous().view(torch.uint8)), (start, end)


@pytest.mark.parametrize(
    "weight_dtype,input_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float32)]
)
def test_linear_nf4_bit_identical_to_torchao_forward_and_backward(weight_dtype, input_dtype):
    """The training forward's NF4 linear (slimtune's dequantization on the CPU) against torchao's linear_nf4."""
    torch.manual_seed(2)
    nf4 = quantize_nf4(torch.randn(256, 128).mul(0.05).to(weight_dtype))
    x = torch.randn(3, 5, 128).to(input_dtype)
    grad = torch.randn(3, 5, 256).to(input_dtype)
    results = []
    for fn in (linear_nf4, _torchao_linear_nf4):
        leaf = x.clone().requires_grad_()
        y = fn(leaf, nf4)
        y.backward(grad)
        results.append((y.detach(), leaf.grad))
    (y, dx), (y_ref, dx_ref) = results
    assert y.dtype == input_dtype and torch.equal(y, y_ref)
    assert torch.equal(dx, dx_ref)
    assert not torch.equal(dx, torch.zeros_like(dx))


@pytest.mark.parametrize("use_rslora", [False, True])
def test_merge_math_matches_independent_reference(use_rslora):
    torch.manual_seed(1)
    out_f, in_f, r, alpha = 96, 64, 8, 16.0
    w = torch.randn(out_f, in_f).to(torch.bfloat16)
    a, b = torch.randn(r, in_f), torch.randn(out_f, r) * 0.1
    scale = lora_scaling(r, alpha, use_rslora)
    assert scale == pytest.approx(alpha / r**0.5 if use_rslora else alpha / r)
    merged = merge_lora_rows(w, a, b, scale)
    assert merged.dtype == torch.float32
    reference = w.double() + scale * (b.double() @ a.double())  # float64: independent of fp32 rounding
    assert torch.allclose(merged.double(), reference, rtol=1e-6, atol=1e-6)
    # rounded once to bf16 it matches the reference rounded once (allow one ulp where fp32 sits on a tie)
    ulp = (reference.abs().float() * 2**-7).clamp_min(2**-133)
    assert ((merged.to(torch.bfloat16).double() - reference.to(torch.bfloat16).double()).abs() <= ulp.double()).all()
    # row chunks agree with the whole matrix to fp32 precision (BLAS may order the r-term sums differently
    # for different row counts, so the last fp32 bit can move; bf16 rounding hides it almost always)
    chunked = torch.cat([merge_lora_rows(w[i : i + 10], a, b[i : i + 10], scale) for i in range(0, out_f, 10)])
    assert ((chunked - merged).abs() <= 2e-7 * merged.abs().max()).all()


def test_dora_merge_rescales_rows_to_magnitude():
    torch.manual_seed(2)
    w, a, b = torch.randn(32, 64), torch.randn(4, 64), torch.randn(32, 4)
    m = torch.rand(32) + 0.5
    merged = merge_lora_rows(w, a, b, 2.0, m)
    v = w.double() + 2.0 * (b.double() @ a.double())
    reference = v * (m.double() / v.norm(dim=1)).unsqueeze(1)
    assert torch.allclose(merged.double(), reference, rtol=1e-5, atol=1e-6)
    assert torch.allclose(merged.norm(dim=1), m, rtol=1e-5)
