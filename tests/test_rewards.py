"""rewards.py, data/prompt_rows.py and rollout.py: reward functions with TRL's signature run unchanged, the
built-ins, every misbehaving reward is one line naming function, step and row; prompt rows tokenized as
TRL 1.16's GRPOTrainer tokenizes them (its own ``_tokenize_prompts`` is the oracle), bad rows in one line;
a seeded fuzzer of malformed rows and misbehaving rewards; sampling that is seeded, chunked like
unchunked (greedy) and equal to transformers' greedy ``generate``."""

from __future__ import annotations

import math
import random
import sys

import pytest
import torch

from slimtune.data.prompt_rows import BadPrompt, PromptOptions, tokenize_prompt
from slimtune.data.readers import Record
from slimtune.errors import SlimtuneError
from slimtune.lora import LoRAConfig
from slimtune.model import load_qlora_model
from slimtune.prompts import FALLBACK_CHAT_TEMPLATE
from slimtune.rewards import Reward, RewardOptions, Scored, load_rewards, reward_means, score
from slimtune.rollout import SamplingSpec, sample, stop_ids_of
from slimtune.tiny import byte_tokenizer, make_tiny_checkpoint

# ---------------------------------------------------------------------------------------------------
# Reward functions


def trl_style_length(completions, **kwargs):
    """The shape of TRL's documented examples: completions and **kwargs only, one float each."""
    return [-abs(20 - len(c)) / 20.0 for c in completions]


def trl_style_conversational(prompts, completions, answer, **kwargs):
    """TRL's conversational shape: each completion a list of messages; a dataset column by name."""
    return [1.0 if c[0]["content"].strip().endswith(a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def _scored(completions, answers=None, ids=None) -> Scored:
    n = len(completions)
    columns = {"answer": answers} if answers is not None else {}
    ids = ids or [[1] * len(str(c)) for c in completions]
    return Scored(["p"] * n, completions, ids, columns, [f"data.jsonl:{i + 1}" for i in range(n)])


def test_trl_signature_functions_run_unchanged(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "from tests.test_rewards import trl_style_length, trl_style_conversational\n"
        "def answer_at_end(prompts, completions, answer, **kwargs):\n"
        "    return [1.0 if c.strip().endswith(a) else None if a == '?' else 0.0 for c, a in zip(completions, answer)]\n"
    )
    monkeypatch.chdir(tmp_path)
    rewards = load_rewards(RewardOptions(["my_rewards:trl_style_length", "my_rewards:answer_at_end"], [1.0, 2.0]))
    assert [r.name for r in rewards] == ["trl_style_length", "answer_at_end"] and [r.weight for r in rewards] == [1.0, 2.0]
    table = score(rewards, _scored(["it is 4", "x" * 20, "5"], ["4", "4", "?"]), step=3)
    assert table[:, 0].tolist() == pytest.approx([-13 / 20, 0.0, -19 / 20])
    assert table[0, 1] == 1.0 and table[1, 1] == 0.0 and math.isnan(table[2, 1])  # None: left out, as TRL
    means = reward_means(table, rewards)
    assert means["rewards/answer_at_end/mean"] == pytest.approx(0.5) and "rewards/trl_style_length/std" in means
    conversational = [Reward("trl_style_conversational", trl_style_conversational, 1.0)]
    chat = [[{"role": "assistant", "content": "so 4"}], [{"role": "assistant", "content": "7"}]]
    assert score(conversational, _scored(chat, ["4", "8"]), step=1)[:, 0].tolist() == [1.0, 0.0]
    sys.modules.pop("my_rewards", None)


def test_builtin_rewards():
    options = RewardOptions(["exact_answer", "format", "length_penalty"], format_pattern=r"The answer is \d+\.", max_completion_length=10)
    rewards = load_rewards(options)
    table = score(
        rewards, _scored(["The answer is 12.", "the answer: 13", " 7 "], ["12.", "13", "7"], ids=[[1] * 5, [1] * 10, [1] * 20]), 1
    )
    # exact_answer: the last number (default pattern) against the answer column, both stripped
    assert table[:, 0].tolist() == [0.0, 1.0, 1.0]  # "12." is not the number 12
    assert table[:, 1].tolist() == [1.0, 0.0, 0.0]
    assert table[:, 2].tolist() == [-0.5, -1.0, -1.0]


@pytest.mark.parametrize(
    "spec, expected",
    [
        (["no_such_builtin"], "neither a built-in"),
        (["no_such_module_xyz:f"], "cannot import no_such_module_xyz"),
        (["math:no_such_function"], "module math"),
    ],
)
def test_bad_reward_names_are_one_line(spec, expected):
    with pytest.raises(SlimtuneError) as e:
        load_rewards(RewardOptions(spec))
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_weights_must_match_and_patterns_must_compile():
    with pytest.raises(SlimtuneError, match="grpo.reward_weights has 1 value"):
        load_rewards(RewardOptions(["exact_answer", "format"], [1.0]))
    with pytest.raises(SlimtuneError, match="grpo.answer_pattern"):
        load_rewards(RewardOptions(["exact_answer"], answer_pattern="(unclosed"))


def _raises_on_third(prompts, completions, completion_ids, **kwargs):
    if len(completions) >= 3 and completions[2] == "boom":
        raise ZeroDivisionError("division by zero\nsecond line")
    if completions == ["boom"]:
        raise ZeroDivisionError("division by zero")
    return [0.0] * len(completions)


@pytest.mark.parametrize(
    "func, expected",
    [
        (_raises_on_third, "reward function bad raised at step 7 for data.jsonl:3 (completion 2): ZeroDivisionError: division by zero"),
        (lambda **kw: [1.0], "reward function bad returned 1 value(s) for 4 completion(s) at step 7"),
        (lambda **kw: None, "reward function bad returned a NoneType for 4 completion(s) at step 7"),
        (lambda **kw: [0.0, float("nan"), 0.0, 0.0], "reward function bad returned nan at step 7 for data.jsonl:2 (completion 1)"),
        (lambda **kw: [0.0, 0.0, 0.0, float("inf")], "returned inf at step 7 for data.jsonl:4"),
        (lambda **kw: [0.0, "1", 0.0, 0.0], "returned '1' at step 7 for data.jsonl:2"),
    ],
)
def test_misbehaving_rewards_are_one_line(func, expected):
    with pytest.raises(SlimtuneError) as e:
        score([Reward("bad", func, 1.0)], _scored(["a", "b", "boom", "d"]), step=7)
    assert str(e.value).startswith("reward function bad ") and expected in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_fuzz_misbehaving_rewards():
    """Seeded: rewards returning random junk or raising give a table or one SlimtuneError line, nothing else."""
    rng = random.Random(1234)
    junk = [None, float("nan"), float("inf"), -float("inf"), "x", [], {}, True, 3, 2.5, -1e30, object()]
    for _ in range(300):
        n = rng.randint(1, 6)
        mode = rng.random()

        def func(prompts, completions, completion_ids, _mode=mode, _n=n, **kw):
            if _mode < 0.15:
                raise rng.choice([ValueError, KeyError, TypeError, RuntimeError])("bad " * rng.randint(0, 3))
            if _mode < 0.3:
                return rng.choice([None, 3, "abc", {"a": 1}, tuple(range(rng.randint(0, 8)))])
            return [rng.choice(junk) for _ in range(_n if _mode < 0.9 else rng.randint(0, 8))]

        try:
            table = score([Reward("fuzz", func, 1.0)], _scored([f"c{i}" for i in range(n)]), step=1)
        except SlimtuneError as e:
            assert "\n" not in str(e) and str(e).startswith("reward function fuzz ")
        else:
            assert table.shape == (n, 1) and not torch.isinf(table).any()


# ---------------------------------------------------------------------------------------------------
# Prompt rows


@pytest.fixture(scope="module")
def chat_tok():
    tok = byte_tokenizer()
    tok.chat_template = FALLBACK_CHAT_TEMPLATE
    return tok


def test_prompts_tokenize_as_trl(chat_tok, tiny_base, tmp_path):
    """Standard and conversational prompts: the ids TRL's own ``_tokenize_prompts`` makes; other columns kept."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, num_generations=2, per_device_train_batch_size=2
    )
    model = AutoModelForCausalLM.from_pretrained(str(tiny_base), torch_dtype=torch.float32)
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=[trl_style_length],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "a"}]),
        processing_class=chat_tok,
    )
    standard = ["2+2=", "Say red:"]
    chats = [[{"role": "user", "content": "2+2?"}], [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]]
    for prompts in (standard, chats):
        theirs = trainer._tokenize_prompts(prompts)[0]
        mine = [tokenize_prompt(Record({"prompt": p, "answer": "4"}, f"f:{i}"), chat_tok, PromptOptions()) for i, p in enumerate(prompts)]
        assert [m.prompt_ids.tolist() for m in mine] == [list(t) for t in theirs]
        assert all(m.columns == {"answer": "4"} and m.prompt == p for m, p in zip(mine, prompts, strict=True))
    cut = tokenize_prompt(Record({"prompt": "abcdefgh"}, "f:1"), chat_tok, PromptOptions(max_prompt_length=3))
    assert cut.prompt_ids.tolist() == chat_tok(text="abcdefgh")["input_ids"][-3:]


@pytest.mark.parametrize(
    "row, expected",
    [
        ({"question": "a"}, "needs a prompt column (found question)"),
        ({"prompt": "  "}, "prompt is empty"),
        ({"prompt": []}, "empty list of messages"),
        ({"prompt": [{"role": "user"}]}, "prompt[0] must be a message"),
        ({"prompt": 3}, "must be a string or a list of messages, not int"),
    ],
)
def test_bad_prompt_rows_are_one_line(row, expected, chat_tok):
    with pytest.raises(BadPrompt) as e:
        tokenize_prompt(Record(row, "prompts.jsonl:4"), chat_tok, PromptOptions())
    assert str(e.value).startswith("prompts.jsonl:4: ") and expected in str(e.value) and "\n" not in str(e.value)


def test_fuzz_prompt_rows(chat_tok):
    """Seeded: malformed prompt rows give a PromptRow or one BadPrompt line, nothing else."""
    rng = random.Random(99)
    atoms = ["", " ", "hi", "{{ bad }}", "\u0000", "é" * 5, 0, -1, 1.5, None, True, [], {}, [1], {"role": "user"}]

    def value(depth=0):
        kind = rng.random()
        if depth < 2 and kind < 0.25:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        if depth < 2 and kind < 0.45:
            return {rng.choice(["role", "content", "x"]): value(depth + 1) for _ in range(rng.randint(0, 3))}
        return rng.choice(atoms)

    for i in range(400):
        row = {k: value() for k in rng.sample(["prompt", "answer", "other"], rng.randint(0, 3))}
        if rng.random() < 0.3:
            row["prompt"] = [
                {"role": rng.choice(["user", "system", "assistant", "x"]), "content": str(value())} for _ in range(rng.randint(1, 3))
            ]
        try:
            out = tokenize_prompt(Record(row, f"fuzz:{i}"), chat_tok, PromptOptions(max_prompt_length=rng.choice([None, 4])))
        except BadPrompt as e:
            assert str(e).startswith(f"fuzz:{i}: ") and "\n" not in str(e)
        else:
            assert len(out.prompt_ids) > 0 and out.prompt is row["prompt"]


# ---------------------------------------------------------------------------------------------------
# Sampling


@pytest.fixture(scope="module")
def policy(tiny_base):
    return load_qlora_model(tiny_base, LoRAConfig(rank=8, alpha=16), seed=0, progress=False, dtype=torch.float32)


def test_sampling_is_seeded_and_stops(policy):
    tok = byte_tokenizer()
    prompts = [torch.tensor(tok(text=t)["input_ids"]) for t in ("2+2=", "Say red:", "a")] * 2
    spec = SamplingSpec(max_completion_length=16, temperature=1.0, top_p=0.9, top_k=50, stop_ids=stop_ids_of(tok), pad_id=tok.pad_token_id)
    a = sample(policy, prompts, spec, torch.Generator().manual_seed(3))
    b = sample(policy, prompts, spec, torch.Generator().manual_seed(3))
    c = sample(policy, prompts, spec, torch.Generator().manual_seed(4))
    assert a.ids == b.ids and a.ids != c.ids
    for ids, cut in zip(a.ids, a.truncated, strict=True):
        assert (len(ids) == 16 and cut and tok.eos_token_id not in ids) or (ids[-1] == tok.eos_token_id and not cut)
        assert tok.eos_token_id not in ids[:-1]  # nothing after the stop token
    assert any(a.truncated) and not all(a.truncated)  # both ends happen
    assert stop_ids_of(tok) == (tok.eos_token_id,) and stop_ids_of(tok, [7, tok.eos_token_id]) == (7, tok.eos_token_id)
    assert stop_ids_of(tok, 5) == (5, tok.eos_token_id)  # the tokenizer's eos and generation_config.json's


def test_greedy_chunks_equal_one_batch_and_transformers_generate(policy):
    """Temperature 0: chunked (one prompt per chunk) = one batch = transformers' greedy generate, prompt by prompt."""
    tok = byte_tokenizer()
    texts = ("2+2=", "Say red, then blue:", "a")
    prompts = [torch.tensor(tok(text=t)["input_ids"]) for t in texts]
    spec = SamplingSpec(max_completion_length=12, temperature=0.0, stop_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id)
    policy.train()
    whole = sample(policy, prompts, spec, torch.Generator().manual_seed(0))
    assert policy.training  # restored
    narrow = SamplingSpec(**{**spec.__dict__, "generation_batch_tokens": 1})  # one row per chunk
    assert sample(policy, prompts, narrow, torch.Generator().manual_seed(0)).ids == whole.ids
    policy.eval()
    for p, ids in zip(prompts, whole.ids, strict=True):
        out = policy.generate(
            p.unsqueeze(0), max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
        )
        assert out[0, len(p) :].tolist()[: len(ids)] == ids


def test_the_prefill_of_a_large_vocabulary_holds_no_copy_of_the_head(tmp_path):
    """rollout asks for the last position's logits by index: with ``logits_to_keep=1`` torch's bf16 linear on
    the strided one-position slice held ~1 GB for this 128k x 512 head (measured; contiguous: ~8 MB). The
    sampling step's peak stays within a quarter of the head's bf16 bytes (131 MB)."""
    from slimtune.memory import peak_rss_mb, reset_peak_rss

    base = make_tiny_checkpoint(tmp_path / "base", seed=0, hidden_size=512, intermediate_size=1024, num_hidden_layers=1,
                                vocab_size=128256, num_attention_heads=8, num_key_value_heads=2)  # fmt: skip
    model = load_qlora_model(base, LoRAConfig(rank=8, alpha=16), seed=0, progress=False, dtype=torch.bfloat16)
    prompts = [torch.randint(0, 1000, (64,), generator=torch.Generator().manual_seed(i)) for i in range(8)]
    spec = SamplingSpec(max_completion_length=2, pad_id=0)
    sample(model, prompts[:1], spec, torch.Generator().manual_seed(0))  # first-call allocations out of the figure
    assert reset_peak_rss()  # /proc/self/clear_refs
    before = peak_rss_mb()
    sample(model, prompts, spec, torch.Generator().manual_seed(0))
    assert peak_rss_mb() - before < 128256 * 512 * 2 / 4 / 2**20, peak_rss_mb() - before
