"""preference_loss.py, data/pairs.py and recipes/objectives/preference.py against TRL 1.16 itself (the oracle, never the
implementation): the pairs tokenized and truncated as TRL's DPOTrainer makes them (standard and
conversational rows), bad rows in one line, and on a tiny model and one batch the loss, TRL's reward and
log-probability metrics and the LoRA gradients of DPO (sigmoid), IPO and SimPO equal TRL's DPOTrainer /
CPOTrainer run on a PEFT model over the same NF4-dequantized base with the same reference: the base with
adapters off (fresh adapters) and a frozen copy of the start adapter (model.adapter).

Bound: everything is fp32 on both sides; the two differ only in kernels (slimtune's NF4 linear and
chunked log-softmax, PEFT's and TRL's): loss and metrics within 1e-5 (absolute; the log-probabilities
are sums of ~30 token terms, 1e-4 relative), gradients within 1e-4 of the largest gradient entry."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import peft
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from slimtune.config import load_config
from slimtune.data import IGNORE_INDEX, PairOptions, rank_pairs
from slimtune.data.pairs import BadPair, tokenize_pair
from slimtune.data.readers import Record
from slimtune.distributed import SINGLE
from slimtune.errors import SlimtuneError
from slimtune.formats.peft import lora_key
from slimtune.lora import lora_modules
from slimtune.preference_loss import PreferenceLoss, pair_loss, pair_metric_means
from slimtune.quant import base_rows
from slimtune.recipes.finetune import setup
from slimtune.tiny import byte_tokenizer
from tests.conftest import perturb_adapters

trl = pytest.importorskip("trl")

WORDS = "red green blue cat dog sun moon tree star fish".split()
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_LENGTH = 40  # cuts the longer sequences (keep_start), never a prompt


def pair_rows(n: int = 8, kind: str = "standard") -> list[dict]:
    """Standard or conversational pairs (TRL's dataset takes one kind per file), some longer than MAX_LENGTH."""
    rows = []
    for i in range(n):
        a, b = WORDS[i % len(WORDS)], WORDS[(3 * i + 1) % len(WORDS)]
        tail = " and so on and so forth" * (i % 3)
        if kind == "standard":
            rows.append({"prompt": f"Say {a}:", "chosen": f" {a}.{tail}", "rejected": f" {b}!"})
        else:
            rows.append(
                {
                    "prompt": [{"role": "user", "content": f"Say {a}"}],
                    "chosen": [{"role": "assistant", "content": a + tail}],
                    "rejected": [{"role": "assistant", "content": b}],
                }
            )
    return rows


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pairs")
    files = {}
    for kind in ("standard", "conversational"):
        files[kind] = root / f"{kind}.jsonl"
        files[kind].write_text("".join(json.dumps(r) + "\n" for r in pair_rows(8, kind)))
    return files


def chat_tokenizer():
    """The tiny byte tokenizer with slimtune's fallback chat template set (TRL needs one in the tokenizer)."""
    from slimtune.prompts import FALLBACK_CHAT_TEMPLATE

    tok = byte_tokenizer()
    tok.chat_template = FALLBACK_CHAT_TEMPLATE
    return tok


# ---------------------------------------------------------------------------------------------------
# Data: TRL's tokenization and truncation, bad rows


@pytest.mark.parametrize("kind", ["standard", "conversational"])
def test_pairs_tokenize_and_truncate_as_trl(kind, tiny_base, tmp_path):
    """Every row's two sequences and answer masks equal what TRL's DPOTrainer tokenizes
    (``_prepare_dataset``) and its collator cuts to max_length, keeping the start or the end."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    tok = chat_tokenizer()
    rows = pair_rows(8, kind)
    trainer = _dpo_trainer(_hf_model_like(None, tiny_base), rows, tok, tmp_path, "sigmoid")
    for mode in ("keep_start", "keep_end"):
        ours = [tokenize_pair(Record(r, f"row {i}"), tok, PairOptions(MAX_LENGTH, mode)) for i, r in enumerate(rows)]
        collator = DataCollatorForPreference(pad_token_id=tok.pad_token_id, max_length=MAX_LENGTH, truncation_mode=mode)
        theirs = collator([trainer.train_dataset[i] for i in range(len(rows))])
        mine = rank_pairs(ours, list(range(len(rows))), SINGLE, tok.pad_token_id)
        assert torch.equal(mine["input_ids"], theirs["input_ids"]), mode
        assert torch.equal(mine["attention_mask"], theirs["attention_mask"]), mode
        assert torch.equal((mine["labels"] != IGNORE_INDEX).long(), theirs["completion_mask"]), mode
        assert any(len(p.chosen.input_ids) == MAX_LENGTH for p in ours), "no row was long enough to be cut"


@pytest.mark.parametrize(
    "row, expected",
    [
        ({"prompt": "a", "chosen": "b"}, "missing rejected"),
        ({"prompt": "a", "chosen": "b", "rejected": 3}, "all strings or all lists of messages"),
        ({"prompt": "a", "chosen": " ", "rejected": "c"}, "chosen is empty"),
        ({"prompt": "a", "chosen": "b", "rejected": "b"}, "identical"),
        ({"prompt": [{"role": "user"}], "chosen": [], "rejected": []}, "prompt[0] must be a message"),
        ({"prompt": "x" * 50, "chosen": "b", "rejected": "c"}, "fills dataset.max_seq_len=40"),
    ],
)
def test_bad_pairs_are_one_line(row, expected):
    with pytest.raises(BadPair) as e:
        tokenize_pair(Record(row, "pairs.jsonl:7"), chat_tokenizer(), PairOptions(MAX_LENGTH))
    assert str(e.value).startswith("pairs.jsonl:7: ") and expected in str(e.value) and "\n" not in str(e.value)


def test_bad_rows_stop_the_run_or_are_dropped_and_counted(tiny_base, tmp_path, caplog):
    bad = tmp_path / "bad.parquet"
    Dataset.from_list([*pair_rows(4), {"prompt": "p", "chosen": "same", "rejected": "same"}]).to_parquet(bad)
    with pytest.raises(SlimtuneError, match=r"bad.parquet: row 5: chosen and rejected are identical"):
        setup(_config(tiny_base, bad, tmp_path / "a", "dpo"))
    with caplog.at_level(logging.INFO, logger="slimtune"):
        run = setup(_config(tiny_base, bad, tmp_path / "b", "dpo", "preference.bad_rows=drop"))
    assert len(run.inputs.data.train) == 4 and run.inputs.data.dropped == 1
    assert "1 bad pair(s) dropped" in caplog.text


# ---------------------------------------------------------------------------------------------------
# The oracle: one batch through slimtune's step and TRL's trainer


@pytest.mark.parametrize(
    "objective, start, kind",
    [("dpo", "base", "conversational"), ("ipo", "base", "standard"), ("dpo", "adapter", "standard"), ("simpo", "base", "standard")],
)
def test_one_batch_equals_trl(objective, start, kind, tiny_base, pair_files, tmp_path):
    """loss, rewards/{chosen,rejected,accuracies,margins}, logps/{chosen,rejected} and every LoRA gradient
    equal TRL's on the same batch, with the reference TRL uses (adapters off from the base; the start
    adapter's frozen copy from model.adapter)."""
    extra = []
    start_adapter = None
    if start == "adapter":
        start_adapter = _write_start_adapter(tiny_base, tmp_path)
        extra = [f"model.adapter={start_adapter}"]
    pairs_file = pair_files[kind]
    run = setup(_config(tiny_base, pairs_file, tmp_path / "run", objective, *extra))
    model = run.model
    hf = _hf_model_like(model, tiny_base)
    start_weights = _adapter_weights(model)  # the reference's adapters: the start adapter, or B = 0
    perturb_adapters(model, seed=5, std=0.2)  # the policy after some training
    loss_of = PreferenceLoss.from_config(run.cfg)
    indices = list(range(4))
    batch = rank_pairs(run.inputs.data.train, indices, SINGLE, run.inputs.pad_id)
    model.train()
    loss, sums = pair_loss(
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, batch, loss_of, 4, _chosen(batch)
    )
    loss.backward()
    ours = {"loss": loss.item(), **pair_metric_means(sums, _chosen(batch), loss_of)}
    grads = {name: (m.lora_a.weight.grad.clone(), m.lora_b.weight.grad.clone()) for name, m in lora_modules(model).items()}

    tok = chat_tokenizer()
    rows = [json.loads(line) for line in pairs_file.read_text().splitlines()]
    assert len(run.inputs.data.train) == len(rows)  # dataset.shuffle=false, no held-out split: the rows in order
    train_rows = rows
    if objective == "simpo":
        trainer, peft_model = _cpo_trainer(hf, train_rows, tok, tmp_path, run.cfg)
        _set_adapters(peft_model, _adapter_weights(model), "default")
        peft_model.train()
        their_loss, metrics = trainer.get_batch_loss_metrics(peft_model, _cpo_batch(batch))
    else:
        loss_type = "sigmoid" if objective == "dpo" else "ipo"
        if start == "adapter":  # a PEFT model holding the start adapter: TRL copies it as the frozen "ref" adapter
            hf = peft.get_peft_model(hf, _lora_config())
            _set_adapters(hf, start_weights, "default")
        trainer = _dpo_trainer(hf, train_rows, tok, tmp_path, loss_type, beta=run.cfg.preference.beta)
        peft_model = trainer.model
        assert ("ref" in peft_model.peft_config) == (start == "adapter")
        _set_adapters(peft_model, _adapter_weights(model), "default")
        peft_model.train()
        inputs = trainer.data_collator([trainer.train_dataset[i] for i in indices])
        assert torch.equal(inputs["input_ids"], batch["input_ids"])  # the same batch on both sides
        their_loss = trainer.compute_loss(peft_model, inputs)
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    their_loss.backward()
    assert abs(ours["loss"] - their_loss.item()) < 1e-5, (ours["loss"], their_loss.item())
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert abs(ours[name] - metrics[name]) <= 1e-5 + 1e-4 * abs(metrics[name]), (name, ours[name], metrics[name])
    assert abs(ours["rewards/margins"]) > 1e-3, ours  # the policy is not the reference: the rewards say something
    theirs = dict(peft_model.named_parameters())
    top = max(float(g.abs().max()) for pair in grads.values() for g in pair)
    assert top > 0
    worst = 0.0
    for name, (ga, gb) in grads.items():
        for mine, part in ((ga, "lora_A"), (gb, "lora_B")):
            other = theirs[f"base_model.model.{name}.{part}.default.weight"].grad
            worst = max(worst, float((mine - other).abs().max()))
            assert float((mine - other).abs().max()) <= 1e-4 * top, (name, part)
    metric_gap = max(abs(ours[n] - metrics[n]) for n in ("rewards/chosen", "rewards/margins", "logps/chosen", "logps/rejected"))
    print(
        f"\n{objective} from {start}: |loss - TRL's| {abs(ours['loss'] - their_loss.item()):.1e}, largest metric gap {metric_gap:.1e}, "
        f"largest gradient gap {worst / top:.1e} of the largest gradient"
    )


# ---------------------------------------------------------------------------------------------------
# Helpers


def _config(tiny_base: Path, data: Path, out: Path, objective: str, *extra: str):
    return load_config(
        "tiny",
        [
            f"output_dir={out}",
            f"model.path={tiny_base}",
            "model.create_tiny=false",
            f"dataset.path={data}",
            "dataset.create_builtin=false",
            "dataset.shuffle=false",
            f"dataset.max_seq_len={MAX_LENGTH}",
            f"training.objective={objective}",
            "training.batch_size=4",
            "lora.rank=8",
            "lora.alpha=16",
            "lora.dropout=0",
            f"lora.target_modules=[{', '.join(TARGETS)}]",
            "dtype=fp32",
            "logging.progress_bar=false",
            *extra,
        ],
    )


def _chosen(batch: dict) -> int:
    n = batch["input_ids"].shape[0] // 2
    return int((batch["labels"][:n, 1:] != IGNORE_INDEX).sum())


def _lora_config() -> peft.LoraConfig:
    return peft.LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS)


def _hf_model_like(model, tiny_base: Path):
    """The tiny base as transformers loads it in fp32, each NF4 weight replaced by slimtune's dequantized one."""
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_base), torch_dtype=torch.float32)
    if model is not None:
        with torch.no_grad():
            for name, m in lora_modules(model).items():
                hf.get_submodule(name).weight.copy_(base_rows(m.weight, 0, m.weight.shape[0]).float())
    return hf


def _adapter_weights(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {n: (m.lora_a.weight.detach().clone(), m.lora_b.weight.detach().clone()) for n, m in lora_modules(model).items()}


def _set_adapters(peft_model, weights: dict, adapter: str) -> None:
    params = dict(peft_model.named_parameters())
    with torch.no_grad():
        for name, (a, b) in weights.items():
            params[f"base_model.model.{name}.lora_A.{adapter}.weight"].copy_(a)
            params[f"base_model.model.{name}.lora_B.{adapter}.weight"].copy_(b)


def _write_start_adapter(tiny_base: Path, tmp_path: Path) -> Path:
    """A PEFT adapter directory with non-zero B (an SFT run's adapter stands in), saved by PEFT itself."""
    hf = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny_base), torch_dtype=torch.float32), _lora_config())
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1, generator=gen)
    out = tmp_path / "sft-adapter"
    hf.save_pretrained(str(out))
    assert lora_key("model.layers.0.self_attn.q_proj", "lora_A")  # PEFT's spelling, read by read_adapter
    return out


def _dpo_trainer(hf, rows: list[dict], tok, tmp_path: Path, loss_type: str, beta: float = 0.1):
    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"),
        beta=beta,
        loss_type=[loss_type],
        max_length=MAX_LENGTH,
        report_to=[],
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=4,
        dataset_num_proc=None,
        remove_unused_columns=False,
    )
    peft_config = None if isinstance(hf, peft.PeftModel) else _lora_config()
    return trl.DPOTrainer(model=hf, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok, peft_config=peft_config)


def _cpo_trainer(hf, rows: list[dict], tok, tmp_path: Path, cfg):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    p = cfg.preference
    args = CPOConfig(
        output_dir=str(tmp_path / "trl-cpo"),
        loss_type="simpo",
        beta=p.beta,
        simpo_gamma=p.simpo_gamma,
        cpo_alpha=p.cpo_alpha,
        label_smoothing=p.label_smoothing,
        max_length=MAX_LENGTH,
        report_to=[],
        use_cpu=True,
        bf16=False,
    )
    trainer = CPOTrainer(model=hf, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok, peft_config=_lora_config())
    return trainer, trainer.model


def _cpo_batch(batch: dict) -> dict:
    """Our collated pairs as CPO's batch keys (its own tokenization is bypassed: the same sequences)."""
    n = batch["input_ids"].shape[0] // 2
    out = {}
    for side, rows in (("chosen", slice(0, n)), ("rejected", slice(n, None))):
        out[f"{side}_input_ids"] = batch["input_ids"][rows]
        out[f"{side}_attention_mask"] = batch["attention_mask"][rows]
        out[f"{side}_labels"] = batch["labels"][rows].long()
    return out
