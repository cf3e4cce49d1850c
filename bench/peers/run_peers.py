"""Driver: slimtune and its peers on the same shapes, one after the other in one run; prints a table.

    bash bench/peers/run_peers.sh --out bench/peers/out --layers 8 --plot docs/peak_rss_vs_size.png

(run_peers.sh makes the peers' venvs, then runs this file with bench/peers/.venv-peft's python.)

save  (a QLoRA model in memory -> merged bf16 checkpoint on disk):
      slimtune (`python -m bench save`) vs torchtune 0.6.1 (bench/peers/torchtune_save.py)
      with low_cpu_ram off and on, on llama3.2-1b and llama3-8b cut to --layers layers.
merge (bf16 base + LoRA adapter files -> merged bf16 checkpoint):
      slimtune (`python -m bench merge`, which writes the synthetic base + adapter under --out once)
      vs PEFT merge_and_unload + save_pretrained (bench/peers/peft_merge.py) on the same files.

Each measurement is its own process, run one at a time. Results go to OUT/results.jsonl (one JSON object per
run), the table to OUT/results.md; --plot draws peak RSS against model size. --from-results re-renders the
table and plot from a results.jsonl without running anything."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEERS = Path(__file__).resolve().parent
MAIN_PY = ROOT / ".venv" / "bin" / "python"
TORCHTUNE_PY = PEERS / ".venv-torchtune" / "bin" / "python"
PEFT_PY = PEERS / ".venv-peft" / "bin" / "python"


def mem_available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024**2
    return float("nan")


def machine() -> dict:
    def sh(cmd: str) -> str:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.rstrip()

    return {
        "nproc": sh("nproc"),
        "free_g": sh("free -g"),
        "lscpu": sh("lscpu | head -20"),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def slimtune_snapshot(rev: str, out: Path) -> tuple[Path | None, str]:
    """slimtune/ as committed at ``rev``, extracted with ``git archive`` (read-only) under OUT, so the figures
    belong to one known commit even while the working tree changes; 'worktree' uses the working tree."""
    if rev == "worktree":
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "--no-optional-locks", "status", "--porcelain", "slimtune"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        return None, f"worktree (HEAD {head[:10]}{', slimtune/ modified' if dirty else ''})"
    git = dict(cwd=ROOT, capture_output=True, text=True, check=True)
    sha = subprocess.run(["git", "rev-parse", "--verify", rev + "^{commit}"], **git).stdout.strip()
    dest = out / f"slimtune-src-{sha[:10]}"
    if not (dest / "slimtune" / "__init__.py").exists():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha, "slimtune"], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest, sha[:10]


def run_step(name: str, cmd: list[str], logs: Path, env: dict | None = None) -> dict | None:
    avail = mem_available_gb()
    print(f"[{time.strftime('%H:%M:%S')}] {name}  (MemAvailable {avail:.1f} GB)", file=sys.stderr, flush=True)
    print("    $ " + " ".join(str(c) for c in cmd), file=sys.stderr, flush=True)
    start = time.perf_counter()
    log = logs / f"{name}.log"
    with open(log, "w") as err:
        proc = subprocess.run([str(c) for c in cmd], cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    wall = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        tail = log.read_text()[-3000:]
        print(f"    FAILED (exit {proc.returncode}) after {wall:.0f} s; stderr tail:\n{tail}", file=sys.stderr, flush=True)
        return {"step": name, "failed": True, "returncode": proc.returncode, "stderr_tail": tail[-1500:], "wall_s": round(wall, 1)}
    result = json.loads(lines[-1])
    result.update({"step": name, "wall_s": round(wall, 1), "mem_available_gb_before": round(avail, 1)})
    print(f"    done in {wall:.0f} s: {lines[-1]}", file=sys.stderr, flush=True)
    return result


Step = tuple[str, list, list[Path], float]


def plan(out: Path, layers: list[int], what: str, slimtune_full_8b: bool) -> list[Step]:
    """(step name, command, paths to remove after it, free disk GB it needs). The peers run on llama3.2-1b and
    llama3-8b cut to each of ``layers``; with ``slimtune_full_8b``, slimtune alone also runs the whole
    llama3-8b (16 GB in bf16: the peers need more memory than this run's budget for it); then each synthetic
    base is removed after its last use (the whole 8B's merge holds a 16 GB base and a 16 GB output at once)."""
    steps: list[Step] = []
    drop = slimtune_full_8b
    for preset, n in [("llama3.2-1b", None)] + [("llama3-8b", n) for n in layers]:
        lay = ["--layers", str(n)] if n else []
        tag = preset + (f"-{n}l" if n else "")
        if what in ("all", "save"):
            steps.append((f"save-slimtune-{tag}", [MAIN_PY, "-m", "bench", "save", "--preset", preset, "--out", out, *lay], [], 0))
            tt = [TORCHTUNE_PY, PEERS / "torchtune_save.py", "--preset", preset, "--out", out, *lay]
            steps.append((f"save-torchtune-{tag}", tt, [], 0))
            steps.append((f"save-torchtune-lowram-{tag}", [*tt, "--low-cpu-ram"], [], 0))
        if what in ("all", "merge"):
            cmd = [MAIN_PY, "-m", "bench", "merge", "--preset", preset, "--out", out, *lay]
            steps.append((f"merge-slimtune-{tag}", cmd, [], 0))
            base, adapter = out / f"base-{tag}", out / f"adapter-{tag}"
            peft = [PEFT_PY, PEERS / "peft_merge.py", "--base", base, "--adapter", adapter, "--out", out]
            steps.append((f"merge-peft-{tag}", peft, [base, adapter] if drop else [], 0))
    if slimtune_full_8b:
        if what in ("all", "save"):
            cmd = [MAIN_PY, "-m", "bench", "save", "--preset", "llama3-8b", "--out", out]
            steps.append(("save-slimtune-llama3-8b", cmd, [], 16 + 6))
        if what in ("all", "merge"):
            cmd = [MAIN_PY, "-m", "bench", "merge", "--preset", "llama3-8b", "--out", out]
            steps.append(("merge-slimtune-llama3-8b", cmd, [out / "base-llama3-8b", out / "adapter-llama3-8b"], 32 + 6))
    return steps


def label(r: dict) -> str:
    tool = r.get("tool") or r["step"].split("-")[1]
    if tool == "torchtune":
        return f"torchtune low_cpu_ram={'on' if r.get('low_cpu_ram') else 'off'}"
    return tool


def size_gb(r: dict) -> float:
    """The model's bf16 size: the merged checkpoint written (save) or the bf16 base read (merge)."""
    return (r.get("base_bytes") or r.get("output_bytes") or 0) / 1e9


def table(results: list[dict]) -> str:
    head = (
        "| op | tool | shape | bf16 GB | peak RSS MB | RSS before MB | bytes written | seconds | seconds incl. fsync "
        "| write MB/s | disk MB/s | ratio | ratio to the run's median disk MB/s | sampled peak RssAnon / RssFile MB |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    disks = sorted(r["disk_mb_s"] for r in results if not r.get("failed"))
    median = disks[len(disks) // 2] if disks else float("nan")
    rows = [head]
    for r in results:
        op = r["step"].split("-")[0]
        if r.get("failed"):
            rows.append(f"| {op} | {r['step']} | FAILED (exit {r['returncode']}) | | | | | | | | | | | |")
            continue
        secs = r["merge_s"] if op == "merge" else r["save_s"]
        with_fsync = round(secs + r["fsync_s"], 1) if "fsync_s" in r else f"{secs:.1f} (fsyncs)"
        before = r.get("rss_before_mb", "—")
        anon_file = f"{r['sampled_peak_rss_anon_mb']:.0f} / {r['sampled_peak_rss_file_mb']:.0f}" if "sampled_peak_rss_anon_mb" in r else "—"
        rows.append(
            f"| {op} | {label(r)} | {r['preset']} | {size_gb(r):.2f} | {r['peak_rss_mb']:.0f} | {before} | {r['bytes_written']:,} "
            f"| {secs:.1f} | {with_fsync} | {r['write_mb_s']} | {r['disk_mb_s']} | {r['ratio']} "
            f"| {r['write_mb_s'] / median:.3f} | {anon_file} |"
        )
    return "\n".join(rows)


def plot(results: list[dict], path: Path) -> None:
    """Two panels, peak RSS against the model's bf16 size: the merged save, and the offline merge."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {  # colour, marker, label offset
        "slimtune": ("tab:blue", "o", (6, -10)),
        "torchtune low_cpu_ram=off": ("tab:red", "s", (6, 2)),
        "torchtune low_cpu_ram=on": ("tab:orange", "^", (6, -12)),
        "peft": ("tab:green", "D", (6, -3)),
    }
    series: dict[tuple[str, str], list[tuple[float, float]]] = {}
    before: list[tuple[float, float]] = []
    anon: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for r in results:
        if r.get("failed"):
            continue
        op = r["step"].split("-")[0]
        series.setdefault((op, label(r)), []).append((size_gb(r), r["peak_rss_mb"] / 1024))
        if "sampled_peak_rss_anon_mb" in r:
            part = (size_gb(r), r["sampled_peak_rss_anon_mb"] / 1024, r["sampled_peak_rss_file_mb"] / 1024)
            anon.setdefault((op, label(r)), []).append(part)
        if op == "save" and label(r) == "slimtune":
            before.append((size_gb(r), r["rss_before_mb"] / 1024))
    top = max((x for pts in series.values() for x, _ in pts), default=1) * 1.08
    ymax = max((y for pts in series.values() for _, y in pts), default=1) * 1.5  # headroom for the legends
    fig, axes = plt.subplots(1, 2, figsize=(11, 5), dpi=120, sharey=True)
    titles = {
        "save": "merged save: QLoRA model in memory -> bf16 checkpoint",
        "merge": "offline merge: bf16 base + adapter files -> merged files",
    }
    for ax, op in zip(axes, ["save", "merge"], strict=True):
        ax.plot([0, top], [0, top / 1.073741824], color="grey", lw=0.8, ls=":", label="the bf16 model's own size")
        if op == "save" and before:
            xs, ys = zip(*sorted(before), strict=True)
            ax.plot(xs, ys, color="lightsteelblue", lw=1, ls="--", label="RSS before the save (the NF4 model)")
        for (sop, tool), pts in sorted(series.items()):
            if sop != op:
                continue
            pts.sort()
            color, marker, offset = styles.get(tool, ("black", "x", (6, -3)))
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, color=color, marker=marker, label=tool)
            for x, y in pts:
                ax.annotate(
                    f"{y * 1024:.0f}",
                    (x, y),
                    textcoords="offset points",
                    xytext=offset,
                    fontsize=7,
                    color=color,
                    bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.8),
                )
            parts = sorted(anon.get((sop, tool), []))
            if parts and max(f for _, _, f in parts) > 1:  # a peak that is largely mmap'd file pages
                xs, ys, _ = zip(*parts, strict=True)
                ax.plot(xs, ys, color=color, marker=marker, ls=":", lw=1, ms=3, alpha=0.7, label=f"{tool}: its RssAnon (sampled)")
        ax.set_title(titles[op], fontsize=9.5)
        ax.set_xlabel("model size, bf16 checkpoint (GB)")
        ax.set_xlim(0, top)
        ax.set_ylim(0, ymax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7.5, loc="upper right")
    axes[0].set_ylabel("peak RSS (GiB); labels in MiB")
    fig.suptitle("Peak RSS vs model size, CPU (2 cores, 24 GB RAM); synthetic llama3.2-1b and llama3-8b shapes", fontsize=10.5)
    fig.text(
        0.5,
        0.005,
        "peers run on llama3.2-1b and llama3-8b cut to fewer layers (a bigger run would pass this machine's ~10 GB budget); "
        "slimtune also on the whole llama3-8b where run with --slimtune-full-8b",
        ha="center",
        fontsize=7,
        color="dimgrey",
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=PEERS / "out", help="work folder: synthetic bases, results (default bench/peers/out)")
    parser.add_argument(
        "--layers", type=int, nargs="+", default=[8], help="layer counts of the llama3-8b shape (default 8: peers cannot fit 32 here)"
    )
    parser.add_argument("--slimtune-full-8b", action="store_true", help="also slimtune alone on the whole llama3-8b (for the plot)")
    parser.add_argument("--only", choices=["all", "save", "merge"], default="all")
    parser.add_argument(
        "--slimtune-rev",
        default="HEAD",
        help="git revision of slimtune/ to measure, run from a git-archive copy (default HEAD); 'worktree': as it is",
    )
    parser.add_argument("--plot", type=Path, default=None, help="also draw peak RSS vs model size to this PNG")
    parser.add_argument("--from-results", type=Path, default=None, help="re-render table/plot from a results.jsonl; runs nothing")
    args = parser.parse_args()

    if args.from_results:
        results = [json.loads(ln) for ln in args.from_results.read_text().splitlines() if ln.strip().startswith("{") and '"step"' in ln]
    else:
        out = args.out.resolve()
        logs = out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        src, rev = slimtune_snapshot(args.slimtune_rev, out)
        slim_env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"} if src else None
        info = {**machine(), "slimtune": rev}
        (out / "machine.json").write_text(json.dumps(info, indent=1))
        print(f"nproc {info['nproc']}\n{info['free_g']}\nslimtune: {rev}" + (f" from {src}" if src else ""), file=sys.stderr)
        results, start = [], time.perf_counter()
        with open(out / "results.jsonl", "w") as f:
            for name, cmd, cleanup, need_gb in plan(out, args.layers, args.only, args.slimtune_full_8b):
                free_gb = shutil.disk_usage(out).free / 1e9
                if free_gb < need_gb:
                    print(f"[skip] {name}: needs {need_gb} GB free on disk, has {free_gb:.1f}", file=sys.stderr, flush=True)
                    r = {"step": name, "failed": True, "returncode": "skipped: disk", "wall_s": 0}
                else:
                    slim = "-slimtune-" in name
                    r = run_step(name, cmd, logs, slim_env if slim else None)
                    if slim and r is not None:
                        r["slimtune"] = rev
                for path in cleanup:
                    shutil.rmtree(path, ignore_errors=True)
                results.append(r)
                f.write(json.dumps(r) + "\n")
                f.flush()
        print(f"total {time.perf_counter() - start:.0f} s", file=sys.stderr)
        (out / "results.md").write_text(table(results) + "\n")
    print(table(results))
    disks = sorted(r["disk_mb_s"] for r in results if not r.get("failed"))
    if disks:
        print(f"\ndisk MB/s measured by the runs: min {disks[0]}, median {disks[len(disks) // 2]}, max {disks[-1]}")
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
