"""GGUF export (slimtune.gguf.export) checked by llama.cpp itself (llama-cpp-python, dev extras) and by
the gguf package's reader and quantizers.

For every dense family llama.cpp supports: a tiny random model of the family (perturbed weights: a
"merged checkpoint") with a real tokenizer (SmolLM2's byte-level BPE, 49,152 tokens) is exported and
  - loads in llama.cpp;
  - f16/bf16: llama.cpp's logits on a prompt are within LOGIT_BOUND * std(logits) of transformers' (fp32
    forward of the same checkpoint), and the greedy continuation is the same, stepped on transformers'
    choices, a disagreement allowed only where transformers' own top two are within that bound;
  - q8_0: logits within Q8_BOUND std; top-1 agreement >= 95% of the positions that are not near-ties
    (every position on the real SmolLM2-135M);
  - every tensor reads back with gguf.GGUFReader equal to the streamed rows (exactly for f32/f16/bf16;
    byte-equal to gguf.quants.quantize of the whole tensor for quantized types).
The merge on the fly (--base + --adapter, a PEFT adapter) gives the same file as exporting the merged
model that slimtune merge writes. Bad input is one line, exit 2, nothing at --out."""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slimtune.cli import main as slimtune_main
from slimtune.families import family_of, tiny_config
from slimtune.formats.merge_source import MergeSource
from slimtune.gguf.arch import ARCHS, gguf_arch
from slimtune.gguf.export import TYPES, GGUFOptions, export_gguf, gguf_tensors, open_source, tensor_type
from slimtune.tiny import byte_tokenizer
from tests.conftest import llama_cpp_oracle

llama_cpp = llama_cpp_oracle()

LOGIT_BOUND = 0.03  # in units of std(transformers' logits); measured up to 0.005 (f16) on these models
Q8_BOUND = 0.4  # q8_0 (llama.cpp also quantizes activations to 8 bits); measured 0.08-0.20 (tiny), 0.38 (SmolLM2)
NEAR_TIE = 0.15  # std units: transformers' top two closer than this are a near-tie for the q8_0 top-1 check
PROMPT = list(range(100, 140))  # ids every test model's vocabulary has
GREEDY_STEPS = 12


def _tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's real byte-level BPE tokenizer (the real model's cache, fetched where missing)."""
    from tests.real_model import ensure_real_model

    return ensure_real_model()


_BYTE_VOCAB = ("qwen2", "mixtral", "qwen3_moe")
"""transformers 5 loads any tokenizer of a qwen2 model as Qwen2Tokenizer (Qwen's split regex), so SmolLM2's
vocabulary there tokenizes as no real model does and llama.cpp has no name for it: the Qwen2 model gets the
merge-free byte-level tokenizer, where the split cannot change the ids; the MoE models too (what they test
is the experts; the small vocabulary keeps them cheap)."""


def _family_model(d: Path, model_type: str, real: bool, tmp_path_factory) -> Path:
    """A tiny random model of the family (perturbed: trained-looking) with SmolLM2's tokenizer (``real``,
    49,152 tokens) or the byte-level one (272)."""
    extra = dict(query_pre_attn_scalar=32) if model_type.startswith("gemma") else {}  # llama.cpp scales by head_dim
    if model_type == "qwen3_moe":  # what llama.cpp's qwen3moe computes: every layer MoE, top-k weights normalized
        extra = dict(mlp_only_layers=[], norm_topk_prob=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family_of(model_type), vocab_size=49152 if real else 272, **extra))
    with torch.no_grad():
        for p in model.parameters():  # trained-looking: norms away from 1, biases away from 0
            p.add_(torch.randn_like(p) * 0.02)
    model.to(torch.bfloat16).save_pretrained(d)
    if real:
        for f in _tokenizer_dir(tmp_path_factory).glob("*token*"):
            shutil.copy(f, d)
    else:
        byte_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory):
    made: dict[str, Path] = {}

    def make(model_type: str) -> Path:
        if model_type not in made:
            d = tmp_path_factory.mktemp(f"gguf-{model_type}")
            made[model_type] = _family_model(d, model_type, model_type not in _BYTE_VOCAB, tmp_path_factory)
        return made[model_type]

    return make


@pytest.fixture(scope="session")
def byte_vocab_family_dirs(family_dirs, tmp_path_factory):
    """Each family's tiny model with the byte-level tokenizer (272 tokens), for the checks that look at
    the weights, not the vocabulary (the mixes' files): a 49,152-token vocabulary made each export, each
    llama-quantize and each load there several seconds. The families that have it already share theirs."""
    made: dict[str, Path] = {}

    def make(model_type: str) -> Path:
        if model_type in _BYTE_VOCAB:
            return family_dirs(model_type)
        if model_type not in made:
            made[model_type] = _family_model(tmp_path_factory.mktemp(f"gguf-bytes-{model_type}"), model_type, False, tmp_path_factory)
        return made[model_type]

    return make


def export(src: Path, typ: str, out: Path, *extra: str) -> Path:
    assert slimtune_main(["export", str(src), "--type", typ, "--out", str(out), *extra]) == 0
    return out


def hf_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def cpp_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


@pytest.fixture(autouse=True)
def _no_weight_repacking(monkeypatch):
    """llama.cpp's CPU weight repacking (its "extra buffer types", on by default) segfaulted in decode for
    every quantized file on this machine's AMX CPU with llama-cpp-python 0.3.36, also for a file the gguf
    package's own plain writer makes from the same tensors (byte-identical to ours). Loaded without it, as
    llama.cpp's --no-repack does; the model's numbers are the same."""
    default = llama_cpp.llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    monkeypatch.setattr(llama_cpp.llama.llama_cpp, "llama_model_default_params", params)


class Reader(gguf.GGUFReader):
    """gguf.GGUFReader, but an array field of strings or numbers is parsed in one loop over its items, on a
    plain ndarray view of the file, instead of one recursive call per item making np.memmap views: the stock
    reader spends seconds per file on a 49,152-token vocabulary (tokens, merges, token types), and this
    module reads some 30 such files. Its fields (offsets, parts, data indices, types, contents) and tensors
    equal the stock reader's (test_reader_equals_the_gguf_reader); the tensors are read by its own code."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if gguf.GGUFValueType(raw_type) != gguf.GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
            return super()._get_field_parts(orig_offs, raw_type)
        data = self.data.view(np.ndarray)
        raw_itype, alen = data[orig_offs : orig_offs + 4].view(np.uint32), data[orig_offs + 4 : orig_offs + 12].view(np.uint64)
        itype, n, offs = gguf.GGUFValueType(raw_itype[0]), int(alen[0]), orig_offs + 12
        parts: list = [raw_itype, alen]
        if itype == gguf.GGUFValueType.STRING:
            for _ in range(n):
                (length,) = struct.unpack_from("<Q", data, offs)
                parts += (data[offs : offs + 8].view(np.uint64), data[offs + 8 : offs + 8 + length])
                offs += 8 + length
            idxs = list(range(3, 2 + 2 * n, 2))
        elif (nptype := self.gguf_scalar_to_np.get(itype)) is not None:
            size = np.dtype(nptype).itemsize
            values = data[offs : offs + n * size].view(nptype)
            parts += (values[i : i + 1] for i in range(n))
            idxs = list(range(2, 2 + n))
            offs += n * size
        else:  # arrays of arrays: the stock reader's way
            return super()._get_field_parts(orig_offs, raw_type)
        return offs - orig_offs, parts, idxs, [gguf.GGUFValueType.ARRAY, *([itype] if n else [])]


def load_cpp(path: Path):
    return llama_cpp.Llama(str(path), logits_all=True, verbose=False, n_ctx=256, n_threads=2)


def check_readback(path: Path, src: Path, typ: str) -> None:
    """Every tensor of the file equals the stream's rows, encoded as the type says."""
    reader = Reader(path)
    by_name = {t.name: t for t in reader.tensors}
    with open_source(MergeSource(checkpoint=src)) as source:
        arch = gguf_arch(source.config)
        entries = gguf_tensors(arch, source.stream)
        assert sorted(by_name) == sorted(g.name for _, g in entries)
        for _, g in entries:
            got = by_name[g.name]
            want = g.rows(0, g.num_rows).float().reshape(-1, g.shape[-1] if len(g.shape) > 1 else 1).numpy()
            qtype = tensor_type(g.name, g.shape, TYPES[typ])
            assert got.tensor_type == qtype, g.name
            assert list(reversed([int(x) for x in got.shape])) == list(getattr(g, "file_shape", None) or g.shape or (1,)), g.name
            if qtype == gguf.GGMLQuantizationType.F32:
                assert np.array_equal(np.asarray(got.data).reshape(want.shape), want), g.name
            else:
                expected = gguf.quants.quantize(want, qtype)
                assert np.asarray(got.data).tobytes() == np.ascontiguousarray(expected).tobytes(), g.name


def check_close_and_greedy(llm, model_dir: Path) -> float:
    """Logits within the bound; greedy equal but for near-ties. Returns the max |diff| in std units."""
    hf = hf_logits(model_dir, PROMPT)
    cpp = cpp_logits(llm, PROMPT)
    scale = float(hf.std())
    err = float(np.abs(cpp - hf).max()) / scale
    assert err <= LOGIT_BOUND, f"max |llama.cpp - transformers| = {err:.4f} std"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    seq, ties = list(PROMPT), 0
    with torch.no_grad():
        for _ in range(GREEDY_STEPS):
            lh = model(torch.tensor([seq])).logits[0, -1].numpy()
            lc = cpp_logits(llm, seq)[-1]
            th, tc = int(lh.argmax()), int(lc.argmax())
            if th != tc:
                assert lh[th] - lh[tc] <= LOGIT_BOUND * scale, f"greedy differs at step {len(seq) - len(PROMPT)}"
                ties += 1
            seq.append(th)
    assert ties <= GREEDY_STEPS // 4
    return err


FAMILY_TYPES = [
    ("llama", "f16"),
    ("llama", "bf16"),
    ("mistral", "f16"),
    ("qwen2", "f16"),
    ("qwen3", "bf16"),
    ("gemma2", "f16"),
    ("gemma3_text", "bf16"),
    ("phi3", "f16"),
    ("olmo2", "f16"),
    ("gpt_neox", "f16"),
    ("gpt2", "bf16"),
    ("mixtral", "f16"),
    ("qwen3_moe", "bf16"),
]


@pytest.mark.parametrize("model_type,typ", FAMILY_TYPES, ids=[f"{m}-{t}" for m, t in FAMILY_TYPES])
def test_family_loads_in_llama_cpp_with_transformers_logits(family_dirs, tmp_path, model_type, typ):
    src = family_dirs(model_type)
    path = export(src, typ, tmp_path / f"model-{typ}.gguf")
    check_readback(path, src, typ)
    llm = load_cpp(path)
    check_close_and_greedy(llm, src)
    qpath = export(src, "q8_0", tmp_path / "model-q8_0.gguf")
    check_readback(qpath, src, "q8_0")
    check_q8_0_top1(load_cpp(qpath), src, routed_clearly(src, PROMPT) if model_type in MOE else None)


MOE = ("mixtral", "qwen3_moe")
ROUTER_TIE = 0.02
"""Router logits: where a layer's k-th and (k+1)-th expert are closer than this, q8_0's noise (llama.cpp
also quantizes the activations) can route the token to the other expert, and its logits then differ by
far more than quantization noise. Measured on the tiny Qwen3-MoE (byte vocabulary): the 3 positions over
Q8_BOUND (0.40-0.59 std) had gaps of 0.009, 0.002 and 0.001; positions with gaps >= 0.015 stayed <= 0.2 std."""


def routed_clearly(model_dir: Path, ids: list[int]) -> np.ndarray:
    """Positions whose expert choice no layer leaves within ROUTER_TIE (transformers' router logits)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    k = model.config.num_experts_per_tok
    gaps = []
    routers = [m for n, m in model.named_modules() if n.endswith(".mlp.gate")]
    assert routers, "no router found"
    hooks = [
        r.register_forward_hook(lambda mod, inp, out: gaps.append(_kth_gap(out[0] if isinstance(out, tuple) else out, k))) for r in routers
    ]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return np.all(np.stack(gaps) > ROUTER_TIE, axis=0)


def _kth_gap(router_logits: torch.Tensor, k: int) -> np.ndarray:
    top = router_logits.reshape(-1, router_logits.shape[-1]).topk(k + 1, dim=-1).values
    return (top[:, k - 1] - top[:, k]).numpy()


def check_q8_0_top1(llm, model_dir: Path, keep: np.ndarray | None = None) -> None:
    """q8_0 logits within Q8_BOUND std of transformers'; top-1 equal on >= 95% of the positions that are
    not near-ties. A random tiny model over 49,152 tokens has nearly Gaussian logits, whose top two are
    often closer than q8_0's noise (there, which wins is noise: measured 3 of 40 positions within 0.016
    std); the plain >= 95% over every position is checked on the real SmolLM2 (test_q8_0_real_model).
    ``keep``: the positions checked (a MoE model: those routed clearly, ``routed_clearly``)."""
    hf = hf_logits(model_dir, PROMPT)
    cpp = cpp_logits(llm, PROMPT)
    keep = np.ones(len(PROMPT), dtype=bool) if keep is None else keep
    assert keep.sum() >= len(PROMPT) // 2, f"only {keep.sum()} positions routed clearly"
    scale = float(hf.std())
    err = float(np.abs(cpp - hf)[keep].max()) / scale
    assert err <= Q8_BOUND, f"q8_0: max |llama.cpp - transformers| = {err:.4f} std"
    top2 = np.sort(hf, axis=-1)[:, -2:]
    clear = ((top2[:, 1] - top2[:, 0]) > NEAR_TIE * scale) & keep
    agree = float((cpp.argmax(-1) == hf.argmax(-1))[clear].mean())
    assert clear.sum() >= len(PROMPT) // 4 and agree >= 0.95, f"q8_0 top-1 agreement {agree:.2%} on {clear.sum()} clear positions"


def test_reader_equals_the_gguf_reader(family_dirs, tmp_path):
    """The module's Reader parses an exported file (a 49,152-token vocabulary) exactly as gguf.GGUFReader."""
    path = export(family_dirs("llama"), "q8_0", tmp_path / "m.gguf")
    fast, stock = Reader(path), gguf.GGUFReader(path)
    assert list(fast.fields) == list(stock.fields) and len(fast.fields) > 20
    for name, f in fast.fields.items():
        g = stock.fields[name]
        assert (f.offset, f.name, f.data, f.types) == (g.offset, g.name, g.data, g.types), name
        assert len(f.parts) == len(g.parts), name
        for a, b in zip(f.parts, g.parts, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
        assert f.contents() == g.contents(), name
    assert len(stock.fields["tokenizer.ggml.tokens"].data) == 49152 and stock.fields["tokenizer.ggml.merges"].data
    assert fast.data_offset == stock.data_offset and len(fast.tensors) == len(stock.tensors) > 0
    for t, u in zip(fast.tensors, stock.tensors, strict=True):
        assert (t.name, t.tensor_type, t.n_elements, t.n_bytes) == (u.name, u.tensor_type, u.n_elements, u.n_bytes)
        assert t.data_offset == u.data_offset and t.field.parts[-1].tobytes() == u.field.parts[-1].tobytes(), t.name
        assert list(t.shape) == list(u.shape) and np.asarray(t.data).tobytes() == np.asarray(u.data).tobytes(), t.name


def test_every_family_of_the_table_is_covered():
    assert {m for m, _ in FAMILY_TYPES} == set(ARCHS)


@pytest.mark.parametrize("typ", ["f32", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_other_types_read_back_and_load(family_dirs, tmp_path, typ):
    src = family_dirs("llama")
    path = export(src, typ, tmp_path / f"m-{typ}.gguf")
    check_readback(path, src, typ)
    hf = hf_logits(src, PROMPT).argmax(-1)
    agree = float((cpp_logits(load_cpp(path), PROMPT).argmax(-1) == hf).mean())
    assert agree >= (0.95 if typ == "f32" else 0.5), f"{typ}: top-1 agreement {agree:.2%}"


def test_file_is_the_same_with_or_without_o_direct(family_dirs, tmp_path, monkeypatch):
    """The data section goes to the disk by O_DIRECT where the filesystem takes it (whole aligned blocks,
    ``DirectAppend``), through the page cache where it does not: the same file either way."""
    from slimtune import diskio

    src = family_dirs("llama")
    direct = []
    real = diskio._pwrite_direct
    monkeypatch.setattr(diskio, "_pwrite_direct", lambda fd, view, offset: (direct.append(len(view)), real(fd, view, offset)))
    with_direct = export(src, "q8_0", tmp_path / "direct.gguf").read_bytes()
    monkeypatch.setattr(diskio, "_open_direct", lambda path: None)
    calls = len(direct)
    assert export(src, "q8_0", tmp_path / "buffered.gguf").read_bytes() == with_direct
    assert len(direct) == calls
    if not calls:
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT: both files went through the page cache")
    data_start = gguf.GGUFReader(tmp_path / "direct.gguf").data_offset
    assert sum(direct) > len(with_direct) - data_start - 4096  # all the data but its tail after the last whole block


def test_file_is_the_same_with_the_headers_fast_path_or_the_public_writer(family_dirs, tmp_path, monkeypatch):
    """The head's arrays (a 49,152-token vocabulary, its types and merges) packed whole by the one fast
    path on the ``gguf`` series it was checked against, or item by item by the package's public writer
    (any other series, forced here): the same file, and the plan's size is the file's either way."""
    import importlib.metadata

    from slimtune.gguf import header

    src = family_dirs("llama")
    version = importlib.metadata.version("gguf")
    if not header.fast_packing():
        pytest.skip(f"gguf {version} is not of a series in header._FAST_SERIES: every export already takes the public writer")
    packed = []
    real = header._PackedWriter._pack_val
    monkeypatch.setattr(header._PackedWriter, "_pack_val", lambda self, *a, **k: (packed.append(1), real(self, *a, **k))[1])
    fast = export(src, "q8_0", tmp_path / "fast.gguf").read_bytes()
    assert packed
    monkeypatch.setattr(header, "_FAST_SERIES", ())
    calls = len(packed)
    assert export(src, "q8_0", tmp_path / "public.gguf").read_bytes() == fast
    assert len(packed) == calls  # the public writer wrote the second head
    assert export_gguf(tmp_path / "plan.gguf", GGUFOptions("q8_0", dry_run=True), MergeSource(checkpoint=src)).bytes == len(fast)


def test_adapter_merged_on_the_fly_equals_export_of_the_merged_model(family_dirs, tmp_path):
    """--base + --adapter streams the same merge as `slimtune merge`: the two GGUF files are identical."""
    from peft import LoraConfig, get_peft_model

    base = family_dirs("llama")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "down_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    peft_model.save_pretrained(tmp_path / "adapter")
    assert slimtune_main(["merge", "--base", str(base), "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged")]) == 0
    a = export(tmp_path / "merged", "f32", tmp_path / "a.gguf")
    b = tmp_path / "b.gguf"
    assert slimtune_main(["export", "--base", str(base), "--adapter", str(tmp_path / "adapter"), "--type", "f32", "--out", str(b)]) == 0
    # the merged checkpoint holds bf16 (one rounding); the on-the-fly f32 export keeps the fp32 merge
    ra, rb = Reader(a), Reader(b)
    for ta, tb in zip(ra.tensors, rb.tensors, strict=True):
        assert ta.name == tb.name
        da, db = np.asarray(ta.data), np.asarray(tb.data)
        assert np.array_equal(da, torch.from_numpy(db.copy()).to(torch.bfloat16).float().numpy()), ta.name
    llm = load_cpp(b)
    merged = tmp_path / "merged"
    hf = hf_logits(merged, PROMPT)
    assert float(np.abs(cpp_logits(llm, PROMPT) - hf).max()) / float(hf.std()) <= LOGIT_BOUND


def test_bad_input_is_one_line_exit_2_nothing_written(family_dirs, tmp_path, capsys):
    src = family_dirs("llama")
    odd = tmp_path / "odd"
    shutil.copytree(src, odd)
    cfg = (odd / "config.json").read_text().replace('"model_type": "llama"', '"model_type": "falcon_mamba"')
    (odd / "config.json").write_text(cfg)
    out = tmp_path / "x.gguf"
    assert slimtune_main(["export", str(odd), "--type", "f16", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "falcon_mamba" in err and "cannot be exported to GGUF" in err
    assert not out.exists() and not list(tmp_path.glob(".x.gguf*"))
    # rows of 80 values cannot take q8_0's 32-value blocks
    narrow = tmp_path / "narrow"
    config = tiny_config(family_of("llama"), vocab_size=49152, hidden_size=80, num_attention_heads=4, num_key_value_heads=4, head_dim=20)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(narrow)
    for f in src.glob("*token*"):
        shutil.copy(f, narrow)
    assert slimtune_main(["export", str(narrow), "--type", "q8_0", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "blocks of 32" in err
    assert not out.exists() and not list(tmp_path.glob(".x.gguf*"))


def test_training_writes_gguf_beside_the_final_checkpoint(tmp_path):
    """checkpoint.gguf: q8_0 -> model-q8_0.gguf + Modelfile in the run directory, from the final merged checkpoint."""
    from slimtune.config import load_config
    from slimtune.recipes.finetune import run_finetune

    run_dir = tmp_path / "run"
    values = {"output_dir": str(run_dir), "training.max_steps": 2, "training.total_epochs": 10**6, "checkpoint.gguf": "q8_0"}
    result = run_finetune(load_config("tiny", values={**values, "overwrite": True}))
    path = run_dir / "model-q8_0.gguf"
    assert path.is_file() and (run_dir / "Modelfile").read_text().startswith("FROM ./model-q8_0.gguf")
    check_readback(path, result.checkpoint, "q8_0")
    check_q8_0_top1(load_cpp(path), result.checkpoint)


@pytest.mark.real_model
def test_q8_0_real_model_top1(tmp_path):
    """The real SmolLM2-135M-Instruct (30 layers, tied embeddings) in q8_0: llama.cpp's top-1 equals
    transformers' (fp32 forward of the bf16 checkpoint) on >= 95% of the positions of a real text."""
    src = _tokenizer_dir(None)
    path = export(src, "q8_0", tmp_path / "smollm2-q8_0.gguf")

    text = (
        "A checkpoint is an ordered stream of named tensors. Each tensor is produced on demand, a few rows at a time, "
        "so the memory holds one chunk and never the whole model. def merge(w, a, b): return w + b @ a  # fp32, one rounding"
    )
    tok = AutoTokenizer.from_pretrained(src)
    chat = [
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
        {"role": "assistant", "content": "The capital of France is Paris, a city on the Seine known for the Eiffel Tower."},
    ]
    llm, same, total = load_cpp(path), 0, 0
    for ids in (tok.encode(text), tok.encode(tok.apply_chat_template(chat, tokenize=False))):
        same += int((cpp_logits(llm, ids).argmax(-1) == hf_logits(src, ids).argmax(-1)).sum())
        total += len(ids)
    # measured 119 of 123 (96.7%); the 4 misses are near-ties (top two within 0.05 std)
    assert total >= 100 and same / total >= 0.95, f"q8_0 top-1 agreement {same / total:.2%} over {total} positions"


# --- K-quant mixes: slimtune's file equals llama_model_quantize(slimtune's f32 file) -------------------------

MIXES = ["q4_k_m", "q4_k_s", "q5_k_m", "q5_k_s", "q6_k", "q3_k_s", "q3_k_m", "q3_k_l", "q2_k"]
LLAMA_QUANTIZE_ADDS: frozenset[str] = frozenset()
"""Metadata keys llama-quantize writes that slimtune's mix export does not: none (it sets general.file_type
and general.quantization_version, which slimtune writes with the same values; measured on every mix here)."""


def _kquant_llama(tmp_path_factory, width: int, layers: int, inter: int, tied: bool, kv_heads: int = 1) -> Path:
    d = tmp_path_factory.mktemp(f"kquant-llama-{width}-{layers}")
    torch.manual_seed(0)
    cfg = tiny_config(
        family_of("llama"), hidden_size=width, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=kv_heads, tie_word_embeddings=tied,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.to(torch.bfloat16).save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def kquant_models(tmp_path_factory):
    """Tiny Llamas for the mixes: rows of 256 (tied embeddings: token_embd takes output's Q6_K), and rows
    of 320 that need llama.cpp's fallbacks (untied; ffn_down's rows of 512 still take K-quants)."""
    return {256: _kquant_llama(tmp_path_factory, 256, 2, 256, True), 320: _kquant_llama(tmp_path_factory, 320, 2, 512, False)}


@pytest.fixture(scope="session")
def kquant_f32(kquant_models, tmp_path_factory):
    """slimtune's own f32 file of each width's model, exported once: the input of every mix's oracle."""
    return {w: export(src, "f32", tmp_path_factory.mktemp(f"kquant-f32-{w}") / "f32.gguf") for w, src in kquant_models.items()}


def llama_quantize(src: Path, out: Path, mix: str) -> Path:
    """llama.cpp's own llama-quantize (llama_model_quantize, no importance matrix) of a GGUF file."""
    from slimtune.gguf.mix import MIXES as FTYPES

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = int(FTYPES[mix][1]), 2
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params) == 0
    return out


def assert_same_gguf(ours: Path, theirs: Path, ignore_keys: frozenset[str] = frozenset()) -> None:
    """Tensor for tensor equal (name, GGML type, shape, data bytes) and metadata equal but for ``ignore_keys``."""
    a, b = Reader(ours), Reader(theirs)
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    assert sorted(ta) == sorted(tb)
    for name, t in ta.items():
        u = tb[name]
        assert t.tensor_type == u.tensor_type, f"{name}: {t.tensor_type.name}, llama.cpp {u.tensor_type.name}"
        assert list(t.shape) == list(u.shape), name
        assert np.asarray(t.data).tobytes() == np.asarray(u.data).tobytes(), f"{name} ({t.tensor_type.name}): data differ"
    fa = {k: f.contents() for k, f in a.fields.items() if not k.startswith("GGUF.") and k not in ignore_keys}
    fb = {k: f.contents() for k, f in b.fields.items() if not k.startswith("GGUF.") and k not in ignore_keys}
    assert fa == fb, {k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k)}


@pytest.mark.parametrize("width", [256, 320])
@pytest.mark.parametrize("mix", MIXES)
def test_mix_equals_llama_quantize(kquant_models, kquant_f32, tmp_path, mix, width):
    """`slimtune export --type MIX` is byte for byte llama-quantize's MIX of slimtune's own f32 file, and loads."""
    src, f32 = kquant_models[width], kquant_f32[width]
    ours = export(src, mix, tmp_path / f"{mix}.gguf")
    assert_same_gguf(ours, llama_quantize(f32, tmp_path / f"{mix}-llama.gguf", mix), LLAMA_QUANTIZE_ADDS)
    types = {t.name: t.tensor_type.name for t in Reader(ours).tensors}
    if width == 320:  # the fallbacks happened: rows of 320 in 32-blocks, ffn_down's 512 in K-quants
        assert types["blk.0.attn_q.weight"] in ("Q4_0", "Q5_0", "Q5_1", "Q8_0") and types["blk.0.ffn_down.weight"].endswith("_K")
    else:
        assert types["token_embd.weight"] == "Q6_K" and "output.weight" not in types  # tied
    logits = cpp_logits(load_cpp(ours), PROMPT[:8])
    assert np.isfinite(logits).all() and logits.std() > 0


def test_mix_types_on_8_layers_equal_llama_quantize(tmp_path_factory, tmp_path, capsys):
    """The per-layer rules (use_more_bits, q4_k_s's first 4 attn_v and first eighth of ffn_down, q3_k_m's
    first 2 attn_v and first sixteenth of ffn_down) on 8 and 16 layers, and q2_k's attn_v below 4 query
    heads per KV head: `--dry-run`'s type table equals llama-quantize's types, and its size the written file's."""
    src = _kquant_llama(tmp_path_factory, 256, 8, 256, False)
    f32 = export(src, "f32", tmp_path / "f32.gguf")
    for mix in MIXES:
        out = tmp_path / f"{mix}.gguf"
        capsys.readouterr()
        assert slimtune_main(["export", str(src), "--type", mix, "--out", str(out), "--dry-run"]) == 0
        lines = capsys.readouterr().out.strip().splitlines()
        planned = {line.split()[0]: line.split()[1] for line in lines[:-1]}
        assert not out.exists() and "nothing written" in lines[-1]
        theirs = Reader(llama_quantize(f32, tmp_path / f"{mix}-llama.gguf", mix))
        assert planned == {t.name: t.tensor_type.name for t in theirs.tensors}, mix
        size = int(lines[-1].split(" tensors, ")[1].split(" bytes")[0].replace(",", ""))
        if mix == "q4_k_m":
            assert size == export(src, mix, out).stat().st_size
    assert planned["blk.0.ffn_down.weight"] == "Q3_K"  # q2_k's ffn_down
    for layers, kv_heads, mixes in ((16, 1, ["q3_k_m"]), (2, 2, ["q2_k"])):
        src = _kquant_llama(tmp_path_factory, 256, layers, 256, False, kv_heads)
        f32 = export(src, "f32", tmp_path / f"f32-{layers}.gguf")
        for mix in mixes:
            capsys.readouterr()
            assert slimtune_main(["export", str(src), "--type", mix, "--out", str(tmp_path / "x.gguf"), "--dry-run"]) == 0
            planned = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.strip().splitlines()[:-1]}
            theirs = Reader(llama_quantize(f32, tmp_path / f"{mix}-{layers}-llama.gguf", mix))
            assert planned == {t.name: t.tensor_type.name for t in theirs.tensors}, (mix, layers)
    assert planned["blk.0.attn_v.weight"] == "Q3_K"  # 2 query heads per KV head


@pytest.mark.parametrize("width", [256, 320])
def test_moe_mixes_equal_llama_quantize(tmp_path_factory, tmp_path, width):
    """An 8-expert Mixtral (llama.cpp's n_expert == 8 rules: attn_v and attn_k Q8_0, attn_output Q5_K in
    q4_k_*, q3_k_s, q3_k_m and q2_k; ffn_down_exps by the layer in its name): q4_k_m, q4_k_s, q5_k_m and
    the 3- and 2-bit mixes at rows of 256, q4_k_m, q3_k_m and q2_k at rows of 320 (fallbacks), byte for
    byte llama-quantize's of slimtune's f32 file; the experts stacked 3-D, the router F32."""
    d = tmp_path_factory.mktemp(f"moe-mix-{width}")
    torch.manual_seed(0)
    inter = 256  # ffn_down's rows of 256 take K-quants at both widths
    cfg = tiny_config(family_of("mixtral"), hidden_size=width, intermediate_size=inter, num_local_experts=8, num_key_value_heads=1)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.to(torch.bfloat16).save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    f32 = export(d, "f32", tmp_path / "f32.gguf")
    # the mixes whose choices differ here (q5_k_s and q6_k apply no rule the 8 experts change; the dense tests cover them)
    for mix in ["q4_k_m", "q4_k_s", "q5_k_m", "q3_k_s", "q3_k_m", "q3_k_l", "q2_k"] if width == 256 else ["q4_k_m", "q3_k_m", "q2_k"]:
        ours = export(d, mix, tmp_path / f"{mix}.gguf")
        assert_same_gguf(ours, llama_quantize(f32, tmp_path / f"{mix}-llama.gguf", mix), LLAMA_QUANTIZE_ADDS)
        tensors = {t.name: t for t in Reader(ours).tensors}
        assert [int(x) for x in tensors["blk.1.ffn_down_exps.weight"].shape] == [inter, width, 8]
        assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
        if mix == "q4_k_m" and width == 256:
            types = [tensors[f"blk.0.{n}.weight"].tensor_type.name for n in ("attn_v", "attn_k", "attn_output")]
            assert types == ["Q8_0", "Q8_0", "Q5_K"]
            logits = cpp_logits(load_cpp(ours), PROMPT[:8])
            assert np.isfinite(logits).all() and logits.std() > 0


def test_experts_are_streamed_by_rows_and_bad_moe_is_one_line(family_dirs, tmp_path, capsys):
    """A chunk of stacked experts reads only the experts its rows cover; a Qwen3-MoE with dense layers
    (mlp_only_layers), which llama.cpp's qwen3moe cannot compute, is one line, exit 2, nothing written."""
    from slimtune.tensors import StreamTensor

    read: list[tuple[int, int, int]] = []

    def expert(e: int) -> StreamTensor:
        def rows(s, t):
            read.append((e, s, t))
            return torch.full((t - s, 4), float(e))

        return StreamTensor(f"model.layers.0.mlp.experts.{e}.down_proj.weight", (6, 4), torch.float32, rows)

    arch = gguf_arch(json.loads((family_dirs("qwen3_moe") / "config.json").read_text()))
    (stacked,) = arch.stack_experts([expert(e) for e in range(4)])
    assert stacked.name == "model.layers.0.mlp.experts.down_proj.weight" and stacked.shape == (24, 4) and stacked.file_shape == (4, 6, 4)
    assert stacked.rows(5, 8)[:, 0].tolist() == [0.0, 1.0, 1.0] and read == [(0, 5, 6), (1, 0, 2)]
    odd = tmp_path / "odd"
    shutil.copytree(family_dirs("qwen3_moe"), odd)
    cfg = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**cfg, "mlp_only_layers": [1]}))
    out = tmp_path / "x.gguf"
    assert slimtune_main(["export", str(odd), "--type", "f16", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mlp_only_layers" in err
    assert not out.exists() and not list(tmp_path.glob(".x.gguf*"))


@pytest.mark.parametrize("model_type", sorted(set(ARCHS) - {"llama"}))
def test_q4_k_m_other_families_equal_llama_quantize(byte_vocab_family_dirs, tmp_path, model_type):
    """q4_k_m of every family but Llama (which has every mix above) equals llama-quantize's, and loads."""
    src = byte_vocab_family_dirs(model_type)
    f32 = export(src, "f32", tmp_path / "f32.gguf")
    ours = export(src, "q4_k_m", tmp_path / "q4_k_m.gguf")
    assert_same_gguf(ours, llama_quantize(f32, tmp_path / "llama.gguf", "q4_k_m"), LLAMA_QUANTIZE_ADDS)
    logits = cpp_logits(load_cpp(ours), PROMPT[:8])
    assert np.isfinite(logits).all() and logits.std() > 0


def test_unknown_type_is_one_line_exit_2(family_dirs, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert slimtune_main(["export", str(family_dirs("llama")), "--type", "q4_k_x", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "q4_k_x" in err and "q4_k_m" in err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_metadata_keys_the_converter_writes(family_dirs, tmp_path):
    """general.type = model (every family) and llama.vocab_size (the converter's LlamaModel), as convert_hf_to_gguf.py writes them."""
    src = family_dirs("llama")
    fields = Reader(export(src, "f16", tmp_path / "m.gguf")).fields
    assert fields["general.type"].contents() == "model"
    assert fields["llama.vocab_size"].contents() == 49152 == len(fields["tokenizer.ggml.tokens"].data)
    qwen = Reader(export(family_dirs("qwen3"), "f16", tmp_path / "q.gguf")).fields
    assert qwen["general.type"].contents() == "model" and "qwen3.vocab_size" not in qwen
