"""LoRA on NF4 linears, and the merge math every writer shares (fp32, one rounding at the end)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from slimtune.formats.peft import lora_scaling
from slimtune.formats.peft_config import ALL_LINEAR
from slimtune.profiler import stage
from slimtune.quant import base_rows, frozen_linear, is_bnb4, is_nf4

DEFAULT_TARGETS = (ALL_LINEAR,)


@dataclass
class LoRAConfig:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    use_rslora: bool = False
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    # Linears whose frozen weight is held in NF4 without an adapter (beyond the targets, which always are).
    quantize_modules: list[str] = field(default_factory=list)
    # Vision-language families: LoRA (on NF4) on the vision tower's linears too; by default the tower and
    # projector stay frozen in the base dtype (slimtune.vision_families).
    vision: bool = False


class LoRALinear(nn.Module):
    """y = x W^T + b + scale * dropout(x) A^T B^T, W frozen (NF4 or plain), A and B trained in fp32.
    Parameter names keep the Hugging Face layout: ``weight`` and ``bias`` sit where nn.Linear had them.
    With rank 0 it is a frozen (NF4) linear with no adapter. With ``fan_in_fan_out`` (transformers'
    Conv1D, GPT-2) the weight is stored [in, out] and y = x W + b, as PEFT's fan_in_fan_out."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        bias: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        fan_in_fan_out: bool = False,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.fan_in_fan_out = fan_in_fan_out
        shape = (in_features, out_features) if fan_in_fan_out else (out_features, in_features)
        self.rank, self.alpha, self.use_rslora = rank, alpha, use_rslora
        self.scaling = lora_scaling(rank, alpha, use_rslora) if rank else 0.0
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_a = nn.Linear(in_features, rank, bias=False, dtype=torch.float32, device=device) if rank else None
        self.lora_b = nn.Linear(rank, out_features, bias=False, dtype=torch.float32, device=device) if rank else None
        # Set only inside slimtune.checkpoint.fidelity.merged_forward: makes the merged weight round(W' + s B A).
        self.merged_weight = None

    def reset_lora_parameters(self) -> None:
        """PEFT's default: A Kaiming-uniform, B zero, so training starts from the base model."""
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged_weight is not None:
            return self._merged_forward(x)
        if self.lora_a is not None and _fused_applies(self, x):
            out = _FusedLoRALinear.apply(x, self.weight, self.lora_a.weight, self.lora_b.weight, self.scaling)
            return out if self.bias is None else out + self.bias.to(out.dtype)
        if self.fan_in_fan_out:
            out = _FanInFanOutNF4.apply(x, self.weight) if is_nf4(self.weight) else x @ self.weight.to(x.dtype)
        elif is_bnb4(self.weight):
            out = frozen_linear(x, self.weight)
        elif is_nf4(self.weight):
            from slimtune.quant.nf4 import nf4_linear  # saves the NF4 weight, not a dequantized copy, for backward

            out = nf4_linear(x, self.weight)
        else:
            out = F.linear(x, self.weight.to(x.dtype))
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        if self.lora_a is None:
            return out
        lora = self.lora_b(self.lora_a(self.dropout(x).to(torch.float32))) * self.scaling
        return out + lora.to(out.dtype)

    def _merged_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The merged checkpoint's layer: its weight (and bias) in the merged dtype, as transformers runs it."""
        w = self.merged_weight()
        bias = None if self.bias is None else self.bias.to(w.dtype)
        if self.fan_in_fan_out:  # Conv1D: x W + b
            out = x.to(w.dtype) @ w
            out = out if bias is None else out + bias
        else:
            out = F.linear(x.to(w.dtype), w, bias)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        kind = "bnb-4bit" if is_bnb4(self.weight) else "nf4" if is_nf4(self.weight) else str(self.weight.dtype)
        layout = ", fan_in_fan_out" if self.fan_in_fan_out else ""
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, alpha={self.alpha}, base={kind}{layout}"


def _fused_applies(layer: LoRALinear, x: torch.Tensor) -> bool:
    """The fused base + adapter product (``_FusedLoRALinear``) runs for a bf16 input on the CPU, in eager
    mode, for a frozen bf16 (or NF4 of bf16) [out, in] weight with fp32 adapters and no dropout; the
    composed path (its own ops, torchao's ``linear_nf4`` under torch.compile) runs otherwise."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and layer.weight.dtype == torch.bfloat16
        and layer.lora_a.weight.dtype == torch.float32
        and not layer.fan_in_fan_out
        and isinstance(layer.dropout, nn.Identity)
        and not torch.compiler.is_compiling()
    )


def _hi_lo(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 tensor as the sum of two bf16 tensors (hi + lo equals it to about 2**-16 relative)."""
    hi = t.to(torch.bfloat16)
    return hi, (t - hi.float()).to(torch.bfloat16)


class _FusedLoRALinear(torch.autograd.Function):
    """y = x W^T + s (x A^T) B^T for a bf16 x, frozen W (NF4 or bf16) and fp32 A and B, with PEFT's values
    (x W^T rounded to bf16 as ``nf4_linear`` makes it, plus the adapter term in fp32, rounded once) but no
    fp32 [tokens, out] tensor made, scaled, cast or added: the adapter term is accumulated onto x W^T by
    one bf16 matrix product (``addmm_``, fp32 accumulation, one rounding) whose inner dimension holds each
    fp32 factor split in a bf16 pair, [h, h, h'] [B, B', B]^T with h + h' = s x A^T and B + B' = B (equal
    to the fp32 product to about 2**-16). The backward gives x's gradient as PEFT's autograd does,
    round(g W) + round(s g B A) with the same split product, and A's and B's gradients in fp32. It saves
    x in bf16 and the [tokens, rank] product, not an fp32 copy of x; W is dequantized again in the
    backward, not saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float):
        rows, cols = weight.shape
        x2 = x.reshape(-1, cols)
        y = F.linear(x2, base_rows(weight, 0, rows))
        hs = F.linear(x2.float(), a).mul_(scaling)  # [tokens, rank], fp32
        h_hi, h_lo = _hi_lo(hs)
        b_hi, b_lo = _hi_lo(b)
        y.addmm_(torch.cat([h_hi, h_hi, h_lo], dim=1), torch.cat([b_hi, b_lo, b_hi], dim=1).t())
        ctx.weight, ctx.scaling = weight, scaling
        ctx.save_for_backward(x, hs, a, b)
        return y.view(*x.shape[:-1], rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, hs, a, b = ctx.saved_tensors
        rows, cols = ctx.weight.shape
        g = grad.reshape(-1, rows)
        g32 = g.float()
        grad_b = g32.t() @ hs if ctx.needs_input_grad[3] else None
        e = (g32 @ b).mul_(ctx.scaling)  # [tokens, rank], fp32
        grad_a = e.t() @ x.reshape(-1, cols).float() if ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            e_hi, e_lo = _hi_lo(e)
            a_hi, a_lo = _hi_lo(a)
            grad_x = (g @ base_rows(ctx.weight, 0, rows)).add_(torch.cat([e_hi, e_hi, e_lo], dim=1) @ torch.cat([a_hi, a_lo, a_hi]))
            grad_x = grad_x.view_as(x)
        return grad_x, None, grad_a, grad_b, None


class _FanInFanOutNF4(torch.autograd.Function):
    """x @ W for an NF4 weight stored [in, out] (Conv1D); saves the NF4 weight, not a dequantized copy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.nf4_weight = weight
        return x @ weight.get_original_weight().to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ ctx.nf4_weight.get_original_weight().to(grad.dtype).t(), None


@torch.no_grad()
def merge_lora_rows(
    base_rows: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b_rows: torch.Tensor,
    scaling: float,
    magnitude_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Merged rows in fp32: W + s * B @ A, and with DoRA m / ||W + s*B@A||_row * (W + s*B@A).
    Callers round the result once, to the output dtype."""
    with stage("merge"):
        merged = lora_b_rows.to(torch.float32) @ lora_a.to(torch.float32)
        merged.mul_(scaling).add_(base_rows)  # in place, a bf16/fp16 W upcast element by element (exact): no fp32 copy of W
        if magnitude_rows is not None:
            norm = torch.linalg.vector_norm(merged, dim=1, keepdim=True)
            merged = merged * (magnitude_rows.to(torch.float32).unsqueeze(1) / norm)
    return merged


def lora_row_merge(
    lora_a: torch.Tensor,
    lora_b: torch.Tensor | Callable[[int, int], torch.Tensor],
    scaling: float,
    transposed: bool = False,
    magnitude: torch.Tensor | None = None,
) -> Callable[[torch.Tensor, int, int], torch.Tensor]:
    """The one row merge both merges use (a live model's stream, the offline merge from files):
    ``merge(base_rows, s, e)`` -> rows [s, e) of the merged weight in fp32 (``merge_lora_rows``).
    ``lora_a`` [r, in] whole; ``lora_b`` [out, r] whole, or a reader ``(s, e) -> rows`` of a row-sharded
    B; ``magnitude`` DoRA's [out]. ``transposed``: the weight is [in, out] (Conv1D with fan_in_fan_out,
    an embedding), and rows of (B @ A)^T are A[:, s:e]^T @ B^T, so B is needed whole.

    Example: ``merge = lora_row_merge(a, b, 2.0); merge(w[0:4], 0, 4)  # == w[0:4] + 2 * b[0:4] @ a``"""
    if transposed:
        if magnitude is not None or callable(lora_b):
            raise ValueError("a transposed LoRA merge takes all of B and no DoRA magnitude")
        bt = lora_b.t().contiguous()
        return lambda w, s, e: merge_lora_rows(w, bt, lora_a[:, s:e].t(), scaling)
    b_rows = lora_b if callable(lora_b) else lambda s, e: lora_b[s:e]
    return lambda w, s, e: merge_lora_rows(w, lora_a, b_rows(s, e), scaling, None if magnitude is None else magnitude[s:e])


def qlora_linears(model: nn.Module) -> dict[str, LoRALinear]:
    """Every frozen-base linear slimtune manages, with or without an adapter."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """The linears that carry a trainable adapter."""
    return {name: m for name, m in qlora_linears(model).items() if m.lora_a is not None}


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable adapter parameters, in a stable order (optimizer state depends on it)."""
    return [p for m in lora_modules(model).values() for p in (m.lora_a.weight, m.lora_b.weight)]


def adapter_weights(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A copy of every adapter's (A, B), by module name (each rank its shards under FSDP2).

    Example: ``start = adapter_weights(model)  # before training: the frozen reference``"""
    return {n: (m.lora_a.weight.detach().clone(), m.lora_b.weight.detach().clone()) for n, m in lora_modules(model).items()}


@contextmanager
def swapped_adapters(model: nn.Module, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """The adapters hold ``weights`` (``adapter_weights``'s) inside the block and their own values, bit for
    bit, after it: a reference forward through a frozen copy of an adapter (fresh adapters, B = 0, give
    exactly the base) with no second model. Costs one copy of the adapters, never of the frozen weights.

    Example: ``with torch.no_grad(), swapped_adapters(model, start): ref = model(**inputs).logits``"""
    own = adapter_weights(model)
    modules = lora_modules(model)
    with torch.no_grad():
        for name, (a, b) in weights.items():
            modules[name].lora_a.weight.copy_(a)
            modules[name].lora_b.weight.copy_(b)
    try:
        yield
    finally:
        with torch.no_grad():
            for name, (a, b) in own.items():
                modules[name].lora_a.weight.copy_(a)
                modules[name].lora_b.weight.copy_(b)
