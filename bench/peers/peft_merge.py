"""The usual offline LoRA merge with Hugging Face PEFT, measured the way bench merge measures its own.

Runs in bench/peers/.venv-peft (see run_peers.sh). Prints one JSON line.

    bench/peers/.venv-peft/bin/python bench/peers/peft_merge.py --base DIR/base-llama3-8b-8l --adapter DIR/adapter-llama3-8b-8l --out DIR

On the base + adapter files that ``python -m bench merge`` writes (run that first). In a child process:
``AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)``, ``PeftModel.from_pretrained``,
``merge_and_unload()``, ``save_pretrained(out, max_shard_size="5GB")``. Peak RSS is the child's max RSS
(ru_maxrss, what /usr/bin/time -v reports, as bench merge reads it), bytes written its wchar,
seconds the whole load + merge + save (no fsync: save_pretrained does not fsync; the fsync of the output
afterwards is timed separately, slimtune's merge fsyncs before it returns)."""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import RssSampler, disk_write_mb_s, fsync_tree, io_counter, tree_bytes  # noqa: E402


def child(base: str, adapter: str, out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import transformers
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    r0, w0 = io_counter("rchar"), io_counter("wchar")
    with RssSampler() as sampler:
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
        t1 = time.perf_counter()
        if (Path(adapter) / "adapter" / "adapter_config.json").is_file():  # slimtune.synthetic writes a checkpoint holding adapter/
            adapter = str(Path(adapter) / "adapter")
        model = PeftModel.from_pretrained(model, adapter)
        model = model.merge_and_unload()
        t2 = time.perf_counter()
        model.save_pretrained(out, max_shard_size="5GB")
        t3 = time.perf_counter()
    stats = {
        "load_s": t1 - t0,
        "peft_merge_s": t2 - t1,
        "save_s": t3 - t2,
        "merge_s": t3 - t0,
        "bytes_read": io_counter("rchar") - r0,
        "bytes_written": io_counter("wchar") - w0,
        "sampled_peak_rss_anon_mb": sampler.max_anon_kb / 1024,
        "sampled_peak_rss_file_mb": sampler.max_file_kb / 1024,
    }
    print(json.dumps(stats), flush=True)


def preset_label(tag: str) -> str:
    """'llama3-8b-8l' (bench merge's folder tag) -> 'llama3-8b[8 layers]' (its JSON's preset)."""
    name, _, last = tag.rpartition("-")
    return f"{name}[{last[:-1]} layers]" if name and last.endswith("l") and last[:-1].isdigit() else tag


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--adapter", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="a folder for the merged model (removed after)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(str(args.base), str(args.adapter), str(args.out))
        return

    from importlib.metadata import version

    merged = args.out / f"peft-merged-{args.base.name.removeprefix('base-')}"
    shutil.rmtree(merged, ignore_errors=True)
    base_bytes = sum(p.stat().st_size for p in args.base.glob("*.safetensors"))
    disk = disk_write_mb_s(args.out, min(base_bytes, 2 * 1024**3))
    cmd = [sys.executable, __file__, "--child", "--base", str(args.base), "--adapter", str(args.adapter), "--out", str(merged)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode:
        raise SystemExit(f"peft merge child failed with exit code {proc.returncode}")
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    fsync_s = fsync_tree(merged)
    output_bytes = tree_bytes(merged)
    shutil.rmtree(merged, ignore_errors=True)
    write_mb_s = stats["bytes_written"] / stats["merge_s"] / 1e6
    print(
        json.dumps(
            {
                "tool": "peft",
                "preset": preset_label(args.base.name.removeprefix("base-")),
                "base_bytes": base_bytes,
                "output_bytes": output_bytes,
                "bytes_read": stats["bytes_read"],
                "bytes_written": stats["bytes_written"],
                "merge_s": round(stats["merge_s"], 3),
                "load_s": round(stats["load_s"], 3),
                "peft_merge_s": round(stats["peft_merge_s"], 3),
                "save_s": round(stats["save_s"], 3),
                "fsync_s": round(fsync_s, 3),
                "write_mb_s": round(write_mb_s, 1),
                "disk_mb_s": round(disk, 1),
                "ratio": round(write_mb_s / disk, 3),
                "ratio_with_fsync": round(stats["bytes_written"] / (stats["merge_s"] + fsync_s) / 1e6 / disk, 3),
                "peak_rss_mb": round(peak_kb / 1024, 1),
                "sampled_peak_rss_anon_mb": round(stats["sampled_peak_rss_anon_mb"], 1),
                "sampled_peak_rss_file_mb": round(stats["sampled_peak_rss_file_mb"], 1),
                "versions": {name: version(name) for name in ("torch", "transformers", "peft", "safetensors")},
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
