import pytest
import torch

from slimtune.formats.peft import lora_scaling
from slimtune.lora import lora_row_merge, merge_lora_rows
from slimtune.quant import resident_bytes
from slimtune.quant.nf4 import (
    NF4RoundTrip,
    _torchao_linear_nf4,
    dequantize_nf4_rows,
    nf4_linear,
    quantize_nf4,
    scaler_block_size,
    to_nf4,
)


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
def test_nf4_linear_bit_identical_to_torchao_forward_and_backward(weight_dtype, input_dtype):
    """The training forward's NF4 linear (slimtune's dequantization on the CPU) against torchao's linear_nf4,
    on a weight whose scaler block is not torchao's default (SmolLM2's k/v projection: 216)."""
    torch.manual_seed(2)
    nf4 = quantize_nf4(torch.randn(192, 576).mul(0.05).to(weight_dtype))
    x = torch.randn(3, 5, 576).to(input_dtype)
    grad = torch.randn(3, 5, 192).to(input_dtype)
    results = []
    for fn in (nf4_linear, _torchao_linear_nf4):
        leaf = x.clone().requires_grad_()
        y = fn(leaf, nf4)
        y.backward(grad)
        results.append((y.detach(), leaf.grad))
    (y, dx), (y_ref, dx_ref) = results
    assert y.dtype == input_dtype and torch.equal(y, y_ref)
    assert torch.equal(dx, dx_ref)
    assert not torch.equal(dx, torch.zeros_like(dx))


@pytest.mark.parametrize(
    "shape,scaler_block",
    [
        ((576, 576), 216),  # SmolLM2-135M's attention: 5,184 blocks
        ((192, 576), 216),  # its k/v projections: 1,728 blocks
        ((1536, 576), 256),  # its MLP: 13,824 blocks
        ((960, 960), 240),  # SmolLM2-360M's width: 14,400 blocks
        ((320, 960), 240),
        ((1024, 48), 256),  # rows that are not whole 64-blocks
        ((100, 96), 150),
        ((48, 100), 75),
        ((5, 192), 15),
        ((257, 64), 1),  # a prime number of blocks
        ((64, 64), 64),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_other_scaler_blocks_match_torchao(shape, scaler_block, dtype):
    """The scaler block is the largest divisor of the block count <= 256; quantization is torchao's own
    to_nf4 with it, and slimtune's row dequantization and its by-rows round trip (merge base quantized)
    are bit-identical to torchao's get_original_weight for it."""
    assert scaler_block_size(shape) == scaler_block
    torch.manual_seed(3)
    weight = torch.randn(shape, dtype=torch.float32).mul(0.05).to(dtype)
    nf4 = quantize_nf4(weight)
    oracle = to_nf4(weight, 64, scaler_block)
    assert nf4.scaler_block_size == scaler_block
    for attr in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean"):
        assert torch.equal(getattr(nf4, attr), getattr(oracle, attr)), attr
    reference = oracle.get_original_weight()
    rows = shape[0]
    round_trip = NF4RoundTrip(lambda a, b: weight[a:b], shape, dtype, chunk_rows=7)
    for start, end in [(0, rows), (0, 1), (rows // 3, rows // 2 + 1), (rows - 1, rows), (1, rows - 1)]:
        expected = reference[start:end].contiguous().view(torch.uint8)
        assert torch.equal(dequantize_nf4_rows(nf4, start, end).contiguous().view(torch.uint8), expected), (start, end)
        assert torch.equal(round_trip.rows(start, end).contiguous().view(torch.uint8), expected), (start, end)


@pytest.mark.parametrize("piece", [None, 64, 448])  # the shipped piece (2 pieces here); many pieces, some short
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_in_pieces_bit_identical_to_torchao(monkeypatch, piece, dtype):
    """16-bit weights are dequantized a piece at a time into the output (``DEQUANT_PIECE``) by torch's ops
    (bf16 here too: the C loop, quant/nf4_kernel.py, is switched off, as where it cannot be built): every
    row range, whatever the piece boundaries, is torchao's bits (the last piece short; a range starting
    mid-block)."""
    import slimtune.quant.nf4 as nf4_module

    monkeypatch.setattr(nf4_module, "dequantize_bf16", lambda *a, **k: None)
    if piece is not None:
        monkeypatch.setattr(nf4_module, "DEQUANT_PIECE", piece)
    torch.manual_seed(5)
    weight = torch.randn(1024, 520, dtype=torch.float32).mul(0.05).to(dtype)  # 532,480 values: 2 pieces of 2**18 + a short one
    nf4 = quantize_nf4(weight)
    reference = nf4.get_original_weight()
    for start, end in [(0, 1024), (1, 1023), (511, 513), (1023, 1024)]:
        got = dequantize_nf4_rows(nf4, start, end)
        assert torch.equal(got.contiguous().view(torch.uint8), reference[start:end].contiguous().view(torch.uint8)), (piece, start, end)


def test_resident_bytes_of_a_plain_and_an_nf4_weight():
    w = torch.randn(128, 64, dtype=torch.bfloat16)
    assert resident_bytes(w) == 128 * 64 * 2
    n = resident_bytes(quantize_nf4(w))
    # 4-bit codes (4096 bytes), one 8-bit scaler per 64-block (128), fp32 factors per scaler block (at most 128)
    assert 4096 + 128 < n <= 4096 + 128 + 4 * 128, n


def test_weights_that_cannot_be_nf4():
    for shape in ((3, 50), (64,), (0, 64), (2, 3, 64)):
        assert scaler_block_size(shape) is None, shape
    with pytest.raises(ValueError, match="cannot be NF4"):
        quantize_nf4(torch.zeros(3, 50))


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


def test_one_row_merge_for_plain_and_transposed_weights():
    torch.manual_seed(3)
    w, a, b = torch.randn(10, 12), torch.randn(4, 12), torch.randn(10, 4)
    reference = w.double() + 0.5 * (b.double() @ a.double())
    merge = lora_row_merge(a, b, 0.5)
    plain = torch.cat([merge(w[i : i + 3], i, min(i + 3, 10)) for i in range(0, 10, 3)])
    assert torch.allclose(plain.double(), reference, atol=1e-5)
    merge_t = lora_row_merge(a, b, 0.5, transposed=True)  # a Conv1D weight [in, out]: rows of (B @ A)^T
    wt = w.t().contiguous()
    transposed = torch.cat([merge_t(wt[i : i + 5], i, min(i + 5, 12)) for i in range(0, 12, 5)])
    assert torch.allclose(transposed.double(), reference.t(), atol=1e-5)
    assert torch.equal(lora_row_merge(a, lambda s, e: b[s:e], 0.5)(w[2:5], 2, 5), merge(w[2:5], 2, 5))  # B read by rows
    with pytest.raises(ValueError, match="transposed"):
        lora_row_merge(a, b, 0.5, transposed=True, magnitude=torch.ones(10))


def test_dora_merge_rescales_rows_to_magnitude():
    torch.manual_seed(2)
    w, a, b = torch.randn(32, 64), torch.randn(4, 64), torch.randn(32, 4)
    m = torch.rand(32) + 0.5
    merged = merge_lora_rows(w, a, b, 2.0, m)
    v = w.double() + 2.0 * (b.double() @ a.double())
    reference = v * (m.double() / v.norm(dim=1)).unsqueeze(1)
    assert torch.allclose(merged.double(), reference, rtol=1e-5, atol=1e-6)
    assert torch.allclose(merged.norm(dim=1), m, rtol=1e-5)


def _bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(t.float().abs().clamp_min(2**-60))) - 7)


@pytest.mark.parametrize("nf4_base", [True, False])
def test_fused_lora_linear_equals_peft(nf4_base):
    """The CPU bf16 LoRA linear (``lora._FusedLoRALinear``) against PEFT's LoRA layer on the same frozen weight
    and adapters (fp32, PEFT's default): the output and the input gradient equal PEFT's but where the split
    bf16-pair product rounds the other way (two bf16 ulps of the terms' size at most, in under 2% of the elements);
    A's and B's gradients equal PEFT's to fp32 rounding."""
    from peft import LoraConfig, get_peft_model

    from slimtune.lora import LoRALinear, _fused_applies

    torch.manual_seed(3)
    rows, cols, rank, alpha = 192, 576, 8, 24.0  # scaling 3: not a power of two
    layer = LoRALinear(cols, rows, rank, alpha)
    weight = torch.randn(rows, cols).mul(0.05).to(torch.bfloat16)
    layer.weight = torch.nn.Parameter(quantize_nf4(weight) if nf4_base else weight, requires_grad=False)
    frozen = dequantize_nf4_rows(layer.weight, 0, rows) if nf4_base else weight
    layer.lora_a.weight.data.normal_(0, 0.05)
    layer.lora_b.weight.data.normal_(0, 0.05)
    x = torch.randn(3, 5, cols).to(torch.bfloat16)
    grad = torch.randn(3, 5, rows).to(torch.bfloat16)
    assert _fused_applies(layer, x)
    leaf = x.clone().requires_grad_()
    y = layer(leaf)
    y.backward(grad)

    base = torch.nn.Sequential(torch.nn.Linear(cols, rows, bias=False, dtype=torch.bfloat16))
    base[0].weight.data.copy_(frozen)
    peft = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=["0"]))
    peft_layer = peft.base_model.model[0]
    a, b = peft_layer.lora_A["default"].weight, peft_layer.lora_B["default"].weight
    assert a.dtype == b.dtype == torch.float32
    a.data.copy_(layer.lora_a.weight)
    b.data.copy_(layer.lora_b.weight)
    peft_leaf = x.clone().requires_grad_()
    peft_y = peft(peft_leaf)
    peft_y.backward(grad)

    with torch.no_grad():  # the size of the two terms each way: a rounding flip moves the sum by its ulp
        scale_y = (x @ frozen.t()).float().abs() + (x.float() @ a.t() @ b.t() * layer.scaling).abs()
        scale_dx = (grad @ frozen).float().abs() + ((grad.float() @ b) * layer.scaling @ a).abs()
    for got, want, scale in ((y, peft_y, scale_y), (leaf.grad, peft_leaf.grad, scale_dx)):
        assert got.dtype == want.dtype == torch.bfloat16
        diff = (got.detach().float() - want.detach().float()).abs()
        assert (diff <= 2 * _bf16_ulp(scale)).all(), diff.max()  # a flip in a term, then in the sum
        assert (diff == 0).float().mean() >= 0.98
    assert not torch.equal(leaf.grad, torch.zeros_like(leaf.grad))
    for ours, theirs in ((layer.lora_a.weight.grad, a.grad), (layer.lora_b.weight.grad, b.grad)):
        # fp32 both, the scaling applied to another factor: equal to fp32 rounding of the largest gradient
        assert theirs.abs().max() > 0
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=2e-6 * float(theirs.abs().max()))


@pytest.mark.parametrize("shape", [(128, 128), (576, 576), (1024, 48), (300, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_by_pieces_is_torchao_to_nf4_bit_for_bit(shape, dtype):
    """quantize_nf4 works a piece at a time (bounded temporaries); any piece size gives torchao's to_nf4
    inner tensors exactly, pieces that split rows (width 576, 48) and a last short piece included."""
    torch.manual_seed(5)
    weight = torch.randn(shape, dtype=torch.float32).mul(0.05).to(dtype)
    oracle = to_nf4(weight, 64, scaler_block_size(shape))
    for piece in (64, 192, 4096, 10**9):
        nf4 = quantize_nf4(weight, piece)
        layout = (nf4.shape, nf4.dtype, nf4.stride(), nf4.scaler_block_size)
        assert layout == (oracle.shape, oracle.dtype, oracle.stride(), oracle.scaler_block_size)
        for attr in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4"):
            assert torch.equal(getattr(nf4, attr), getattr(oracle, attr)), (piece, attr)
