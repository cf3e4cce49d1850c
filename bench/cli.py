"""The benches' command line, ``python -m bench NAME [flags]``: one subcommand per bench, each printing one
JSON line (``train-step`` one per row). The benches themselves are the modules beside this one."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from bench.bnb_dequant import bench_bnb_dequant
from bench.common import real_model_dir, synthetic_train_base
from bench.gguf_export import bench_gguf
from bench.load_bnb import bench_load_bnb
from bench.load_moe import bench_load_moe
from bench.merge import bench_merge, bench_merge_cold
from bench.nf4 import bench_nf4
from bench.quant import bench_quant
from bench.save import bench_dist_save, bench_save
from bench.seed import bench_seed
from bench.step_memory import bench_step_memory
from bench.step_profile import bench_step_profile
from bench.train_save import TRAIN_SAVE_MODES, bench_train_save
from bench.train_step import bench_recipe_step, bench_train_step, print_row
from slimtune.cli import quiet_library_logs
from slimtune.synthetic import PRESETS, VISION_PRESETS


def _real_rows(out: Path) -> Path:
    """The real-model tests' short chat rows (stdlib questions, one-paragraph answers) as a JSONL file under ``out``."""
    from tests.real_model import write_docstring_data

    return write_docstring_data(out / "recipe-data")[0]


def _real_pairs(out: Path, count: int) -> Path:
    """The first ``count`` training pairs of the real-model tests (tests/real_model.docstring_pairs: the right
    docstring summary chosen, another function's rejected) as a JSONL file under ``out``: one epoch's worth,
    so the recipe's reference pass (before its steps, outside their timing) scores no more than it trains."""
    from tests.real_model import docstring_pairs

    path = out / "recipe-data" / "pairs.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in docstring_pairs()[0][:count]))
    return path


def _train_step(args: argparse.Namespace) -> None:
    if args.recipe:
        if args.model is None:
            raise SystemExit("train-step --recipe: --model DIR is required")
        data = args.data or _real_rows(args.out)
        peers = tuple(dict.fromkeys(args.peer or ["peft"]))
        print_row(bench_recipe_step(args.model, data, args.out, args.steps or 10, args.rounds, peers, args.threads))
        return
    if args.objective == "grpo":  # the recipe's GRPO step vs TRL's GRPOTrainer, PEFT + bitsandbytes 4-bit and bf16
        from bench.grpo_step import bench_grpo_step

        if args.peer not in (None, ["trl"]):
            raise SystemExit("train-step --objective grpo: the peer is trl (TRL's GRPOTrainer: PEFT + bitsandbytes 4-bit, and bf16)")
        shape = dict(steps=args.steps or 4, prompts=args.batch or 4, generations=4, completion=args.seq or 16)
        print_row(bench_grpo_step(args.model or real_model_dir(), args.out, shape, args.rounds, args.threads))
        return
    if args.objective == "dpo":  # the recipe's DPO step vs TRL's DPOTrainer, PEFT + bitsandbytes 4-bit and bf16
        if args.peer not in (None, ["trl"]):
            raise SystemExit("train-step --objective dpo: the peer is trl (TRL's DPOTrainer: PEFT + bitsandbytes 4-bit, and bf16)")
        model_dir = args.model or real_model_dir()
        data = args.data or _real_pairs(args.out, (args.steps or 10) * 4)  # the tiny config's batch: 4 pairs
        peers = ("trl-bnb", "trl")
        print_row(bench_recipe_step(model_dir, data, args.out, args.steps or 10, args.rounds, peers, args.threads, objective="dpo"))
        return
    real = args.model is not None
    shape = dict(preset=args.preset, layers=args.layers, steps=args.steps or (8 if real else 6), batch=args.batch or (4 if real else 2))
    shape.update(seq=args.seq or (256 if real else 512), rank=args.rank or (16 if real else 8), real=real)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model if real else synthetic_train_base(args.out, args.preset, args.layers)
    print_row(bench_train_step(model_dir, args.out, shape, rounds=args.rounds, compile=args.compile, threads=args.threads))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    sub = parser.add_subparsers(dest="command", required=True)
    save = sub.add_parser("save", help="merged save of a synthetic QLoRA model")
    save.add_argument("--preset", choices=sorted(PRESETS | VISION_PRESETS), default="tiny")
    save.add_argument("--out", type=Path, required=True)
    save.add_argument("--layers", type=int, default=None, help="override the number of layers")
    save.add_argument("--keep", action="store_true", help="keep the written checkpoint")
    save.add_argument("--device", default="cpu", help="where the model lives during the save (cpu or cuda)")
    merge = sub.add_parser("merge", help="offline merge of a synthetic base + adapter written to --out (once)")
    merge.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    merge.add_argument("--out", type=Path, required=True)
    merge.add_argument("--layers", type=int, default=None, help="override the number of layers")
    merge.add_argument("--device", default="cpu", help="where the merge math runs (cpu or cuda)")
    merge.add_argument("--no-verify", dest="verify", action="store_false", help="as slimtune merge --no-verify: no sha256 pass")
    merge.add_argument("--cold", action="store_true", help="cp -r + sync of the base vs the CLI merge, page cache evicted before each")
    merge.add_argument("--rounds", type=int, default=2, help="with --cold: copy / merge alternations")
    dsave = sub.add_parser("dist-save", help="cooperative export by N ranks (gloo, FSDP2-sharded synthetic model) vs one process")
    dsave.add_argument("--preset", choices=sorted(PRESETS), default="llama3.2-1b")
    dsave.add_argument("--out", type=Path, default=Path("bench-out"))
    dsave.add_argument("--nproc", type=int, default=2)
    dsave.add_argument("--layers", type=int, default=None, help="override the number of layers")
    load = sub.add_parser("load-moe", help="QLoRA load of a synthetic 2-layer Mixtral of real widths: peak RSS vs resident")
    load.add_argument("--out", type=Path, required=True)
    load.add_argument("--layers", type=int, default=2)
    bnb = sub.add_parser("load-bnb", help="training load of a bitsandbytes 4-bit Llama-3-8B-shape base beside a bf16 one: peak RSS")
    bnb.add_argument("--out", type=Path, required=True)
    bnb.add_argument("--layers", type=int, default=None, help="layers of the 4-bit base (default 32)")
    bnb.add_argument("--bf16-layers", type=int, default=None, help="layers of the bf16 base (default: --layers; 0: skip it)")
    dq = sub.add_parser("bnb-dequant", help="bitsandbytes 4-bit dequantization: slimtune vs bitsandbytes and slimtune's NF4")
    dq.add_argument("--rows", type=int, default=1536)
    dq.add_argument("--cols", type=int, default=576)
    dq.add_argument("--rounds", type=int, default=3)
    nf4 = sub.add_parser("nf4", help="NF4 dequantization throughput vs torchao on a 4096x14336 weight")
    nf4.add_argument("--device", default="cpu")
    quant = sub.add_parser("quant", help="GGML block quantizers (slimtune.gguf.ggml) vs the gguf package's numpy and ggml's C, MB/s")
    quant.add_argument("--rows", type=int, default=256, help="rows of 4096 values")
    quant.add_argument("--threads", type=int, default=2)
    quant.add_argument("--rounds", type=int, default=3)
    step = sub.add_parser("train-step", help="the recipe's training step vs a PEFT bf16 LoRA loop, alternated in one run")
    step.add_argument("--preset", choices=sorted(PRESETS), default="llama3.2-1b")
    step.add_argument("--layers", type=int, default=2)
    step.add_argument("--model", type=Path, default=None, help="a real HF checkpoint directory instead of the synthetic preset")
    step.add_argument("--recipe", action="store_true", help="the user's case: the recipe on --data's rows, as the CLI runs it")
    step.add_argument("--data", type=Path, default=None, help="with --recipe: a JSONL dataset (default: the real-model tests' chat rows)")
    step.add_argument(
        "--peer",
        choices=["peft", "peft-bnb", "trl"],
        action="append",
        help="peft: PEFT on bf16; peft-bnb: PEFT + bitsandbytes NF4 (--recipe); trl: TRL's DPO/GRPOTrainer on both (--objective dpo/grpo)",
    )
    step.add_argument(
        "--objective",
        choices=["sft", "dpo", "grpo"],
        default="sft",
        help="dpo: the recipe's DPO step on pairs; grpo: its GRPO step (--batch prompts x 4, --seq completion tokens); real model",
    )
    step.add_argument("--out", type=Path, default=Path("bench-out"))
    step.add_argument("--steps", type=int, default=None, help="steps per run (default 6 synthetic, 8 with --model)")
    step.add_argument("--batch", type=int, default=None, help="sequences per step (default 2 synthetic, 4 with --model)")
    step.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 512 synthetic, 256 with --model)")
    step.add_argument("--rank", type=int, default=None, help="LoRA rank on all linears (default 8 synthetic, 16 with --model)")
    step.add_argument("--rounds", type=int, default=2, help="slimtune/peer alternations")
    step.add_argument("--compile", action="store_true", help="slimtune with training.compile=true")
    step.add_argument("--threads", type=int, default=None, help="torch CPU threads for both sides (default: as the recipe picks)")
    sm = sub.add_parser("step-memory", help="a DPO step's peak RSS vs an SFT step's on the same 2N sequences in one batch")
    sm.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    sm.add_argument("--layers", type=int, default=2)
    sm.add_argument("--pairs", type=int, default=2, help="N: pairs in the DPO batch (the SFT batch holds their 2N sequences)")
    sm.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    sm.add_argument("--out", type=Path, default=Path("bench-out"))
    gm = sub.add_parser("grpo-memory", help="a GRPO step's peak RSS (generation included) vs an SFT step's on its tokens; beta > 0 vs 0")
    gm.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    gm.add_argument("--layers", type=int, default=2)
    gm.add_argument("--prompts", type=int, default=2, help="prompts in the step's batch")
    gm.add_argument("--generations", type=int, default=4, help="completions per prompt (grpo.num_generations)")
    gm.add_argument("--prompt-tokens", type=int, default=64, help="tokens per prompt (grpo.max_prompt_length)")
    gm.add_argument("--completion", type=int, default=32, help="tokens per completion at most (grpo.max_completion_length)")
    gm.add_argument("--beta", type=float, default=0.04, help="grpo.beta of the reference-pass configuration")
    gm.add_argument("--out", type=Path, default=Path("bench-out"))
    sp = sub.add_parser("step-profile", help="torch.profiler: the recipe step, it with dequantized weights held, bare, the bf16 peer")
    sp.add_argument("--model", type=Path, required=True)
    sp.add_argument("--data", type=Path, default=None, help="a JSONL dataset (default: the real-model tests' chat rows)")
    sp.add_argument("--out", type=Path, default=Path("bench-out"))
    sp.add_argument("--warmup", type=int, default=4)
    sp.add_argument("--steps", type=int, default=3, help="steps per side per round, and profiled")
    sp.add_argument("--rounds", type=int, default=3, help="unprofiled rounds, the sides alternated")
    sp.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: as the recipe picks)")
    sd = sub.add_parser("seed", help="the seed's scenario on the CPU: llama3-8b_qlora, 12 short rows, 1 step, merged save: RSS by phase")
    sd.add_argument("--out", type=Path, default=Path("bench-out"))
    sd.add_argument("--rows", type=int, default=12)
    sd.add_argument("--words", type=int, default=24, help="words per row")
    sd.add_argument("--eval-fraction", type=float, default=0.0, help="hold out this share: evaluation and eval_loss_merged run too")
    sd.add_argument("--layers", type=int, default=None, help="fewer decoder layers (a quick check; the scenario is all 32)")
    ts = sub.add_parser("train-save", help="training with no / synchronous / background merged saves (and a writer thread)")
    ts.add_argument("--preset", choices=sorted(PRESETS), default="llama3.2-1b")
    ts.add_argument("--out", type=Path, default=Path("bench-out/train-save"))
    ts.add_argument("--steps", type=int, default=12)
    ts.add_argument("--save-every", type=int, default=4)
    ts.add_argument("--layers", type=int, default=2, help="decoder layers of the synthetic model")
    ts.add_argument("--device", default="cpu")
    ts.add_argument("--keep", action="store_true", help="keep the run directories")
    gg = sub.add_parser("gguf", help="GGUF export of a synthetic base + adapter (merged on the fly): peak RSS, bytes, time vs disk")
    gg.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    gg.add_argument("--type", default="q8_0", help="any slimtune export --type, the K-quant mixes included (default q8_0)")
    gg.add_argument("--out", type=Path, default=Path("bench-out"))
    gg.add_argument("--layers", type=int, default=None, help="override the number of layers")
    gg.add_argument("--tokenizer", type=Path, default=None, help="tokenizer files for the base (default: SmolLM2's)")
    gg.add_argument("--peer", choices=["llama.cpp"], help="also slimtune merge + llama.cpp's convert_hf_to_gguf.py on it")
    gg.add_argument("--no-verify", dest="verify", action="store_false", help="export without the sha256 check of the base and adapter")
    gs = sub.add_parser("gguf-stages", help="a GGUF export's stages timed one by one, one thread (bench/gguf_stages.py)")
    gs.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    gs.add_argument("--layers", type=int, default=None)
    gs.add_argument("--out", type=Path, default=Path("bench-out"))
    gs.add_argument("--block-type", default="Q8_0", help="a slimtune.gguf.ggml block type (default Q8_0)")
    gq = sub.add_parser("gguf-quality", help="q4_k_m of the real SmolLM2 + adapter: KL and top-1 vs the fp32 merge, slimtune vs llama.cpp")
    gq.add_argument("--b-std", type=float, default=0.01, help="the random adapter's B ~ N(0, this) (default 0.01)")
    gq.add_argument("--steps", type=int, default=0, help="train the adapter with slimtune finetune for this many steps instead")
    gq.add_argument("--adapter", type=Path, default=None, help="a PEFT adapter of SmolLM2 instead of training one")
    gq.add_argument("--rows", type=int, default=12, help="held-out chat rows evaluated, besides one prose+code text (default 12)")
    gq.add_argument("--out", type=Path, default=Path("bench-out/gguf-quality"))
    gv = sub.add_parser(
        "gguf-vision", help="GGUF + mmproj of a tiny trained SmolVLM, Gemma 3 or Qwen2.5-VL vs llama.cpp's convert_hf_to_gguf.py (--mmproj)"
    )
    gv.add_argument(
        "--family", choices=("idefics3", "gemma3", "qwen2_5_vl"), default="idefics3", help="the vision family (default idefics3)"
    )
    gv.add_argument("--type", choices=("f16", "f32", "bf16", "q8_0"), default="f16", help="both files' type and the converter's --outtype")
    gv.add_argument("--out", type=Path, default=Path("bench-out/gguf-vision"))
    gv.add_argument("--tokenizer", type=Path, default=None, help="the text tokenizer (default: SmolLM2's, make real-model)")
    gv.add_argument("--lora-vision", action="store_true", help="train with lora.vision=true (the tower's merged weights in the mmproj)")
    gv.add_argument(
        "--python", type=Path, default=None, help="the converter's interpreter (default: bench/peers/.venv-llamacpp's, else this one)"
    )
    args = parser.parse_args(argv)
    quiet_library_logs()
    if args.command == "gguf-vision":
        from bench.gguf_vision import bench_gguf_vision

        for row in bench_gguf_vision(args.out, args.tokenizer or real_model_dir(), args.python, args.lora_vision, args.family, args.type):
            print(json.dumps(row))
    if args.command == "gguf-quality":
        from bench.gguf_quality import bench_gguf_quality  # transformers, peft, llama_cpp: only for this bench

        args.out.mkdir(parents=True, exist_ok=True)
        print(json.dumps(bench_gguf_quality(args.out, args.steps, args.adapter, args.rows, args.b_std)))
    if args.command == "train-step":
        _train_step(args)
    if args.command == "step-memory":
        print(json.dumps(bench_step_memory(args.out, args.preset, args.layers, args.pairs, args.seq)))
    if args.command == "grpo-memory":
        from bench.grpo_memory import bench_grpo_memory

        shape = dict(prompts=args.prompts, generations=args.generations, prompt_tokens=args.prompt_tokens, completion=args.completion)
        print(json.dumps(bench_grpo_memory(args.out, args.preset, args.layers, shape | dict(beta=args.beta))))
    if args.command == "step-profile":
        args.out.mkdir(parents=True, exist_ok=True)
        data = args.data or _real_rows(args.out)
        print(json.dumps(bench_step_profile(args.model, data, args.out, args.warmup, args.steps, threads=args.threads, rounds=args.rounds)))
    if args.command == "seed":
        print_row(bench_seed(args.out, args.rows, args.words, args.eval_fraction, args.layers))
        return
    if args.command == "train-save":
        result = bench_train_save(args.preset, args.out, args.steps, args.save_every, args.layers, args.device)
        if not args.keep:
            for mode in TRAIN_SAVE_MODES:
                shutil.rmtree(args.out / f"run-{mode}", ignore_errors=True)
        print(json.dumps(result))
    if args.command == "gguf-stages":
        from bench.gguf_stages import bench_gguf_stages

        args.out.mkdir(parents=True, exist_ok=True)
        print(json.dumps(bench_gguf_stages(args.preset, args.out, args.layers, args.block_type)))
    if args.command == "gguf":
        args.out.mkdir(parents=True, exist_ok=True)
        print(json.dumps(bench_gguf(args.preset, args.out, args.type, args.layers, args.tokenizer, args.peer, args.verify)))
    if args.command == "dist-save":
        print(json.dumps(bench_dist_save(args.preset, args.out, args.nproc, args.layers)))
    if args.command == "load-moe":
        args.out.mkdir(parents=True, exist_ok=True)
        print(json.dumps(bench_load_moe(args.out, args.layers)))
    if args.command == "load-bnb":
        args.out.mkdir(parents=True, exist_ok=True)
        print(json.dumps(bench_load_bnb(args.out, args.layers, args.bf16_layers)))
    if args.command == "quant":
        print(json.dumps(bench_quant(args.rows, args.threads, args.rounds)))
    if args.command == "bnb-dequant":
        print(json.dumps(bench_bnb_dequant(args.rows, args.cols, args.rounds)))
    if args.command == "nf4":
        print(json.dumps(bench_nf4(device=args.device)))
    if args.command == "merge":
        args.out.mkdir(parents=True, exist_ok=True)
        if args.cold:
            print(json.dumps(bench_merge_cold(args.preset, args.out, args.layers, args.rounds)))
        else:
            print(json.dumps(bench_merge(args.preset, args.out, args.layers, args.device, args.verify)))
    if args.command == "save":
        result = bench_save(args.preset, args.out, args.layers, args.device)
        if not args.keep:
            shutil.rmtree(args.out / f"save-{args.preset}", ignore_errors=True)
        print(json.dumps(result))
