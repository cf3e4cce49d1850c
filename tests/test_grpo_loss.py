"""grpo_loss.py against TRL 1.16 itself (the oracle, never the implementation): on the tiny model, fixed
prompts, fixed completions (generation taken out: TRL's ``_generate`` returns them) and fixed rewards,
slimtune's advantages, loss, ``kl``, ``entropy``, ``clip_ratio/*`` and every LoRA gradient equal what
TRL's ``GRPOTrainer`` computes (``_generate_and_score_completions`` then ``_compute_loss``) on a PEFT model
over the same NF4-dequantized base, for every loss_type, both importance-sampling levels, beta 0 and
beta > 0 (the reference: TRL's base with adapters off,
slimtune's the loaded adapters swapped in) and num_iterations 1 and 2 (the second iteration:
the old log-probabilities stored at generation time, the policy moved on since), across scale_rewards
and mask_truncated_completions.

Bound (the DPO oracle's, tests/test_preference.py): everything is fp32 on both sides and the two differ
only in kernels (slimtune's NF4 linear and chunked log-softmax, PEFT's and TRL's): advantages, loss and
metrics within 1e-5 (absolute) + 1e-4 relative, gradients within 1e-4 of the largest gradient entry."""

from __future__ import annotations

import itertools

import peft
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from slimtune.grpo_loss import GRPOLoss, StepCounts, completion_batch, completion_logps, group_advantages, grpo_metric_means, policy_loss
from slimtune.lora import LoRAConfig, adapter_weights, lora_modules, swapped_adapters
from slimtune.model import load_qlora_model
from slimtune.quant import base_rows
from slimtune.tiny import byte_tokenizer

trl = pytest.importorskip("trl")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NUM_GENERATIONS = 4
MAX_COMPLETION = 12
TEMPERATURE = 0.9
PROMPTS = ["Say red:", "Count to three, slowly:"]
# per completion: (text, ends with eos); a completion without eos that reaches MAX_COMPLETION is truncated
COMPLETIONS = [
    (" red", True),
    (" blue and green", False),  # 15 bytes: cut to 12, truncated
    (" re", True),
    (" red red", True),
    (" one two three", False),  # truncated
    (" one", True),
    (" 1 2 3", True),
    (" three two one", False),  # truncated
]
# two reward functions' fixed values (None: the function leaves the completion out, as TRL allows)
REWARDS_A = [1.0, 0.0, 0.5, 1.0, 0.25, 0.0, 1.0, 0.75]
REWARDS_B = [0.2, None, -0.3, 0.1, 0.0, 0.4, -0.1, 0.3]
WEIGHTS = [1.0, 0.5]

# every loss type x both levels x beta 0 / 0.04 x mu 1 / 2 (32 cases); scale_rewards, epsilon_high and
# mask_truncated_completions vary along with them so each value meets every loss type
CASES = [
    (loss_type, level, beta, mu, ("group", "batch", "none")[i % 3], (None, 0.28)[(i // 2) % 2], bool(i % 2))
    for i, (loss_type, level, beta, mu) in enumerate(
        itertools.product(("grpo", "dr_grpo", "dapo", "bnpo"), ("token", "sequence"), (0.0, 0.04), (1, 2))
    )
]


def reward_a(prompts, completions, completion_ids, **kwargs):
    return REWARDS_A[: len(completions)]


def reward_b(prompts, completions, completion_ids, **kwargs):
    return REWARDS_B[: len(completions)]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def fixed(tok):
    """The prompts' and completions' token ids, each prompt repeated NUM_GENERATIONS times."""
    prompt_ids = [tok(text=p)["input_ids"] for p in PROMPTS for _ in range(NUM_GENERATIONS)]
    completion_ids = []
    for text, eos in COMPLETIONS:
        ids = tok(text=text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else [])
        completion_ids.append(ids[:MAX_COMPLETION])
    return prompt_ids, completion_ids


@pytest.mark.parametrize("loss_type, level, beta, mu, scale, epsilon_high, mask_truncated", CASES)
def test_one_generation_batch_equals_trl(loss_type, level, beta, mu, scale, epsilon_high, mask_truncated, tiny_base, tok, fixed, tmp_path):
    """advantages, loss, kl, entropy, clip_ratio/{low,high,region}_mean and every LoRA gradient equal TRL's."""
    prompt_ids, completion_ids = fixed
    loss_of = GRPOLoss(loss_type, level, 0.2, epsilon_high, beta, MAX_COMPLETION, TEMPERATURE)
    model = load_qlora_model(tiny_base, LoRAConfig(rank=8, alpha=16, target_modules=TARGETS), seed=0, progress=False, dtype=torch.float32)
    start = adapter_weights(model)  # the model as loaded (B = 0): the reference, as the objective keeps it
    _perturb(model, seed=5)  # the policy at generation time (and the old policy when mu = 2)
    at_generation = _adapters(model)

    # slimtune
    truncated = [c[-1] != tok.eos_token_id for c in completion_ids]
    masked = [t and mask_truncated for t in truncated]
    batch = completion_batch([torch.tensor(p) for p in prompt_ids], completion_ids, masked, tok.pad_token_id)
    table = torch.tensor([[a, float("nan") if b is None else b] for a, b in zip(REWARDS_A, REWARDS_B, strict=True)])
    rewards = (table * torch.tensor(WEIGHTS)).nansum(dim=1)
    adv = group_advantages(rewards, NUM_GENERATIONS, scale)
    model.train()
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}
    with torch.no_grad():
        old = completion_logps(model(**inputs).logits, batch["labels"], TEMPERATURE)[0] if mu > 1 else None
        if beta:
            with swapped_adapters(model, start):  # the objective's reference forward
                ref = completion_logps(model(**inputs).logits, batch["labels"], TEMPERATURE)[0]
        else:
            ref = None
    if mu > 1:
        _perturb(model, seed=9, std=0.5)  # the second iteration: the policy moved on since the generation
    logps, entropy = completion_logps(model(**inputs).logits, batch["labels"], TEMPERATURE)
    parts = {"labels": batch["labels"], "advantages": adv.advantages, "old_logps": old, "ref_logps": ref, "entropy": entropy}
    tokens = int((batch["labels"] != -100).sum())
    loss, sums = policy_loss(logps, parts, loss_of, StepCounts(len(completion_ids), tokens, 1))
    loss.backward()
    ours = {"loss": loss.item(), **grpo_metric_means(sums, loss_of), "reward": adv.reward, "reward_std": adv.reward_std}
    grads = {name: (m.lora_a.weight.grad.clone(), m.lora_b.weight.grad.clone()) for name, m in lora_modules(model).items()}

    # TRL
    trainer = _grpo_trainer(model, tiny_base, tok, tmp_path, loss_of, mu, scale, mask_truncated)
    peft_model = trainer.model
    _set_adapters(peft_model, at_generation)
    peft_model.train()
    trainer._generate = lambda prompts: _fixed_generation(prompts, prompt_ids, completion_ids, tok)
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets for a step of one micro-batch
    rows = [{"prompt": p} for p in PROMPTS for _ in range(NUM_GENERATIONS)]
    out = trainer._generate_and_score_completions(rows)
    assert torch.allclose(adv.advantages, out["advantages"].float(), atol=1e-5, rtol=1e-4), (adv.advantages, out["advantages"])
    assert ("old_per_token_logps" in out) == (mu > 1)
    if mu > 1:
        _set_adapters(peft_model, _adapters(model))
    their_loss = trainer._compute_loss(peft_model, out)
    their_loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert abs(ours["loss"] - their_loss.item()) <= 1e-5 + 1e-4 * abs(their_loss.item()), (ours["loss"], their_loss.item())
    names = ["reward", "reward_std", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"] + (
        ["kl"] if beta else []
    )
    for name in names:
        assert abs(ours[name] - metrics[name]) <= 1e-5 + 1e-4 * abs(metrics[name]), (name, ours[name], metrics[name])
    assert "kl" in ours if beta else "kl" not in ours
    if mu > 1:  # the policy moved: some ratios leave the clip range, so the clip metrics say something
        assert ours["clip_ratio/region_mean"] > 0, ours
    theirs = dict(peft_model.named_parameters())
    top = max(float(g.abs().max()) for pair in grads.values() for g in pair)
    assert top > 0
    worst = 0.0
    for name, (ga, gb) in grads.items():
        for mine, part in ((ga, "lora_A"), (gb, "lora_B")):
            gap = float((mine - theirs[f"base_model.model.{name}.{part}.default.weight"].grad).abs().max())
            worst = max(worst, gap)
            assert gap <= 1e-4 * top, (name, part, gap, top)
    gap = abs(ours["loss"] - their_loss.item())
    print(f"\n{loss_type}/{level}/beta={beta}/mu={mu}: |loss - TRL's| {gap:.1e}, gradient gap {worst / top:.1e}", end="")
    print(f", clipped {ours['clip_ratio/region_mean']:.2f}")


def test_group_advantages_scale_and_unscorable():
    """Group-relative advantages by hand: a group's mean removed, scaled by its std (+1e-4); an
    unscorable completion (NaN) gets advantage 0 and leaves the mean; batch scaling uses the batch's std."""
    r = torch.tensor([1.0, 0.0, 2.0, 2.0])
    a = group_advantages(r, 2, "group").advantages
    s = torch.tensor([1.0, 0.0]).std()
    assert torch.allclose(a, torch.tensor([0.5 / (s + 1e-4), -0.5 / (s + 1e-4), 0.0, 0.0]))
    assert torch.allclose(group_advantages(r, 2, "none").advantages, torch.tensor([0.5, -0.5, 0.0, 0.0]))
    b = group_advantages(r, 2, "batch")
    assert torch.allclose(b.advantages, torch.tensor([0.5, -0.5, 0.0, 0.0]) / (r.std() + 1e-4))
    n = group_advantages(torch.tensor([1.0, float("nan"), 3.0, 3.0]), 2, "group")
    assert n.advantages.tolist() == [0.0, 0.0, 0.0, 0.0] and n.reward == pytest.approx(7 / 3)
    assert n.frac_reward_zero_std == pytest.approx(0.5)  # the second group's std is 0; the first's is NaN (one value), not 0


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_a_filler_row_adds_nothing(loss_type):
    """A rank's filler row (no prompt of the micro-batch on that rank: one masked row, ``live`` 0) gives a
    zero loss and gradient and counts as no token and no completion in the step's sums."""
    batch = completion_batch([torch.tensor([5, 6])], [[0]], [True], pad_id=0)
    batch.update(advantages=torch.zeros(1), live=torch.zeros(1))
    logits = torch.randn(1, 3, 11, requires_grad=True)
    logps, entropy = completion_logps(logits, batch["labels"])
    batch.update(entropy=entropy, ref_logps=torch.zeros_like(logps))
    loss, sums = policy_loss(logps, batch, GRPOLoss(loss_type, beta=0.04, max_completion_length=4), StepCounts(4, 9))
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(logits.grad) == 0
    assert sums.tolist() == [0.0] * len(sums)


# ---------------------------------------------------------------------------------------------------
# Helpers


def _perturb(model, seed: int, std: float = 0.1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_a.weight.add_(torch.randn(m.lora_a.weight.shape, generator=gen) * 0.05)
            m.lora_b.weight.normal_(0.0, std, generator=gen)


def _adapters(model) -> dict:
    return {n: (m.lora_a.weight.detach().clone(), m.lora_b.weight.detach().clone()) for n, m in lora_modules(model).items()}


def _set_adapters(peft_model, weights: dict) -> None:
    params = dict(peft_model.named_parameters())
    with torch.no_grad():
        for name, (a, b) in weights.items():
            params[f"base_model.model.{name}.lora_A.default.weight"].copy_(a)
            params[f"base_model.model.{name}.lora_B.default.weight"].copy_(b)


def _grpo_trainer(model, tiny_base, tok, tmp_path, loss: GRPOLoss, mu: int, scale: str, mask_truncated: bool):
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_base), torch_dtype=torch.float32)
    with torch.no_grad():
        for name, m in lora_modules(model).items():
            hf.get_submodule(name).weight.copy_(base_rows(m.weight, 0, m.weight.shape[0]).float())
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        loss_type=loss.loss_type,
        importance_sampling_level=loss.importance_sampling_level,
        epsilon=loss.epsilon,
        epsilon_high=loss.epsilon_high,
        beta=loss.beta,
        num_iterations=mu,
        scale_rewards=scale,
        mask_truncated_completions=mask_truncated,
        max_completion_length=MAX_COMPLETION,
        temperature=loss.temperature,
        num_generations=NUM_GENERATIONS,
        per_device_train_batch_size=len(COMPLETIONS),
        reward_weights=WEIGHTS,
        report_to=[],
        use_cpu=True,
        bf16=False,
        logging_steps=1,
    )
    lora = peft.LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS)
    dataset = Dataset.from_list([{"prompt": p} for p in PROMPTS])
    return trl.GRPOTrainer(
        model=hf, reward_funcs=[reward_a, reward_b], args=args, train_dataset=dataset, processing_class=tok, peft_config=lora
    )


def _fixed_generation(prompts, prompt_ids, completion_ids, tok):
    """What TRL's ``_generate`` returns, for the fixed prompts and completions."""
    texts = tok.batch_decode(completion_ids, skip_special_tokens=True)
    return prompt_ids, completion_ids, None, texts, None, {}, None, None
