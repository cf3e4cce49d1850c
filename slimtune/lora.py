"""LoRA on NF4 linears, and the merge math every writer shares (fp32, one rounding at the end)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from slimtune.checkpoint.stages import stage
from slimtune.quant import is_nf4

ALL_LINEAR = "all-linear"  # PEFT's convention: every linear layer except the output head, resolved per family
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


def lora_scaling(rank: int, alpha: float, use_rslora: bool) -> float:
    """alpha / r, or alpha / sqrt(r) with rsLoRA (rank-stabilised)."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


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
        if self.fan_in_fan_out:
            out = _FanInFanOutNF4.apply(x, self.weight) if is_nf4(self.weight) else x @ self.weight.to(x.dtype)
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
        kind = "nf4" if is_nf4(self.weight) else str(self.weight.dtype)
        layout = ", fan_in_fan_out" if self.fan_in_fan_out else ""
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, alpha={self.alpha}, base={kind}{layout}"


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
        merged.mul_(scaling).add_(base_rows.to(torch.float32))  # in place: one fp32 temporary less per chunk
        if magnitude_rows is not None:
            norm = torch.linalg.vector_norm(merged, dim=1, keepdim=True)
            merged = merged * (magnitude_rows.to(torch.float32).unsqueeze(1) / norm)
    return merged


def qlora_linears(model: nn.Module) -> dict[str, LoRALinear]:
    """Every frozen-base linear slimtune manages, with or without an adapter."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """The linears that carry a trainable adapter."""
    return {name: m for name, m in qlora_linears(model).items() if m.lora_a is not None}


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable adapter parameters, in a stable order (optimizer state depends on it)."""
    return [p for m in lora_modules(model).values() for p in (m.lora_a.weight, m.lora_b.weight)]
