"""torchtune 0.6.1's QLoRA merged save, measured the way bench/ measures its own save.

Runs in bench/peers/.venv-torchtune (see run_peers.sh). Prints one JSON line.

    bench/peers/.venv-torchtune/bin/python bench/peers/torchtune_save.py --preset llama3-8b --layers 8 --out DIR [--low-cpu-ram]

What is torchtune's own code here, as in recipes/lora_finetune_single_device.py:
- the model: ``torchtune.models.llama3_2.lora_llama3_2`` (llama3.2-1b shape, tied embeddings) or
  ``torchtune.models.llama3.lora_llama3`` (llama3-8b shape) with quantize_base=True, LoRA r=8 alpha=16 on
  q_proj and v_proj, the builders registering their NF4->bf16 state-dict post hook;
- ``low_cpu_ram``: the recipe sets ``torchtune.modules.common_utils._use_low_cpu_ram = cfg.low_cpu_ram``
  before it builds the model, and the builder's ``_register_reparametrize_state_dict_hooks`` picks
  ``_low_ram_reparametrize_as_dtype_state_dict_post_hook`` (FakeTensor + a MAP_SHARED mmap of
  /tmp/fake_state_dict.pt) or the plain ``reparametrize_as_dtype_state_dict_post_hook``; this script does
  exactly that and reports which hook the model carries;
- the save: the body of ``LoRAFinetuneRecipeSingleDevice.save_checkpoint`` for the final epoch
  (``get_adapter_state_dict(model.state_dict())``, ``{k: v.cpu() for k, v in model.state_dict().items()}``,
  ``get_merged_lora_ckpt``) and then ``FullModelMetaCheckpointer.save_checkpoint`` (the checkpointer of
  torchtune's llama3 8B QLoRA config): ``tune_to_meta`` and ``torch.save`` of the merged model and the adapter.

What is not: to skip quantizing random weights (slow on 2 cores), the model is built on the meta device
with ``to_nf4`` replaced, during the build only, by NF4Tensors made directly from random codes and
scalers (torchao's layout, as bench/ does); embeddings random, norms ones, lora_b random (a trained
adapter, so the merge does real work). The save path is untouched.

Figures: peak RSS is VmHWM, reset (echo 5 > /proc/self/clear_refs) after the model is built; RSS before;
bytes written = wchar across the save; seconds of the save as torchtune does it (no fsync), and the
seconds an fsync of the written files takes afterwards (slimtune's save fsyncs before it returns);
RssAnon/RssFile peaks sampled every 20 ms (mmap'd file pages count in VmHWM)."""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from measure import RssSampler, disk_write_mb_s, fsync_tree, io_counter, peak_rss_mb, reset_peak_rss, rss_mb, tree_bytes  # noqa: E402
from torch import nn  # noqa: E402

PRESETS = {
    # the same shapes as slimtune.synthetic.PRESETS
    "llama3.2-1b": dict(
        builder="llama3_2",
        model_type="LLAMA3_2",
        vocab_size=128256,
        embed_dim=2048,
        intermediate_dim=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
    ),
    "llama3-8b": dict(
        builder="llama3",
        model_type="LLAMA3",
        vocab_size=128256,
        embed_dim=4096,
        intermediate_dim=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
    ),
}
RANK, ALPHA = 8, 16
TARGETS = ["q_proj", "v_proj"]
TMP_LOW_RAM_FILE = Path("/tmp/fake_state_dict.pt")  # hard-coded in torchtune's low-RAM hook


def synthetic_to_nf4(gen: torch.Generator):
    from torchao.dtypes.nf4tensor import NF4Tensor, SubclassTensorArgs, to_nf4

    lut = to_nf4(torch.zeros(64 * 256, dtype=torch.bfloat16, device="cpu").view(1, -1)).nf4

    def make(tensor: torch.Tensor, block_size: int = 64, scaler_block_size: int = 256) -> NF4Tensor:
        shape, dtype = tuple(tensor.shape), tensor.dtype
        numel = shape[0] * shape[1]
        n_blocks = numel // block_size
        data = torch.randint(0, 256, (numel // 2,), dtype=torch.uint8, generator=gen, device="cpu")
        scalers = torch.randint(-128, 128, (n_blocks,), dtype=torch.int8, generator=gen, device="cpu")
        factor = (torch.rand(n_blocks // scaler_block_size, generator=gen, device="cpu") * 1000 + 1000).to(dtype)
        mean = torch.tensor(0.02, dtype=dtype, device="cpu")
        meta = SubclassTensorArgs(torch.Size(shape), (shape[1], 1), 0, dtype, torch.device("cpu"), False)
        return NF4Tensor(meta, block_size, n_blocks, scaler_block_size, scalers, factor, mean, data, lut.to(dtype))

    return make


def random_bf16(shape: torch.Size, gen: torch.Generator, std: float = 0.02) -> torch.Tensor:
    out = torch.empty(shape, dtype=torch.bfloat16)
    if len(shape) == 1:
        return out.fill_(1.0)
    step = max(1, 2**24 // shape[1])
    for i in range(0, shape[0], step):
        out[i : i + step] = torch.randn((min(step, shape[0] - i), shape[1]), generator=gen) * std
    return out


def build_model(preset: str, layers: int | None, seed: int = 0) -> nn.Module:
    import torchtune.modules.low_precision.nf4_linear as nf4_linear
    import torchtune.modules.peft.lora as lora
    from torchtune import training
    from torchtune.models.llama3 import lora_llama3
    from torchtune.models.llama3_2 import lora_llama3_2

    p = PRESETS[preset]
    kwargs = dict(
        lora_attn_modules=TARGETS,
        apply_lora_to_mlp=False,
        apply_lora_to_output=False,
        vocab_size=p["vocab_size"],
        num_layers=layers or p["num_layers"],
        num_heads=p["num_heads"],
        num_kv_heads=p["num_kv_heads"],
        embed_dim=p["embed_dim"],
        max_seq_len=4096,
        intermediate_dim=p["intermediate_dim"],
        rope_base=500_000,
        lora_rank=RANK,
        lora_alpha=ALPHA,
        quantize_base=True,
    )
    gen = torch.Generator().manual_seed(seed)
    fake = synthetic_to_nf4(gen)
    saved = lora.to_nf4, nf4_linear.to_nf4
    lora.to_nf4 = nf4_linear.to_nf4 = fake
    try:
        with training.set_default_dtype(torch.bfloat16), torch.device("meta"):
            if p["builder"] == "llama3_2":
                model = lora_llama3_2(**kwargs, tie_word_embeddings=True)
            else:
                model = lora_llama3(**kwargs)
    finally:
        lora.to_nf4, nf4_linear.to_nf4 = saved
    for name, module in model.named_modules():
        for pname, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if name.endswith("lora_a"):
                value = torch.empty(param.shape, dtype=torch.bfloat16)
                nn.init.kaiming_uniform_(value, a=5**0.5, generator=gen)
            elif name.endswith("lora_b"):
                value = random_bf16(param.shape, gen, std=0.01)
            else:
                value = random_bf16(param.shape, gen)
            module._parameters[pname] = nn.Parameter(value, requires_grad=param.requires_grad)
        for bname, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                module._buffers[bname] = torch.empty_like(buf, device="cpu")
    for module in model.modules():
        if hasattr(module, "rope_init"):
            module.rope_init()
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftover:
        raise RuntimeError(f"tensors left on meta: {leftover[:5]}")
    return model


def recipe_save(model: nn.Module, checkpointer, preset: str) -> None:
    """LoRAFinetuneRecipeSingleDevice.save_checkpoint (torchtune 0.6.1) for the final epoch, lines as there."""
    from torchtune import training
    from torchtune.modules.peft import get_adapter_state_dict, get_lora_module_names, get_merged_lora_ckpt

    ckpt_dict = {}
    adapter_state_dict = get_adapter_state_dict(model.state_dict())
    ckpt_dict.update({training.ADAPTER_KEY: adapter_state_dict})
    state_dict = {k: v.cpu() for k, v in model.state_dict().items()}
    merged_state_dict = get_merged_lora_ckpt(state_dict, rank=RANK, alpha=ALPHA)
    ckpt_dict.update({training.MODEL_KEY: merged_state_dict})
    adapter_config = {
        "r": RANK,
        "lora_alpha": ALPHA,
        "target_modules": get_lora_module_names(TARGETS, False, False),
        "peft_type": "LORA",
    }
    ckpt_dict.update({training.ADAPTER_CONFIG: adapter_config})
    checkpointer.save_checkpoint(ckpt_dict, epoch=0, intermediate_checkpoint=False, adapter_only=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--low-cpu-ram", action="store_true", help="the recipe's low_cpu_ram: True")
    args = parser.parse_args()

    from torchtune.modules import common_utils
    from torchtune.training import FullModelMetaCheckpointer

    # recipes/lora_finetune_single_device.py: "hack to toggle to the low cpu ram version of the
    # reparametrize_as_dtype hook based on the config", set before the model is built
    common_utils._use_low_cpu_ram = args.low_cpu_ram

    t0 = time.perf_counter()
    model = build_model(args.preset, args.layers)
    build_s = time.perf_counter() - t0
    hooks = sorted({getattr(h, "func", h).__name__ for h in model._state_dict_hooks.values()})
    params = sum(p.numel() for p in model.parameters())
    bf16_bytes = sum(p.numel() for n, p in model.named_parameters() if ".lora_" not in n) * 2

    tag = args.preset + (f"-{args.layers}l" if args.layers else "") + ("-lowram" if args.low_cpu_ram else "")
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt_in, ckpt_out = args.out / f"torchtune-in-{tag}", args.out / f"torchtune-out-{tag}"
    shutil.rmtree(ckpt_out, ignore_errors=True)
    ckpt_in.mkdir(exist_ok=True)  # the checkpointer copies this folder's non-weight files into its output
    (ckpt_in / "consolidated.00.pth").touch()  # it checks the (unread here) input file exists
    checkpointer = FullModelMetaCheckpointer(
        checkpoint_dir=str(ckpt_in),
        checkpoint_files=["consolidated.00.pth"],
        model_type=PRESETS[args.preset]["model_type"],
        output_dir=str(ckpt_out),
    )
    disk = disk_write_mb_s(args.out, min(bf16_bytes, 2 * 1024**3))
    TMP_LOW_RAM_FILE.unlink(missing_ok=True)

    gc.collect()
    before = rss_mb()
    reset_peak_rss()
    wchar0, wbytes0 = io_counter("wchar"), io_counter("write_bytes")
    with RssSampler() as sampler:
        start = time.perf_counter()
        recipe_save(model, checkpointer, args.preset)
        save_s = time.perf_counter() - start
    written, block_written = io_counter("wchar") - wchar0, io_counter("write_bytes") - wbytes0
    peak = peak_rss_mb()
    fsync_s = fsync_tree(ckpt_out)
    output_bytes = tree_bytes(ckpt_out)
    tmp_bytes = TMP_LOW_RAM_FILE.stat().st_size if TMP_LOW_RAM_FILE.exists() else 0
    write_mb_s = output_bytes / save_s / 1e6
    result = {
        "tool": "torchtune",
        "preset": args.preset + (f"[{args.layers} layers]" if args.layers else ""),
        "low_cpu_ram": args.low_cpu_ram,
        "state_dict_hook": hooks,
        "params": params,
        "bf16_bytes": bf16_bytes,
        "output_bytes": output_bytes,
        "bytes_written": written,
        "block_write_bytes": block_written,
        "tmp_file_bytes": tmp_bytes,
        "save_s": round(save_s, 3),
        "fsync_s": round(fsync_s, 3),
        "write_mb_s": round(write_mb_s, 1),
        "disk_mb_s": round(disk, 1),
        "ratio": round(write_mb_s / disk, 3),
        "ratio_with_fsync": round(output_bytes / (save_s + fsync_s) / 1e6 / disk, 3),
        "rss_before_mb": round(before, 1),
        "peak_rss_mb": round(peak, 1),
        "overhead_mb": round(peak - before, 1),
        "sampled_peak_rss_anon_mb": round(sampler.max_anon_kb / 1024, 1),
        "sampled_peak_rss_file_mb": round(sampler.max_file_kb / 1024, 1),
        "build_s": round(build_s, 1),
        "versions": {"torch": torch.__version__, "torchao": _version("torchao"), "torchtune": _version("torchtune")},
    }
    shutil.rmtree(ckpt_out, ignore_errors=True)
    shutil.rmtree(ckpt_in, ignore_errors=True)
    TMP_LOW_RAM_FILE.unlink(missing_ok=True)  # torchtune leaves its full-size bf16 scratch file behind
    print(json.dumps(result), flush=True)


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    main()
