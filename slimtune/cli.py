"""The `slimtune` command: one subcommand per job. Exit statuses: 0 success, 1 `verify` found problems,
2 bad input or environment (one line naming the file, key or tensor), 3 internal error (one line; the
traceback with SLIMTUNE_DEBUG=1).

What a command reports as it works goes through the ``slimtune`` logger (``logs.configure_logging``, called by ``main``); what a
command answers (generated text, verify's report, inspect's listing, merge's and export's summaries, the
error line) is printed here. Each command imports its modules inside its function, so `slimtune --help` and usage errors answer
without loading torch or transformers (several seconds); the imports marked ``# lazy`` are those."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import traceback
from pathlib import Path

from slimtune.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_OK, EXIT_PROBLEMS, REPORT_HINT, SlimtuneError
from slimtune.formats.gguf_types import ADAPTER_TYPES, MMPROJ_TYPES, types_help
from slimtune.formats.merge_source import MERGE_BASES, MergeSource
from slimtune.formats.strict_json import safe_text
from slimtune.logs import configure_logging
from slimtune.memory import DEFAULT_SHARD_SIZE, parse_size


def quiet_library_logs() -> None:
    """The application's logging choice for the libraries slimtune uses (the library itself sets none):
    transformers' warnings and progress bars off; torchao's warning for each optional CUDA kernel it
    cannot load (none matter for NF4), bitsandbytes' for its optional CPU kernel from the hub (PEFT imports
    it; slimtune computes nothing with it) and torch's pytree notes off."""
    import transformers  # lazy

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # huggingface_hub's bars too: downloads show theirs again
    from huggingface_hub import constants, utils  # lazy

    if constants.HF_HUB_DISABLE_PROGRESS_BARS is not True:
        utils.enable_progress_bars("huggingface_hub")
    for name in ("torchao", "bitsandbytes", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def cmd_demo(args: argparse.Namespace) -> None:
    from slimtune.demo import run_demo  # lazy

    targets = [t.strip() for t in args.targets.split(",") if t.strip()] if args.targets else None
    run_demo(args.out, args.base, steps=args.steps, targets=targets, offline=args.offline)


def cmd_finetune(args: argparse.Namespace) -> int:
    from slimtune.config import load_config  # lazy
    from slimtune.distributed import launched_by_torchrun, run_ranks, shutdown  # lazy

    if args.nproc < 1:
        raise SlimtuneError(f"--nproc {args.nproc}: expected 1 or more processes")
    cfg = load_config(args.config, args.overrides)  # every key checked before any work starts
    if args.nproc > 1 and not launched_by_torchrun():
        return run_ranks(args.nproc, args.argv)  # the command as given: every rank runs it under torchrun
    from slimtune.recipes.finetune import run_finetune  # lazy

    try:
        run_finetune(cfg)  # under torchrun it joins the process group: every rank runs the recipe
    except BaseException:
        shutdown()
        raise
    shutdown(wait=True)
    return 0


def _sampling(args: argparse.Namespace):
    from slimtune.generate import SamplingOptions  # lazy

    if args.max_new_tokens < 1 or not 0 <= args.temperature < 100 or not 0 < args.top_p <= 1:
        raise SlimtuneError("--max-new-tokens must be >= 1, --temperature in [0, 100), --top-p in (0, 1]")
    return SamplingOptions(args.max_new_tokens, args.temperature, args.top_p, args.seed)


def cmd_generate(args: argparse.Namespace) -> None:
    from slimtune.generate import generate, image_prompt, load_for_generation, prompt_ids, read_messages  # lazy

    options = _sampling(args)
    messages = read_messages(args.messages) if args.messages is not None else None
    loaded = load_for_generation(MergeSource.from_args(args), args.form, args.device)
    print(f"[{loaded.form} model, {args.format if args.format != 'auto' else loaded.prompt_format} format]", file=sys.stderr)
    pixels = None
    if args.image:
        ids, pixels = image_prompt(loaded, args.image, prompt=args.prompt, messages=messages)
    else:
        ids = prompt_ids(loaded, prompt=args.prompt, messages=messages, fmt=None if args.format == "auto" else args.format)
    generate(loaded, ids, options, on_text=lambda text: print(text, end="", flush=True), pixels=pixels)
    print()


def cmd_chat(args: argparse.Namespace) -> None:
    from slimtune.generate import chat_loop, load_for_generation  # lazy

    options = _sampling(args)
    chat_loop(load_for_generation(MergeSource.from_args(args), args.form, args.device), options, images=args.image)


def cmd_merge(args: argparse.Namespace) -> int:
    from slimtune.distributed import init_distributed, launched_by_torchrun, run_ranks, shutdown  # lazy

    if args.nproc < 1:
        raise SlimtuneError(f"--nproc {args.nproc}: expected 1 or more processes")
    if args.nproc > 1 and not launched_by_torchrun():
        return run_ranks(args.nproc, args.argv)  # the command as given: every rank runs it under torchrun
    from slimtune.checkpoint.writer import WriteOptions  # lazy
    from slimtune.merge import merge_from_files  # lazy

    options = WriteOptions(args.max_shard_size, args.overwrite, dtype=args.dtype, device=args.device)
    ranks = init_distributed("cpu")  # the ranks exchange only small control messages: gloo
    try:
        result = merge_from_files(MergeSource.from_args(args), args.out, options, ranks)
    except BaseException:
        shutdown()
        raise
    shutdown(wait=True)
    if ranks.is_coordinator:
        procs = f" by {ranks.world_size} processes" if ranks.world_size > 1 else ""
        what = f"merged {args.adapter} into {args.base} ({args.merge_base} base){procs}"
        print(f"{what}: {result.total_bytes:,d} bytes in {result.seconds:.1f} s")
        print(f"wrote {result.path}")
    return 0


def cmd_export(args: argparse.Namespace) -> None:
    from slimtune.gguf.export import GGUFOptions, export_gguf
    from slimtune.memory import peak_rss_mb

    if args.src is None and (args.base is None or args.adapter is None):
        raise SlimtuneError("export: give SRC (a checkpoint) or both --base and --adapter")
    # beside the checkpoint, as checkpoint.gguf writes it: a file inside would not be in its manifest
    stem = "adapter" if args.adapter_only else "model"
    out = args.out or (args.src or args.adapter).resolve().parent / f"{stem}-{args.type}.gguf"
    options = GGUFOptions(args.type, args.overwrite, dry_run=args.dry_run, mmproj_type=args.mmproj_type)
    source = MergeSource.from_args(args)
    if args.adapter_only:
        from slimtune.gguf.adapter import export_gguf_adapter

        result = export_gguf_adapter(out, options, source, base_gguf=args.base_gguf)
    else:
        if args.base_gguf is not None:
            raise SlimtuneError("export: --base-gguf names the base of an --adapter-only file's Modelfile; add --adapter-only")
        result = export_gguf(out, options, source)
    files = [result] + ([result.mmproj] if getattr(result, "mmproj", None) is not None else [])
    if args.dry_run:
        for r in files:
            for slot in r.plan.slots:
                print(f"{slot.source.name:<40} {slot.qtype.name:<5} {'x'.join(map(str, slot.source.shape)):>14} {slot.nbytes:>14,d} bytes")
            print(f"{r.path}: {r.type}, {r.tensors} tensors, {r.bytes:,d} bytes (dry run: nothing written)")
        return
    for r in files:
        print(f"wrote {r.path}: {r.type}, {r.tensors} tensors, {r.bytes:,d} bytes in {r.seconds:.1f} s, peak RSS {peak_rss_mb():.0f} MB")
    if result.modelfile is not None:
        print(f"wrote {result.modelfile} (ollama create NAME -f {result.modelfile})")


def cmd_verify(args: argparse.Namespace) -> int:
    from slimtune.verify import verify_checkpoint  # lazy

    report = verify_checkpoint(args.path, MergeSource.from_args(args), args.ulps)
    if report.tensor_diffs:
        worst = sorted(report.tensor_diffs.items(), key=lambda kv: -kv[1])
        shown = worst if args.all else worst[:10]
        print(f"max |diff| against the recomputed merge ({len(worst)} tensors{'' if args.all else ', largest first'}):")
        for name, diff in shown:
            print(f"  {name:64s} {diff:.3g}")
    for problem in report.problems:
        print(f"FAIL {problem}")
    verdict = "OK" if report.ok else f"FAILED ({len(report.problems)} problems)"
    print(f"verify {args.path}: {report.files_checked} files checked against the manifest: {verdict}")
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def cmd_inspect(args: argparse.Namespace) -> None:
    from slimtune.inspection import inspect_path  # lazy

    print("\n".join(inspect_path(args.path)))


class _Version(argparse.Action):
    """``slimtune --version``: ``slimtune 0.1.0 (torch 2.13.0, transformers 5.24.0, ...)``, from the package
    metadata, read only when asked; then what dequantizes NF4 here (``quant.nf4_kernel.status``: the C
    loop, built on first use, or torch's ops and why) and what quantizes GGUF's K-quants
    (``gguf.kquant_kernel.loop_status``: C, or torch and why)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from slimtune.checkpoint.card import software_versions  # lazy

        versions = software_versions()
        others = ", ".join(f"{name} {version}" for name, version in versions.items() if name != "slimtune")
        print(f"slimtune {versions['slimtune']} ({others}; python {sys.version.split()[0]})")
        from slimtune.quant import nf4_kernel  # lazy: imports torch

        print(f"NF4 dequantization on the CPU: {nf4_kernel.status()}")
        from slimtune.gguf import kquant_kernel  # lazy: imports torch

        print(f"GGUF quantization (K-quants, Q4_0-Q8_0): {kquant_kernel.loop_status()}")
        parser.exit()


def _size(text: str) -> int:
    """--max-shard-size, parsed here once (a bad size is argparse's usage error, exit 2)."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slimtune", description="QLoRA fine-tuning with bounded-memory checkpoints.")
    parser.add_argument("--version", action=_Version, help="print the versions of slimtune and the libraries it runs on, and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo", help="fine-tune SmolLM2-135M-Instruct (fetched once) and show its answers before and after, save, reload, export"
    )
    demo.add_argument("--out", type=Path, default=Path("slimtune-demo"), help="output directory (default: ./slimtune-demo)")
    demo.add_argument(
        "--base", default=None, help="use this Hugging Face checkpoint (a directory or a hub id org/name[@rev]) instead of the tiny model"
    )
    demo.add_argument("--steps", type=int, default=None, help="training steps (default: 20 on SmolLM2, 60 on the tiny model)")
    demo.add_argument("--offline", action="store_true", help="the embedded tiny model and built-in data: no network, no model cache")
    demo.add_argument("--targets", default=None, help="comma-separated LoRA target modules (default: all attention and MLP projections)")
    demo.set_defaults(func=cmd_demo)

    from slimtune.config import schema_help, shipped_configs  # lazy

    finetune = sub.add_parser(
        "finetune",
        help="QLoRA fine-tuning from a YAML config, with periodic bounded-memory checkpoints and exact resume",
        description="Fine-tune LoRA adapters on an NF4 base from local data files (JSONL, JSON, Parquet, Arrow, CSV). "
        f"Shipped configs: {', '.join(shipped_configs())}. Example: slimtune finetune --config tiny optimizer.lr=5e-3",
        epilog=schema_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    finetune.add_argument("--config", required=True, help="a YAML file, or the name of a shipped config")
    finetune.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. optimizer.lr=1e-4 resume=true")
    finetune.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="train on N local processes (FSDP2; gloo on the CPU, NCCL on GPUs), as torchrun --nproc-per-node N -m slimtune finetune",
    )
    finetune.set_defaults(func=cmd_finetune)

    generate = sub.add_parser("generate", help="generate from a checkpoint, with the prompt format its training used")
    _generation_args(generate, 0.7)
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", default=None, help="a prompt, rendered as training rendered its data (chat, Alpaca or text)")
    source.add_argument("--messages", type=Path, default=None, help='a JSON file: [{"role": ..., "content": ...}, ...]')
    generate.add_argument(
        "--format", choices=["auto", "chat", "alpaca", "text"], default="auto", help="prompt format (default: the one training used)"
    )
    generate.add_argument("--image", type=Path, action="append", default=None, help=_IMAGE_HELP)
    generate.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="talk to a checkpoint interactively (replies streamed)")
    _generation_args(chat, 0.7)
    chat.add_argument("--image", type=Path, action="append", default=None, help=_IMAGE_HELP)
    chat.set_defaults(func=cmd_chat)

    _add_merge(sub)

    _add_export(sub)
    _add_verify(sub)

    inspect = sub.add_parser("inspect", help="list the tensors (and adapter settings) of a checkpoint, shard or adapter")
    inspect.add_argument("path", type=Path, help="checkpoint directory, adapter directory or .safetensors file")
    inspect.set_defaults(func=cmd_inspect)
    return parser


def _add_export(sub) -> None:
    export = sub.add_parser("export", help="write a checkpoint (or an adapter merged into its base) as one GGUF file, in bounded memory")
    export.add_argument(
        "src", type=Path, nargs="?", default=None, help="a checkpoint: merged model directory, or step-N/adapter with --base"
    )
    export.add_argument("--format", choices=["gguf"], default="gguf", help="output format (gguf)")
    export.add_argument(
        "--type",
        default="f16",
        help=f"{types_help()} (default: f16)",
    )
    export.add_argument("--out", type=Path, default=None, help="output file (default: model-TYPE.gguf beside SRC)")
    export.add_argument(
        "--mmproj-type",
        choices=list(MMPROJ_TYPES),
        default="f16",
        help="a vision-language model's mmproj file (vision tower + projector, beside --out as NAME-mmproj-TYPE.gguf): "
        "f32, f16, bf16 or q8_0 (default: f16)",
    )
    _source_args(export, "base model (a directory or hub id), to merge an adapter on the fly")
    export.add_argument("--overwrite", action="store_true", help="replace an existing output file (atomically, once complete)")
    export.add_argument("--dry-run", action="store_true", help="print each tensor's GGML type and the file's size; write nothing")
    export.add_argument(
        "--adapter-only",
        action="store_true",
        help="write the adapter alone as a GGUF LoRA adapter (llama.cpp's lora_path, Ollama's ADAPTER; --type "
        f"{', '.join(ADAPTER_TYPES)}; "
        "needs --base for its config and names)",
    )
    export.add_argument(
        "--base-gguf", default=None, help="with --adapter-only: the Modelfile's FROM (default: model-f16.gguf beside --base)"
    )
    export.set_defaults(func=cmd_export)


def _add_verify(sub) -> None:
    verify = sub.add_parser("verify", help="check a checkpoint against its manifest, the format rules and (optionally) its sources")
    verify.add_argument("path", type=Path, help="checkpoint directory")
    _source_args(verify, "base checkpoint (directory or hub id), to recompute each merged tensor with --adapter", verify=False)
    verify.add_argument(
        "--ulps", type=int, default=0, help="allowed difference in units of the last place (default 0: bit-identical, as slimtune writes)"
    )
    verify.add_argument("--all", action="store_true", help="print the max |diff| of every tensor, not the 10 largest")
    verify.set_defaults(func=cmd_verify)


_IMAGE_HELP = "an image for a vision-language checkpoint (repeat for several): it goes first in the first user turn"


def _generation_args(p: argparse.ArgumentParser, temperature: float) -> None:
    p.add_argument("checkpoint", type=Path, help="a step-N checkpoint, a merged model directory or an adapter directory")
    p.add_argument(
        "--form",
        choices=["auto", "merged", "adapter"],
        default="auto",
        help="merged: the merged model with plain transformers; adapter: the adapter on the NF4 base it was trained on "
        "(bounded memory, as finetune loads it); auto: merged when the checkpoint has it",
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="default: 128")
    p.add_argument("--temperature", type=float, default=temperature, help=f"0: greedy (default: {temperature})")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling (default: 0.9)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed: the same seed gives the same text (default: 0)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: cuda when available")
    _source_args(p, "base model for --form adapter, a directory or a hub id (default: the one training used)", adapter=False)


def _source_args(p: argparse.ArgumentParser, base_help: str, required: bool = False, adapter: bool = True, verify: bool = True) -> None:
    """The arguments ``MergeSource.from_args`` reads: --base, with ``adapter`` --adapter and --merge-base,
    with ``verify`` --no-verify."""
    p.add_argument("--base", type=Path, required=required, default=None, help=base_help)
    if adapter:
        p.add_argument(
            "--adapter", type=Path, required=required, default=None, help="PEFT adapter directory (or a checkpoint holding adapter/)"
        )
        p.add_argument(
            "--merge-base",
            choices=MERGE_BASES,
            default=MERGE_BASES[0],
            help="merge into W itself (original, default) or into dequant(NF4(W)), the weights a QLoRA adapter was trained against",
        )
    if verify:
        p.add_argument(
            "--no-verify",
            dest="verify",
            action="store_false",
            help="do not check the sha256 of the checkpoint files read against their manifest (checked while reading by default)",
        )


def _add_merge(sub) -> None:
    merge = sub.add_parser("merge", help="merge a PEFT LoRA adapter into a Hugging Face base, from files, in bounded memory")
    base_help = "base checkpoint: a directory or a hub id org/name[@revision] (safetensors; bf16/fp16/fp32 or bitsandbytes NF4)"
    _source_args(merge, base_help, required=True)
    merge.add_argument("--out", type=Path, required=True, help="output directory (must not exist unless --overwrite)")
    merge.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="output dtype (default: the base's)")
    merge.add_argument(
        "--max-shard-size", default=DEFAULT_SHARD_SIZE, type=_size, help=f'largest shard (default "{DEFAULT_SHARD_SIZE}", decimal units)'
    )
    merge.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the merge math runs (default: cpu)")
    merge.add_argument("--overwrite", action="store_true", help="replace an existing output directory (atomically, once complete)")
    merge.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="processes that each merge their row range of every tensor into the same files (default 1; under torchrun: its world)",
    )
    merge.set_defaults(func=cmd_merge)


def _default_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _one_line(text: str) -> str:
    lines = [line.strip() for line in safe_text(text).splitlines() if line.strip()]
    return " ".join(lines)[:2000] if lines else ""


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns the exit status (0 ok, 1 verify found problems, 2 bad input or
    environment, 3 internal error). Every failure is one line on stderr; no traceback unless
    SLIMTUNE_DEBUG=1."""
    for stream in (sys.stdout, sys.stderr):  # names with lone surrogates or odd bytes must still print
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    command = "slimtune"
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        args = build_parser().parse_args(argv, argparse.Namespace(argv=argv))  # argv: what --nproc forwards to each rank
        command = f"slimtune {args.command}"
        configure_logging()
        quiet_library_logs()
        return args.func(args) or EXIT_OK
    except SlimtuneError as e:
        _default_sigterm()  # the job is over for this rank: a late SIGTERM from torchrun just ends it
        if os.environ.get("RANK", "0") == "0":  # one line per job: the coordinator speaks for every rank
            print(f"{command}: error: {_one_line(str(e))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:  # argparse: usage errors are bad input (2), --help is success
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    except MemoryError:
        print(f"{command}: error: out of memory", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:  # the environment: disk full, read-only, permissions, missing files
        where = f"{safe_text(str(e.filename))}: " if e.filename is not None else ""
        print(f"{command}: error: {where}{_one_line(e.strerror or str(e))}", file=sys.stderr)
        _debug_traceback()
        return EXIT_BAD_INPUT
    except Exception as e:  # noqa: BLE001 - anything else is a bug: one line, status 3
        print(f"{command}: internal error: {type(e).__name__}: {_one_line(str(e))[:500]}; {REPORT_HINT}", file=sys.stderr)
        _debug_traceback()
        return EXIT_INTERNAL


def _debug_traceback() -> None:
    if os.environ.get("SLIMTUNE_DEBUG") == "1":
        traceback.print_exc()


if __name__ == "__main__":
    sys.exit(main())
