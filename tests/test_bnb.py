"""bitsandbytes 4-bit checkpoints (formats/bnb.py) against bitsandbytes itself (0.50 runs 4-bit on the CPU):
checkpoints written by transformers + bitsandbytes (``BitsAndBytesConfig(load_in_4bit=True, ...)``,
``save_pretrained``) of the tiny model, NF4 and FP4, double quantization on and off, quant_storage u8 and bf16;
every 4-bit weight slimtune reads, whole and by row range, equals ``bitsandbytes.functional.dequantize_4bit``
of the same bytes, bit for bit; a merge from such a base reloads in plain transformers; 8-bit bases are
refused in one line.

Training from such a base (quant.bnb4, model.load_qlora_model): every layout loads with its 4-bit weights as
stored (frozen weights bit-identical to bitsandbytes' dequantization), tied embeddings stored once or twice
and sharded files included; the recipe trains on it and PEFT on the same bitsandbytes model is the oracle:
it loads slimtune's adapter with slimtune's logits, and PEFT + bitsandbytes QLoRA from slimtune's initial
adapters has slimtune's step losses (bounds of test_recipe_real_model); the merged save is a plain 16-bit
model. Those recipe checks run on the tiny model's checkpoint and on the real SmolLM2-135M-Instruct's
(``[smollm2]``: markers slow and real_model; a few steps, as PEFT + bitsandbytes repeats them on the CPU).
Bad states are one line, exit 2."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from slimtune.checkpoint.writer import WriteOptions
from slimtune.cli import main as slimtune_main
from slimtune.errors import SlimtuneError
from slimtune.formats.base_checkpoint import BaseCheckpoint
from slimtune.formats.bnb import four_bit_keys
from slimtune.formats.merge_source import MergeSource
from slimtune.lora import LoRAConfig, qlora_linears
from slimtune.merge import merge_from_files
from slimtune.model import load_qlora_model, nf4_report
from slimtune.quant import base_rows, is_bnb4
from slimtune.tiny import make_tiny_checkpoint
from tests.real_model import bnb_4bit_checkpoint
from tests.test_merge import make_peft_adapter

bnb = pytest.importorskip("bitsandbytes")
from bitsandbytes.functional import QuantState, dequantize_4bit  # noqa: E402

LAYOUTS = {
    "nf4-u8-double": dict(bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_quant_storage=torch.uint8),
    "fp4-bf16-double": dict(bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True, bnb_4bit_quant_storage=torch.bfloat16),
    "nf4-u8-plain-fp16": dict(bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False, bnb_4bit_compute_dtype=torch.float16),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def bnb_base(request, tiny_base, tmp_path_factory):
    return bnb_4bit_checkpoint(tiny_base, tmp_path_factory.mktemp("bnb") / request.param, **LAYOUTS[request.param])


def _tensors(path) -> dict[str, tuple]:
    """Every tensor name of a checkpoint directory -> its file (any number of shards)."""
    return {k: f for f in sorted(path.glob("*.safetensors")) for k in safe_open(str(f), "pt").keys()}


def bnb_reference(path, key: str) -> torch.Tensor:
    """bitsandbytes' own dequantization of the weight ``key`` as stored (its QuantState.from_dict reads the file's
    auxiliary tensors, as transformers does when it loads the checkpoint), from whichever shards hold them."""
    files = _tensors(path)

    def get(name):
        with safe_open(str(files[name]), "pt") as f:
            return f.get_tensor(name)

    aux = {k[len(key) + 1 :]: get(k) for k in files if k.startswith(key + ".")}
    return dequantize_4bit(get(key), QuantState.from_dict(aux, device=torch.device("cpu")))


def assert_frozen_is_bitsandbytes(model, path) -> int:
    """Every 4-bit frozen weight of ``model`` equals bitsandbytes' dequantization of ``path``'s bytes; returns how many."""
    n = 0
    for name, m in qlora_linears(model).items():
        if is_bnb4(m.weight):
            reference = bnb_reference(path, f"{name}.weight")
            assert torch.equal(base_rows(m.weight, 0, m.weight.shape[0]), reference), name
            n += 1
    return n


def test_every_4bit_weight_is_bitsandbytes_dequantization(bnb_base):
    base = BaseCheckpoint(bnb_base)
    try:
        assert len(base.bnb) == 14  # 2 layers x 7 projections
        for key, weight in base.bnb.items():
            reference = bnb_reference(bnb_base, key)
            whole = base.rows(key, 0, weight.shape[0])
            assert whole.dtype == reference.dtype and torch.equal(whole, reference), key
            rows = weight.shape[0]
            assert torch.equal(base.rows(key, rows // 3, rows // 3 + 5), reference[rows // 3 : rows // 3 + 5]), key
    finally:
        base.close()


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double", [True, False], ids=["double", "plain"])
def test_rows_of_any_shape_are_dequantize_4bit(quant_type, double):
    """formats.bnb's row reader against bitsandbytes.functional.dequantize_4bit on shapes whose last 64-block
    and last nested group of 256 blocks are short, whole and by many row ranges (each range's first and last
    block shared with its neighbours), bf16 and fp32 weights."""
    from bitsandbytes.functional import quantize_4bit

    from slimtune.formats.bnb import BnbNF4Weight

    gen = torch.Generator().manual_seed(3)
    for shape, dtype in (((577, 131), torch.bfloat16), ((3, 1000), torch.float32), ((300, 448), torch.bfloat16)):
        w = (torch.randn(*shape, generator=gen) * 0.02).to(dtype)
        packed, qs = quantize_4bit(w, blocksize=64, compress_statistics=double, quant_type=quant_type)
        reference, flat = dequantize_4bit(packed, qs), packed.view(-1)
        nested = (qs.state2.code.float(), qs.state2.absmax.float(), qs.state2.blocksize, float(qs.offset)) if double else None
        ours = BnbNF4Weight("w", shape, dtype, 64, qs.absmax, qs.code.float(), lambda a, b, flat=flat: flat[a:b], nested)
        assert torch.equal(ours.rows(0, shape[0]), reference), shape
        for start in range(0, shape[0], 37):
            for n in (1, 2, 13):
                end = min(shape[0], start + n)
                assert torch.equal(ours.rows(start, end), reference[start:end]), (shape, start, end)


def test_a_merge_from_a_4bit_base_is_a_plain_16bit_model(bnb_base, tiny_base, tmp_path):
    adapter = tmp_path / "adapter"
    make_peft_adapter(tiny_base, adapter, r=4, lora_alpha=8, target_modules=["q_proj"])
    merge_from_files(MergeSource(bnb_base, adapter), tmp_path / "merged", WriteOptions(progress=False))
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in config
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.bfloat16)  # plain transformers
    key = "model.layers.1.mlp.down_proj.weight"
    reference = bnb_reference(bnb_base, key)
    assert torch.equal(merged.state_dict()[key], reference.to(merged.dtype))  # the file's weight is the merge base


def test_8bit_bases_are_refused_in_one_line(bnb_base, tmp_path):
    eight = tmp_path / "eight"
    shutil.copytree(bnb_base, eight)
    config = json.loads((eight / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False}
    (eight / "config.json").write_text(json.dumps(config))
    for load in (BaseCheckpoint, lambda d: load_qlora_model(d, progress=False)):
        with pytest.raises(SlimtuneError, match="a bitsandbytes 8-bit checkpoint .* not 8-bit: use the model's 16-bit checkpoint"):
            load(eight)


def test_training_loads_every_layout_with_bitsandbytes_weights(bnb_base):
    """All-linear adapters on each layout: the 14 projections are the file's 4-bit weights, bit-identical to
    bitsandbytes' dequantization, in the quant state's dtype; lm_head (llm_int8_skip_modules) stays a plain
    16-bit weight; nothing was dequantized to a 16-bit copy (the frozen weights hold the 4-bit bytes)."""
    model = load_qlora_model(bnb_base, LoRAConfig(rank=4, alpha=8), progress=False)
    assert assert_frozen_is_bitsandbytes(model, bnb_base) == 14
    assert nf4_report(model)["bnb4"] == 14 and nf4_report(model)["nf4"] == 0
    assert model.lm_head.weight.dtype == torch.bfloat16 and not is_bnb4(model.lm_head.weight)
    held = sum(m.weight.nbytes_held() for m in qlora_linears(model).values())
    # the 4-bit codes are a quarter of bf16's bytes; the block state adds 1/64 to 1/16 byte an element (+ small maps)
    assert held < 0.32 * sum(m.weight.numel() * 2 for m in qlora_linears(model).values())
    with pytest.raises(NotImplementedError, match="supports only reading rows"):
        model.model.layers[0].mlp.up_proj.weight + 1  # no silent 16-bit computation on the 4-bit weight


@pytest.mark.parametrize("copies", ["once", "twice"])
def test_tied_embeddings_and_sharded_files(copies, tmp_path):
    """A tied base saved by transformers (lm_head not stored) in 100 KB shards, a weight's auxiliary tensors in
    other shards than its bytes; "twice": lm_head stored too (a copy of the embedding), as some repos ship."""
    from safetensors.torch import load_file, save_file

    tied = make_tiny_checkpoint(tmp_path / "tied", seed=2, tie_word_embeddings=True)
    out = bnb_4bit_checkpoint(tied, tmp_path / "bnb", max_shard_size="100KB", bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3 and "lm_head.weight" not in index["weight_map"]
    if copies == "twice":
        shard = out / index["weight_map"]["model.embed_tokens.weight"]
        tensors = load_file(str(shard))
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        save_file(tensors, str(shard), metadata={"format": "pt"})
        index["weight_map"]["lm_head.weight"] = shard.name
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load_qlora_model(out, LoRAConfig(rank=4, alpha=8), progress=False)
    assert assert_frozen_is_bitsandbytes(model, out) == 14
    assert model.lm_head.weight is model.model.embed_tokens.weight


def _break(src, tmp_path, edit_config=None, edit_state=None):
    """A copy of the bnb base with its config.json or one quant state edited."""
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    if edit_config:
        config = json.loads((bad / "config.json").read_text())
        edit_config(config["quantization_config"])
        (bad / "config.json").write_text(json.dumps(config))
    if edit_state:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(bad / "model.safetensors"))
        key = next(k for k in tensors if k.startswith("model.layers.0.mlp.up_proj.weight.quant_state."))
        state = json.loads(bytes(tensors[key].tolist()))
        edit_state(state)
        tensors[key] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
        save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    return bad


BAD_STATES = {
    "shape": (None, lambda s: s.update(shape=[128, 512]), "tensor model.layers.0.mlp.up_proj.weight has 4-bit weight"),
    "quant_type": (lambda q: q.update(bnb_4bit_quant_type="int3"), None, "bnb_4bit_quant_type 'int3': expected 'nf4' or 'fp4'"),
    "8bit": (lambda q: q.update(load_in_4bit=False, load_in_8bit=True), None, "a bitsandbytes 8-bit checkpoint"),
    "gptq": (lambda q: q.update(quant_method="gptq"), None, "quant_method gptq: slimtune trains from 16-bit bases"),
}


# The acceptance layout: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True), NF4, with bf16 as
# bitsandbytes' compute dtype (slimtune computes in bf16: the oracle then runs the same matmuls).
ACCEPTANCE = dict(bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def trained_base(tiny_base, tmp_path_factory):
    return bnb_4bit_checkpoint(tiny_base, tmp_path_factory.mktemp("bnb-train") / "base", **ACCEPTANCE)


@pytest.mark.parametrize("case", list(BAD_STATES))
def test_bad_4bit_bases_are_one_line_exit_2(case, trained_base, tmp_path, capsys):
    edit_config, edit_state, message = BAD_STATES[case]
    bad = _break(trained_base, tmp_path, edit_config, edit_state)
    run = tmp_path / "run"
    args = ["finetune", "--config", "tiny", f"model.path={bad}", "model.create_tiny=false", f"output_dir={run}"]
    args.append("logging.progress_bar=false")
    assert slimtune_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").glob("step-*"))


# Training steps of the recipe run each oracle compares with (few: PEFT + bitsandbytes repeats them on the CPU),
# and how far the loss must fall by the last (real training, not a flat curve).
STEPS = {"tiny": 4, "smollm2": 3}
LOSS_DROP = {"tiny": 0.3, "smollm2": 0.3}


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=[pytest.mark.slow, pytest.mark.real_model])])
def run(request, tmp_path_factory):
    """``slimtune finetune --config tiny model.path=BNB_DIR model.create_tiny=false ...`` (the real-model test's
    settings, tests/real_model.SETTINGS) for STEPS steps, one merged save at the end, on the tiny model's bnb
    checkpoint or on the real SmolLM2-135M-Instruct's (quantized here by transformers + bitsandbytes, the same
    layout); its printed log and data."""
    from transformers import AutoTokenizer

    from slimtune.config import load_config
    from slimtune.data import DataSpec, load_data
    from tests.real_model import finetune_overrides, write_docstring_data

    root = tmp_path_factory.mktemp(f"bnb-run-{request.param}")
    if request.param == "tiny":
        base = request.getfixturevalue("trained_base")
    else:
        base = bnb_4bit_checkpoint(request.getfixturevalue("smollm2_dir"), root / "bnb", **ACCEPTANCE)
    steps = STEPS[request.param]
    train, held_out = write_docstring_data(root / "data")
    overrides = finetune_overrides(base, train, held_out, root / "run", steps)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # no held-out evaluation: no check here reads it (the logits check uses 4 rows)
        code = slimtune_main(["finetune", "--config", "tiny", *overrides, "dataset.eval_path=null"])
    assert code in (0, None), out.getvalue()[-2000:]
    metrics = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    (ckpt,) = sorted((root / "run").glob("step-*"))
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    data = load_data(DataSpec.from_config(load_config("tiny", overrides)), tokenizer)
    return SimpleNamespace(
        name=request.param, base=base, steps=steps, four_bit=len(four_bit_keys(_tensors(base))), log=out.getvalue(),
        metrics=metrics, ckpt=ckpt, data=data, pad_id=tokenizer.pad_token_id,
    )  # fmt: skip


def _slimtune_model(run):
    """slimtune's adapter form of the checkpoint: the 4-bit base as training loads it, the saved adapters."""
    from slimtune.model import load_adapter_weights
    from tests.real_model import SETTINGS, TARGETS

    model = load_qlora_model(run.base, LoRAConfig(SETTINGS["rank"], SETTINGS["alpha"], 0.0, False, TARGETS), progress=False)
    load_adapter_weights(model, run.ckpt / "adapter" / "adapter_model.safetensors")
    return model.eval()


def _bnb_hf(path):
    """transformers + bitsandbytes' own load of the 4-bit checkpoint (Linear4bit layers)."""
    return AutoModelForCausalLM.from_pretrained(str(path), device_map="cpu", dtype=torch.bfloat16)


def test_recipe_trains_on_the_4bit_base_and_says_what_it_merged_into(run):
    n = run.four_bit  # tiny: 2 layers x 7 projections; SmolLM2: 30 x 7
    assert n == {"tiny": 14, "smollm2": 210}[run.name]
    assert f"bitsandbytes 4-bit, as the base file stores it: {n} of {n} targets" in run.log
    assert "merge base of the merged saves: the base file's dequantized 4-bit weights" in run.log
    assert [r["step"] for r in run.metrics][-1] == run.steps and run.metrics[-1]["loss"] < run.metrics[0]["loss"]
    card = (run.ckpt / "README.md").read_text()
    assert "on a bitsandbytes 4-bit `llama` base" in card and "the base file's dequantized weight" in card
    recorded = json.loads((run.ckpt / "slimtune_format.json").read_text())["nf4"]
    assert recorded["bnb4"] == n and recorded["nf4"] == 0
    assert assert_frozen_is_bitsandbytes(_slimtune_model(run), run.base) == n


def test_merged_save_is_the_file_weight_plus_the_adapter_and_reloads_in_transformers(run):
    from safetensors.torch import load_file

    from slimtune.lora import merge_lora_rows

    config = json.loads((run.ckpt / "config.json").read_text())
    assert "quantization_config" not in config
    merged = AutoModelForCausalLM.from_pretrained(str(run.ckpt), dtype=torch.bfloat16)  # plain transformers: no bitsandbytes layers
    assert not any("4bit" in type(m).__name__ for m in merged.modules())
    adapter = load_file(str(run.ckpt / "adapter" / "adapter_model.safetensors"))
    key = "model.layers.1.self_attn.v_proj"
    a, b = adapter[f"base_model.model.{key}.lora_A.weight"], adapter[f"base_model.model.{key}.lora_B.weight"]
    expected = merge_lora_rows(bnb_reference(run.base, f"{key}.weight"), a, b, 16.0 / 8).to(torch.bfloat16)
    assert torch.equal(merged.state_dict()[f"{key}.weight"], expected)  # round(dequant_bnb(W4) + s B A), once


def test_peft_on_the_bitsandbytes_model_applies_the_adapter_with_slimtune_logits(run):
    """PEFT loads slimtune's adapter onto transformers' own 4-bit load of the same file; the logits agree within
    test_recipe_real_model's bounds, relative to how far the adapter moves them."""
    from peft import PeftModel

    from slimtune.data import collate
    from tests.test_recipe_real_model import LOGITS_BOUND

    batch = {k: v for k, v in collate(run.data.eval[:4], run.pad_id).items() if k != "labels"}
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        ours = _slimtune_model(run)(**batch).logits.float()[mask]
        theirs = PeftModel.from_pretrained(_bnb_hf(run.base), run.ckpt / "adapter").eval()(**batch).logits.float()[mask]
        base = _bnb_hf(run.base).eval()(**batch).logits.float()[mask]
    diff, moved = (theirs - ours).abs(), (base - ours).abs()
    print(f"adapter form vs PEFT + bitsandbytes: mean |logit diff| {diff.mean():.5f}, max {diff.max():.4f}; adapter: {moved.mean():.4f}")
    assert moved.mean() > 0.01  # the adapter does change the logits
    assert diff.mean() <= LOGITS_BOUND * moved.mean(), (diff.mean(), moved.mean())
    assert diff.max() <= 0.1 * moved.max(), (diff.max(), moved.max())


def test_step_losses_equal_peft_bitsandbytes_qlora(run):
    """PEFT LoRA on transformers' 4-bit load of the same file (bitsandbytes' Linear4bit), from slimtune's initial
    adapters, on the same batches, loss, AdamW and schedule: step losses within test_recipe_real_model's bounds."""
    from tests.real_model import initial_adapters, peft_lora_model, peft_train
    from tests.test_recipe_real_model import FIRST_STEP_BOUND, STEP_LOSS_BOUND

    model = peft_lora_model(run.base, initial_adapters(run.base))
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()) == run.four_bit  # bitsandbytes' layers, wrapped by PEFT
    theirs, _ = peft_train(model, run.data.train, run.pad_id, run.steps, run.steps)
    ours = [r["loss"] for r in run.metrics[: run.steps]]
    diffs = [abs(x - y) for x, y in zip(ours, theirs, strict=True)]
    print(f"step losses slimtune {[round(x, 4) for x in ours]}\n   PEFT + bitsandbytes {[round(x, 4) for x in theirs]}")
    assert max(diffs) <= STEP_LOSS_BOUND and diffs[0] <= FIRST_STEP_BOUND, diffs
    assert ours[-1] < ours[0] - LOSS_DROP[run.name]  # real training, not a flat curve
