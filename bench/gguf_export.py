"""``python -m bench gguf``: the streamed GGUF export of a synthetic base + adapter, merged on the fly, in a
fresh child process (bench/gguf_child.py); ``--peer llama.cpp``: ``slimtune merge`` + llama.cpp's own
convert_hf_to_gguf.py on the same files beside it (bench/peers/llama_cpp_convert.sh), and for a K-quant
mix (q4_k_m, ...) llama.cpp's route to it: merge, convert to f16, then ``llama_model_quantize`` with
``PEER_QUANTIZE_THREADS`` threads (bench/llama_quantize_child.py), each stage timed in its own process."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from bench.common import disk_write_mb_s, real_model_dir, run_child, synthetic_base_and_adapter
from bench.floors import floors, ratio_floor
from bench.merge import merge_in_child
from slimtune.gguf.mix import MIXES
from slimtune.tiny import byte_tokenizer


def _default_gguf_tokenizer() -> Path:
    """SmolLM2's tokenizer from the real model's cache (`make real-model`), else the byte-level tokenizer."""
    if (real_model_dir() / "tokenizer.json").is_file():
        return real_model_dir()
    fallback = Path(tempfile.mkdtemp(prefix="slimtune-bench-tok-"))
    byte_tokenizer().save_pretrained(str(fallback))
    return fallback


def _tokenizer_vocab(tokenizer: Path) -> int:
    """One past the tokenizer's highest token id: the embedding rows the synthetic base needs."""
    from transformers import AutoTokenizer  # heavy, and only the GGUF bench needs it

    return max(AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True).get_vocab().values()) + 1


def _gguf_in_child(base: Path, adapter: Path, target: Path, qtype: str, verify: bool = True) -> dict:
    """slimtune's GGUF export in a fresh child process: its figures (bench/gguf_child.py); the file stays."""
    return run_child("bench.gguf_child", str(base), str(adapter), str(target), qtype, str(verify), what="GGUF export")


LLAMA_CPP_PEER = Path(__file__).resolve().parent / "peers" / "llama_cpp_convert.sh"
LLAMA_CPP_TYPES = ("f32", "f16", "bf16", "q8_0")  # what convert_hf_to_gguf.py writes
PEER_QUANTIZE_THREADS = 2  # llama_model_quantize's nthread on the peer route: this machine's core count


def _check_llama_cpp_peer(peer: str, qtype: str) -> None:
    """Before anything is written: the peer, its type and its script exist."""
    if peer != "llama.cpp":
        raise SystemExit(f"--peer {peer}: the one GGUF peer is llama.cpp")
    if qtype not in LLAMA_CPP_TYPES and qtype not in MIXES:
        raise SystemExit(
            f"--peer llama.cpp --type {qtype}: convert_hf_to_gguf.py writes {', '.join(LLAMA_CPP_TYPES)}, "
            f"llama_model_quantize the mixes {', '.join(MIXES)}"
        )
    if not LLAMA_CPP_PEER.is_file():
        raise SystemExit(f"--peer llama.cpp: {LLAMA_CPP_PEER} is missing")


def _llama_cpp_peer(base: Path, adapter: Path, out: Path, tag: str, qtype: str) -> dict:
    """The merge-then-convert path: ``slimtune merge`` of the same base + adapter (timed: the peer needs
    it), then llama.cpp's convert_hf_to_gguf.py on the merged checkpoint (bench/peers/llama_cpp_convert.sh,
    its own venv, lazy mode, /usr/bin/time -v); for a mix, convert to f16 and ``llama_model_quantize`` it
    (``PEER_QUANTIZE_THREADS``). The disk space the route needs: the merged checkpoint beside the f16 file
    while the converter runs, then the f16 file beside the quantized one (each removed once the next
    stage has read it). Everything the peer wrote is removed."""
    convert_type = "f16" if qtype in MIXES else qtype
    merged, target = out / f"merged-{tag}", out / f"{tag}-{convert_type}-llama.cpp.gguf"
    quantized = out / f"{tag}-{qtype}-llama.cpp.gguf"
    quantize = None
    try:
        merge = merge_in_child(base, adapter, merged)
        merged_bytes = sum(p.stat().st_size for p in merged.rglob("*") if p.is_file())
        peer = subprocess.run(["bash", str(LLAMA_CPP_PEER), str(merged), str(target), convert_type], stdout=subprocess.PIPE, text=True)
        if peer.returncode:
            raise SystemExit(f"{LLAMA_CPP_PEER.name} failed with exit code {peer.returncode}")
        stats = json.loads(peer.stdout.strip().splitlines()[-1])
        disk = merged_bytes + stats["file_bytes"]
        if qtype in MIXES:
            shutil.rmtree(merged, ignore_errors=True)
            quantize = run_child(
                "bench.llama_quantize_child", str(target), str(quantized), qtype, str(PEER_QUANTIZE_THREADS), what="llama_model_quantize"
            )
            quantize["file_bytes"] = quantized.stat().st_size
            disk = max(disk, stats["file_bytes"] + quantize["file_bytes"])
    finally:
        shutil.rmtree(merged, ignore_errors=True)
        target.unlink(missing_ok=True)
        quantized.unlink(missing_ok=True)
    total = merge["merge_s"] + stats["seconds"] + (quantize["quantize_s"] if quantize else 0.0)
    stages = {}
    if quantize is not None:
        stages = {
            "peer_quantize_s": round(quantize["quantize_s"], 2),
            "peer_quantize_threads": PEER_QUANTIZE_THREADS,
            "peer_quantize_peak_rss_mb": round(quantize["peak_rss_mb"], 1),
            "peer_quantized_bytes": quantize["file_bytes"],
        }
    return {
        "merge_s": round(merge["merge_s"], 2),
        "merge_peak_rss_mb": round(merge["peak_rss_mb"], 1),
        "merged_bytes": merge["output_bytes"],
        "peer": stats["peer"],
        "peer_llama_cpp_commit": stats["llama_cpp_commit"],
        "peer_lazy": stats["lazy"],
        "peer_s": stats["seconds"],
        "peer_peak_rss_mb": stats["peak_rss_mb"],
        "peer_file_bytes": stats["file_bytes"],
        **stages,
        "peer_disk_bytes": disk,
        "merge_plus_peer_s": round(total, 2),  # every stage of the route
    }


def bench_gguf(
    preset: str,
    out: Path,
    qtype: str,
    layers: int | None = None,
    tokenizer: Path | None = None,
    peer: str | None = None,
    verify: bool = True,
) -> dict:
    """GGUF export of a synthetic base + adapter (made once under ``out``, reused), merged on the fly, in a
    fresh child process that reports its peak RSS over its own baseline (RSS after imports, peak reset
    with clear_refs), the bytes it wrote and the file's size; the disk's sequential write speed is
    measured in the same run. ``tokenizer``: a directory whose tokenizer files the base gets (the GGUF
    needs a vocabulary; SmolLM2's by default). ``peer="llama.cpp"``: then the merge + llama.cpp converter
    path on the same base + adapter (``_llama_cpp_peer``), its figures added. ``verify``: the export checks
    the sha256 of the base's and the adapter's files against their manifests while reading (``--no-verify``: not).
    Two disk figures: ``disk_mb_s`` (2 GB buffered + fsync, before the export; ``ratio``) and ``disk_direct_mb_s``
    (the file's size with O_DIRECT + fsync, after it, as the export writes; ``ratio_direct``). ``floors``
    (bench/floors.py, after the export): the cold O_DIRECT read of the base, that O_DIRECT write, and the CPU
    floor; ``ratio_floor`` = the floor of the run's mode (with or without the check) / ``export_s``.

    Example: ``bench_gguf("tiny", Path("bench-out"), "q8_0", peer="llama.cpp")``"""
    if peer is not None:
        _check_llama_cpp_peer(peer, qtype)
        if tokenizer is None and not (real_model_dir() / "tokenizer.json").is_file():  # before anything is written
            raise SystemExit(
                f"--peer llama.cpp: {real_model_dir()} has no tokenizer.json (run `make real-model` or pass --tokenizer): "
                "convert_hf_to_gguf.py cannot identify the byte-level fallback tokenizer's pre-tokenizer"
            )
    tokenizer = tokenizer or _default_gguf_tokenizer()
    tag, base, adapter = synthetic_base_and_adapter(preset, out, layers, _tokenizer_vocab(tokenizer))
    target = out / f"{tag}-{qtype}.gguf"
    if peer is not None and not json.loads((base / "config.json").read_text()).get("architectures"):  # the converter needs it
        raise SystemExit(f"{base}/config.json names no architectures (a synthetic base from before they were written): remove {base}")
    base_bytes = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    disk = disk_write_mb_s(out, min(base_bytes, 2 * 1024**3))
    copied = [Path(shutil.copy(f, base / f.name)) for f in tokenizer.glob("*token*") if not (base / f.name).exists()]
    try:  # the base is reused only while its manifest lists every file: the tokenizer goes back out
        stats = _gguf_in_child(base, adapter, target, qtype, verify)
        size = target.stat().st_size
        target.unlink()
        floor = floors(sorted(base.glob("*.safetensors")), out, size, verify_bytes=base_bytes, quantize=(qtype, base_bytes // 2))
        direct = None if floor["write_s"] is None else size / floor["write_s"] / 1e6  # the file's volume, O_DIRECT
        peer_stats = _llama_cpp_peer(base, adapter, out, tag, qtype) if peer else {}  # the merge copies the tokenizer
    finally:
        for f in copied:
            f.unlink()
    for extra in out.glob("Modelfile"):
        extra.unlink()
    write_mb_s = size / stats["export_s"] / 1e6
    return {
        "preset": preset + (f"[{layers} layers]" if layers else ""),
        "type": qtype,
        "verify": verify,
        "base_bytes": base_bytes,
        "file_bytes": size,
        "bytes_written": stats["bytes_written"],
        "written_vs_file": round(stats["bytes_written"] / size, 5),
        "tensors": stats["tensors"],
        "export_s": round(stats["export_s"], 2),
        "export_cpu_s": round(stats["cpu_s"], 2),  # user + system seconds of the export's threads
        "write_mb_s": round(write_mb_s, 1),
        "disk_mb_s": round(disk, 1),
        "ratio": round(write_mb_s / disk, 3),
        "disk_direct_mb_s": None if direct is None else round(direct, 1),
        "ratio_direct": None if direct is None else round(write_mb_s / direct, 3),
        "floors": floor,  # bench/floors.py: the base's bf16 values quantized at the type's main block type
        "ratio_floor": ratio_floor(floor, stats["export_s"], verify),
        "ratio_floor_both": ratio_floor(floor, stats["export_s"], verify, both=True),  # the read and the write at once
        "imports_mb": stats["imports_mb"],  # the libraries the export imports on first use, before the baseline
        "rss_before_mb": round(stats["rss_before_mb"], 1),
        "peak_rss_mb": round(stats["peak_rss_mb"], 1),
        "overhead_mb": round(stats["peak_rss_mb"] - stats["rss_before_mb"], 1),
        "workers_private_peak_mb": round(stats["workers_private_peak_mb"], 1),
        "overhead_with_workers_mb": round(stats["peak_rss_mb"] - stats["rss_before_mb"] + stats["workers_private_peak_mb"], 1),
        "peak_reset": stats["peak_reset"],
    } | peer_stats
