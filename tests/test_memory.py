"""Memory bounds, measured in fresh subprocesses from VmHWM (reset before the phase being measured)."""

import json

from tests.conftest import run_python


def test_save_overhead_is_bounded_for_a_gigabyte_model(tmp_path):
    # 6 layers of the Llama-3.2-1B shape: the merged bf16 copy is ~1.25 GB; the save may add <= 256 MB
    r = run_python(f"from bench.cli import main; main(['save', '--preset', 'llama3.2-1b', '--layers', '6', '--out', '{tmp_path}'])")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["output_bytes"] >= 1_000_000_000
    assert result["overhead_mb"] < 256, result
    # one write of every byte: nothing staged in a scratch file, nothing written twice
    assert abs(result["bytes_written"] - result["output_bytes"]) <= 0.01 * result["output_bytes"], result


LOAD_SCRIPT = """
import json, sys
from pathlib import Path
import torch
from slimtune.synthetic import preset_config, write_synthetic_base
from slimtune.lora import LoRAConfig
from slimtune.memory import peak_rss_mb, reset_peak_rss, rss_mb
from slimtune.model import load_qlora_model
from slimtune.quant import resident_bytes

out = Path(sys.argv[1])
config = preset_config("llama3.2-1b", num_hidden_layers=4, vocab_size=32000, tie_word_embeddings=False)
write_synthetic_base(config, out / "base", max_shard_size="300MB")
bf16_bytes = sum(p.stat().st_size for p in (out / "base").glob("*.safetensors"))
before = rss_mb()
reset_peak_rss()
model = load_qlora_model(out / "base", LoRAConfig(), progress=False)
peak = peak_rss_mb()

resident = sum(resident_bytes(p) for p in model.parameters()) / 2**20
print(json.dumps({"before": before, "peak": peak, "resident_mb": resident, "bf16_mb": bf16_bytes / 2**20}))
"""


def test_streaming_load_holds_nf4_model_plus_bounded_temporaries(tmp_path):
    script = tmp_path / "load.py"
    script.write_text(LOAD_SCRIPT)
    r = run_python(f"import runpy, sys; sys.argv = ['load', '{tmp_path}']; runpy.run_path('{script}', run_name='__main__')")
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["resident_mb"] < 0.6 * m["bf16_mb"], m  # the model really is held quantized
    assert m["peak"] - m["before"] <= m["resident_mb"] + 512, m


QUANTIZE_SCRIPT = """
import json, torch
from slimtune.memory import rss_mb
from slimtune.quant.nf4 import nf4_nbytes, quantize_nf4

torch.manual_seed(0)
weight = (torch.randn(8192, 2048) * 0.02).to(torch.bfloat16)  # the Llama-3.2-1B MLP shape
kept = [quantize_nf4(weight)]  # the allocator's first pattern, before the measure
inputs = [weight.clone() for _ in range(4)]  # made (and resident) before the measure: only quantize_nf4's growth counts
before = rss_mb()
kept += [quantize_nf4(w) for w in inputs]
print(json.dumps({"grew_mb": rss_mb() - before, "kept_mb": sum(map(nf4_nbytes, kept[1:])) / 2**20}))
"""


def test_quantizing_weights_one_after_another_keeps_only_their_nf4_bytes():
    # torchao's to_nf4 makes whole-weight temporaries; freed between the kept NF4 tensors they stayed as
    # holes in the heap (these 4 weights: RSS grew 80 MB for 33 MB kept; the 8B load: ~1.6 GB resident
    # over the model). quantize_nf4 works a piece at a time: RSS grows by the NF4 bytes (40 MB measured)
    # one process's RSS growth moves by tens of MB on a loaded machine (17-94 MB measured for the same
    # 33 MB kept): the least of three processes is held, which the holes (+80 MB, every time) still fail
    runs = []
    for _ in range(3):
        r = run_python(QUANTIZE_SCRIPT)
        assert r.returncode == 0, r.stderr
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
        if runs[-1]["grew_mb"] <= runs[-1]["kept_mb"] + 24:
            return
    assert min(m["grew_mb"] for m in runs) <= runs[0]["kept_mb"] + 24, runs


def test_offline_merge_peak_rss_is_bounded_for_a_gigabyte_base(tmp_path):
    # the whole merge process (interpreter, torch, buffers) must stay under the 512 MB budget the
    # Llama-3-8B bench is held to, on a base of 1.25 GB
    # the synthetic base is a slimtune checkpoint with a manifest: by default the merge hashes each of its
    # shards from its own reads (formats/manifest.ReadCheck with fold), so it reads the base once, as
    # --no-verify does
    for flags in ([], ["--no-verify"]):
        args = ["merge", "--preset", "llama3.2-1b", "--layers", "6", "--out", str(tmp_path), *flags]
        r = run_python(f"from bench.cli import main; main({args!r})")
        assert r.returncode == 0, r.stderr
        result = json.loads(r.stdout.strip().splitlines()[-1])
        assert result["base_bytes"] >= 1_000_000_000
        assert result["peak_rss_mb"] <= 512, result
        assert abs(result["bytes_written"] - result["output_bytes"]) <= 0.01 * result["output_bytes"], result
        assert result["bytes_read"] <= 1.05 * result["base_bytes"], result  # each base byte read once, hashed or not


BNB_LOAD_SCRIPT = """
import json, sys
from slimtune.lora import LoRAConfig
from slimtune.memory import peak_rss_mb, reset_peak_rss, rss_mb
from slimtune.model import load_qlora_model
from slimtune.quant import resident_bytes

before = rss_mb()  # the interpreter, torch, transformers, torchao
reset_peak_rss()
model = load_qlora_model(sys.argv[1], LoRAConfig(), progress=False)
peak = peak_rss_mb()
resident = sum(resident_bytes(p) for p in model.parameters()) / 2**20
print(json.dumps({"before": before, "peak": peak, "resident_mb": resident}))
"""


def test_loading_a_gigabyte_4bit_base_holds_its_files_plus_bounded_temporaries(tmp_path):
    """A bitsandbytes 4-bit checkpoint of the Llama-3.2-1B shape (16 layers, tied 128k vocabulary: 0.98 GB of
    files, the size of the published *-bnb-4bit repo) loads as stored: the whole process's peak RSS (VmHWM, the
    interpreter and its libraries included) is at most the files' size + 512 MB, and what the model holds is
    the files' bytes (4-bit weights as stored, nothing dequantized to 16 bits)."""
    from slimtune.synthetic import preset_config, write_synthetic_bnb_base

    base = write_synthetic_bnb_base(preset_config("llama3.2-1b"), tmp_path / "bnb", max_shard_size="300MB")
    files_mb = sum(p.stat().st_size for p in base.glob("*.safetensors")) / 2**20
    r = run_python(f"import sys; sys.argv = ['load', {str(base)!r}]; exec({BNB_LOAD_SCRIPT!r})")
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    held = m["resident_mb"]
    print(f"4-bit files {files_mb:.0f} MB; RSS before the load {m['before']:.0f} MB, peak {m['peak']:.0f} MB; model holds {held:.0f} MB")
    assert files_mb > 900
    assert m["peak"] <= files_mb + 512, m  # measured 1394 MB for 980 MB of files (385 MB of it before the load)
    assert abs(m["resident_mb"] - files_mb) <= 0.05 * files_mb, m


HEAP_TRIM_SCRIPT = """
import ctypes, json
import torch
from slimtune.memory import REFAULT_S_PER_MB, HeapTrim, rss_mb

libc = ctypes.CDLL(None)
libc.mallopt(-3, 64 * 1024 * 1024)   # M_MMAP_THRESHOLD: the 1 MB blocks below come from the heap
libc.mallopt(-1, 1024 * 1024 * 1024)  # M_TRIM_THRESHOLD: free() alone gives nothing back
idle = HeapTrim(slack_mb=64)
blocks = [torch.ones(256 * 1024) for _ in range(400)]  # 400 x 1 MB, every page touched
grown = rss_mb()
del blocks[::2]  # 200 MB freed between live blocks: no top of the heap to shrink
freed = rss_mb()
lax = HeapTrim(slack_mb=100_000)
lax_trimmed = lax()
after_lax = rss_mb()
trimmed = idle()
after = rss_mb()
again = idle()
now = [0.0]
timed = HeapTrim(slack_mb=64, cost_share=0.02, clock=lambda: now[0])
more = [torch.ones(256 * 1024) for _ in range(400)]
del more[::2]  # another 200 MB kept by glibc: re-faulting it costs ~0.1 s, so a trim waits ~5 s at 2%
grown_timed = rss_mb() - timed.low
now[0] = grown_timed * REFAULT_S_PER_MB / 0.02 * 0.9
early = timed()
now[0] = grown_timed * REFAULT_S_PER_MB / 0.02 * 1.1
late = timed()
print(json.dumps(dict(grown=grown, freed=freed, lax_trimmed=lax_trimmed, after_lax=after_lax, trimmed=trimmed, after=after, again=again,
                      grown_timed=grown_timed, early=early, late=late)))
"""


def test_heap_trim_gives_back_freed_heap_memory_once_the_process_grew_past_its_slack():
    r = run_python(HEAP_TRIM_SCRIPT)
    assert r.returncode == 0, r.stderr
    f = json.loads(r.stdout.strip().splitlines()[-1])
    assert f["freed"] > f["grown"] - 20, f  # glibc kept the freed 200 MB: what HeapTrim is for
    assert not f["lax_trimmed"] and f["after_lax"] > f["freed"] - 20, f  # under its slack: nothing done
    assert f["trimmed"] and f["after"] < f["freed"] - 150, f  # past it: the freed blocks go back
    assert not f["again"], f  # no growth since: no second trim
    assert f["grown_timed"] > 150, f
    assert not f["early"] and f["late"], f  # with cost_share: only once the time since the last trim pays for the re-faulting


def test_every_micro_batch_backward_is_followed_by_a_trim_of_the_one_heap_trim_the_steps_share(qlora_model):
    import torch

    from slimtune.lora import lora_parameters
    from slimtune.recipes import run, train_loop
    from slimtune.recipes.objective import StepBatches
    from slimtune.recipes.objectives.sft import SupervisedObjective

    params = lora_parameters(qlora_model.train())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    seen = []

    class CountingTrim:
        def __call__(self):  # called after the backward: the adapters hold this micro-batch's gradients
            seen.append(all(p.grad is not None for p in params))
            return False

    parts = run.StepParts(
        qlora_model,
        optimizer,
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
        torch.amp.GradScaler("cpu", enabled=False),
        params,
        1.0,
        torch.device("cpu"),
        CountingTrim(),
    )
    ids = torch.randint(0, 100, (2, 8))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    sft = SupervisedObjective(cfg=None)
    train_loop.optimizer_step(parts, sft, StepBatches([batch, batch, batch], 0, {"trained_tokens": 3 * 2 * 7}))
    train_loop.optimizer_step(parts, sft, StepBatches([batch], 0, {"trained_tokens": 2 * 7}))
    assert seen == [True, True, True, True]
    made = run.StepParts(qlora_model, optimizer, parts.scheduler, parts.scaler, params, 1.0, torch.device("cpu")).trim
    assert made.cost_share == run.TRIM_COST_SHARE  # the default: the time rule on


def test_the_recipe_keeps_one_heap_trim_across_its_steps(tmp_path):
    from slimtune.config import load_config
    from slimtune.recipes.finetune import setup, train_step
    from slimtune.recipes.run_steps import restore

    run = setup(load_config("tiny", [f"output_dir={tmp_path / 'run'}", "logging.progress_bar=false", "training.batch_size=2"]))
    restore(run)
    calls = []

    class CountingTrim:
        def __call__(self):
            calls.append(1)
            return False

    run.parts.trim = CountingTrim()  # the step parts are the run's, made once
    train_step(run, [[0, 1]])
    train_step(run, [[2, 3], [4, 5]])
    assert len(calls) == 3  # one per micro-batch, both steps on the run's one trim
