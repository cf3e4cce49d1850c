"""Synthetic models of real shapes, for the benchmarks and the tests: presets (tiny, Llama 3.2 1B, Llama 3
8B, Mixtral widths), a QLoRA model built in memory (random NF4 codes and scalers, no slow quantization),
and a random bf16 base, bitsandbytes 4-bit base and PEFT adapter written through ``write_checkpoint`` (with
manifests).

Example::

    config = preset_config("llama3.2-1b", num_hidden_layers=2)
    write_synthetic_base(config, Path("out/base"))
    write_synthetic_adapter(config, Path("out/adapter"))
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig

from slimtune.checkpoint.save import CheckpointParts, write_checkpoint
from slimtune.checkpoint.stream import adapter_tensor_stream
from slimtune.checkpoint.writer import WriteOptions
from slimtune.facts import facts_of
from slimtune.formats.hf import export_config_dict
from slimtune.formats.peft_config import adapter_config_dict
from slimtune.lora import DEFAULT_TARGETS, LoRAConfig, lora_modules, qlora_linears
from slimtune.memory import DEFAULT_SHARD_SIZE
from slimtune.model import build_qlora_skeleton, expected_checkpoint_keys, init_lora, set_tensor
from slimtune.quant.nf4 import BLOCK_SIZE, nf4_from_parts, scaler_block_size
from slimtune.tensors import StreamTensor
from slimtune.tiny import tiny_llama_config

_LLAMA3 = dict(vocab_size=128256, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096)
PRESETS = {
    "tiny": dict(),
    "llama3.2-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, tie_word_embeddings=True),
    "llama3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, tie_word_embeddings=False),
}

# Vision-language shapes (transformers' published configs): the language model's layers are what
# ``num_hidden_layers`` overrides; the vision tower stays whole.
VISION_PRESETS = {
    "qwen2.5-vl-7b": dict(
        model_type="qwen2_5_vl",
        text_config=dict(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
            num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6,
            rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, rope_theta=1000000.0,
        ),
        vision_config=dict(
            depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14,
            spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
        ),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        tie_word_embeddings=False,
    ),
}  # fmt: skip

BENCH_LORA = LoRAConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj"], quantize_modules=list(DEFAULT_TARGETS))


def preset_config(name: str, **overrides) -> LlamaConfig:
    """The config of a preset (``tiny``, ``llama3.2-1b``, ``llama3-8b``: Llama; ``qwen2.5-vl-7b``: a
    vision-language model, the overrides applied to its language model), fields overridden.

    Example: ``preset_config("llama3-8b", num_hidden_layers=4)``"""
    if name in VISION_PRESETS:
        return _vision_preset_config(name, **overrides)
    if name not in PRESETS:
        raise SystemExit(f"unknown preset {name!r}; choose from {sorted(PRESETS | VISION_PRESETS)}")
    overrides = {"architectures": ["LlamaForCausalLM"], **overrides}  # as a real checkpoint names it (llama.cpp's converter reads it)
    if name == "tiny":
        return tiny_llama_config(**overrides)
    return LlamaConfig(
        **{**PRESETS[name], "dtype": "bfloat16", "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, **overrides}
    )


def _vision_preset_config(name: str, **overrides):
    """A vision-language preset's config: ``num_hidden_layers`` (and any other override) goes to the
    language model's config."""
    from transformers import AutoConfig

    values = dict(VISION_PRESETS[name])
    text = dict(values.pop("text_config"), **overrides)
    return AutoConfig.for_model(values.pop("model_type"), text_config=text, dtype="bfloat16", **values)


def synthetic_nf4(shape: tuple[int, int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random codes and scalers with torchao's layout: no slow quantization of a random bf16 weight."""
    numel = shape[0] * shape[1]
    n_blocks = numel // BLOCK_SIZE
    data = torch.randint(0, 256, (numel // 2,), dtype=torch.uint8, generator=gen)
    scalers = torch.randint(-128, 128, (n_blocks,), dtype=torch.int8, generator=gen)
    factor = (torch.rand(n_blocks // scaler_block_size(shape), generator=gen) * 1000 + 1000).to(dtype)
    mean = torch.tensor(0.02, dtype=dtype)
    return nf4_from_parts(shape, dtype, data, scalers, factor, mean)


def synthetic_qlora_model(config: LlamaConfig, lora: LoRAConfig = BENCH_LORA, seed: int = 0) -> torch.nn.Module:
    """A QLoRA model of the config's shape without a checkpoint: random NF4 codes and scalers for every
    projection, random bf16 embeddings, norms of ones, a trained-looking adapter (B non-zero).

    Example: ``model = synthetic_qlora_model(preset_config("tiny"))``"""
    model = build_qlora_skeleton(config, lora)
    gen = torch.Generator().manual_seed(seed)
    nf4_keys = {f"{n}.weight" for n in qlora_linears(model)}
    params = {p.key: p.param for p in facts_of(model).layout if p.whole}  # a vision model's names differ from the file's
    for key, (shape, dtype) in expected_checkpoint_keys(model).items():
        key = params.get(key, key)
        if key in nf4_keys:
            value = synthetic_nf4(tuple(shape), dtype, gen)
        elif len(shape) == 1:
            value = torch.ones(shape, dtype=dtype)
        else:
            value = (
                (torch.randn(shape, generator=gen, dtype=torch.float32) * 0.02).to(dtype)
                if shape.numel() < 2**26
                else _random_bf16_rows(shape, dtype, gen)
            )
        set_tensor(model, key, value)
    if getattr(config, "tie_word_embeddings", False):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    init_lora(model, seed)
    for m in lora_modules(model).values():  # a trained adapter: B non-zero so the merge does real work
        torch.nn.init.normal_(m.lora_b.weight, std=0.01, generator=gen)
    return model


def _random_bf16_rows(shape: torch.Size, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Fill a large tensor in row blocks so no fp32 copy of it is ever held."""
    out = torch.empty(shape, dtype=dtype)
    step = max(1, 2**24 // shape[1])
    for i in range(0, shape[0], step):
        out[i : i + step] = torch.randn((min(step, shape[0] - i), shape[1]), generator=gen) * 0.02
    return out


def write_synthetic_base(config: LlamaConfig, out_dir: Path, max_shard_size: str = DEFAULT_SHARD_SIZE, seed: int = 0) -> Path:
    """A random bf16 Hugging Face checkpoint of the config's shape, streamed to disk chunk by chunk by
    ``write_checkpoint`` (so it has a manifest: a complete one is reused by the merge bench).

    Example: ``write_synthetic_base(preset_config("llama3.2-1b", num_hidden_layers=2), Path("out/base"))``"""

    skeleton = build_qlora_skeleton(config, LoRAConfig(target_modules=[], quantize_modules=[]))

    def random_rows(index: int, shape: torch.Size, dtype: torch.dtype):
        def rows(start: int, end: int) -> torch.Tensor:
            if len(shape) == 1:
                return torch.ones(end - start, dtype=dtype)
            gen = torch.Generator().manual_seed(seed * 1_000_003 + index * 65_537 + start)
            return (torch.randn((end - start, *shape[1:]), generator=gen) * 0.02).to(dtype)

        return rows

    stream = [
        StreamTensor(name, tuple(shape), dtype, random_rows(i, shape, dtype))
        for i, (name, (shape, dtype)) in enumerate(expected_checkpoint_keys(skeleton).items())
    ]
    parts = CheckpointParts(merged=stream, config=export_config_dict(config, stream), manifest_extra={"kind": "synthetic-base"})
    write_checkpoint(out_dir, parts, WriteOptions(max_shard_size=max_shard_size, overwrite=True))
    return out_dir


# bitsandbytes' NF4 code values (bitsandbytes.functional.get_4bit_type("nf4"), as its checkpoints store quant_map)
BNB_NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635, -0.18477343022823334,
    -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip


def write_synthetic_bnb_base(config: LlamaConfig, out_dir: Path, max_shard_size: str = DEFAULT_SHARD_SIZE, seed: int = 0) -> Path:
    """A random bitsandbytes 4-bit checkpoint of the config's shape, as transformers' save_pretrained lays
    one out (``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)``):
    every decoder linear as packed u8 codes, u8 absmax codes with their nested state, its quant_map and
    quant state; embeddings, norms and an untied lm_head random bf16. Streamed by ``write_checkpoint``.

    Example: ``write_synthetic_bnb_base(preset_config("llama3.2-1b"), Path("out/bnb"))``"""
    import json

    skeleton = build_qlora_skeleton(config, LoRAConfig(target_modules=[], quantize_modules=[]))
    four_bit = {f"{name}.weight" for name in qlora_linears(build_qlora_skeleton(config, LoRAConfig(target_modules=list(DEFAULT_TARGETS))))}
    stream = []
    for i, (name, (shape, dtype)) in enumerate(expected_checkpoint_keys(skeleton).items()):
        if name not in four_bit:
            stream.append(StreamTensor(name, tuple(shape), dtype, _random_rows(seed * 1_000_003 + i * 65_537, shape, dtype)))
            continue
        numel, blocks = shape[0] * shape[1], -(-shape[0] * shape[1] // BLOCK_SIZE)
        state = {"quant_type": "nf4", "absmax": [], "blocksize": BLOCK_SIZE, "quant_map": [], "dtype": "bfloat16", "shape": list(shape)}
        state.update(nested_blocksize=256, nested_offset=0.01, nested_dtype="float32")
        state_bytes = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
        small = {
            ".absmax": _random_rows(i, (blocks,), torch.uint8),
            ".nested_absmax": lambda s, e: torch.full((e - s,), 0.01),
            ".nested_quant_map": lambda s, e: torch.linspace(-1, 1, 256)[s:e],
            ".quant_map": lambda s, e: torch.tensor(BNB_NF4_CODE)[s:e],
            ".quant_state.bitsandbytes__nf4": lambda s, e, b=state_bytes: b[s:e],
        }
        lengths = {".absmax": blocks, ".nested_absmax": -(-blocks // 256), ".nested_quant_map": 256, ".quant_map": 16}
        lengths[".quant_state.bitsandbytes__nf4"] = state_bytes.numel()
        stream.append(StreamTensor(name, ((numel + 1) // 2, 1), torch.uint8, _random_rows(seed + i, ((numel + 1) // 2, 1), torch.uint8)))
        for suffix, rows in small.items():
            dtype = torch.uint8 if suffix in (".absmax", ".quant_state.bitsandbytes__nf4") else torch.float32
            stream.append(StreamTensor(name + suffix, (lengths[suffix],), dtype, rows))
    quantization = {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False, "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8",
        "llm_int8_skip_modules": ["lm_head"],
    }  # fmt: skip
    hf_config = export_config_dict(config, stream) | {"quantization_config": quantization, "dtype": "bfloat16", "torch_dtype": "bfloat16"}
    parts = CheckpointParts(merged=stream, config=hf_config, manifest_extra={"kind": "synthetic-bnb-base"})
    write_checkpoint(out_dir, parts, WriteOptions(max_shard_size=max_shard_size, overwrite=True))
    return out_dir


def _random_rows(seed: int, shape: tuple[int, ...], dtype: torch.dtype):
    """Rows of a random tensor, each chunk from its own seed: floats N(0, 0.02) (norms ones), bytes uniform."""

    def rows(start: int, end: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed + start)
        if dtype == torch.uint8:
            return torch.randint(0, 256, (end - start, *shape[1:]), dtype=torch.uint8, generator=gen)
        if len(shape) == 1:
            return torch.ones(end - start, dtype=dtype)
        return (torch.randn((end - start, *shape[1:]), generator=gen) * 0.02).to(dtype)

    return rows


def write_synthetic_adapter(config: LlamaConfig, out_dir: Path, rank: int = 8, seed: int = 0) -> Path:
    """A PEFT-format LoRA adapter (r=8 on q_proj and v_proj, random A and B) for a base of this shape, in
    ``out_dir/adapter/`` of a checkpoint with a manifest (``slimtune merge --adapter out_dir`` reads it).

    Example: ``write_synthetic_adapter(preset_config("tiny"), Path("out/adapter"))``"""

    lora = LoRAConfig(rank=rank, alpha=2 * rank, target_modules=["q_proj", "v_proj"])
    model = build_qlora_skeleton(config, lora)
    init_lora(model, seed)
    gen = torch.Generator().manual_seed(seed)
    for m in lora_modules(model).values():
        torch.nn.init.normal_(m.lora_b.weight, std=0.01, generator=gen)
    parts = CheckpointParts(
        merged=[],
        adapter=adapter_tensor_stream(model),
        adapter_config=adapter_config_dict(lora_modules(model), "synthetic"),
        manifest_extra={"kind": "synthetic-adapter"},
    )
    write_checkpoint(out_dir, parts, WriteOptions(overwrite=True, progress=False))
    return out_dir


MIXTRAL_WIDTHS = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
)
