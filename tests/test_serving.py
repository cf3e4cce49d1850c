"""formats/serving.py: vLLM's and SGLang's LoRA loader rules, each broken by an adapter_config.json of its
own, and the commands that serve an adapter. Neither server runs here (their CUDA builds are not
installed); the rules cite the loader functions they come from."""

from __future__ import annotations

import json

import pytest

from slimtune.formats.serving import RULES, SGLANG_RULES, VLLM_RULES, serve_commands, serving_problems, serving_report, vllm_max_lora_rank

OK = {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "bias": "none"}

# (what breaks it, the config's changes, the server, the line it gives)
BROKEN = [
    ("vllm fields", {"lora_alpha": None}, "vLLM", "vLLM will not load it: lora_alpha missing (required fields)"),
    ("vllm rank sign", {"r": 0}, "vLLM", "vLLM will not load it: r=0 (a positive rank)"),
    ("vllm rank 513", {"r": 513}, "vLLM", "vLLM will not load it: rank 513 is above 512, the largest --max-lora-rank"),
    (
        "vllm rank_pattern",
        {"rank_pattern": {"q_proj": 1024}},
        "vLLM",
        "vLLM will not load it: rank 1024 is above 512, the largest --max-lora-rank",
    ),
    (
        "vllm modules_to_save",
        {"modules_to_save": ["lm_head"]},
        "vLLM",
        "vLLM will not load it: modules_to_save ['lm_head'] (only classifier/score are loaded)",
    ),
    ("vllm dora", {"use_dora": True}, "vLLM", "vLLM will not load it: DoRA (use_dora is set)"),
    ("vllm lora_bias", {"lora_bias": True}, "vLLM", "vLLM will not load it: LoRA bias (lora_bias is set)"),
    ("vllm init", {"init_lora_weights": "pissa"}, "vLLM", "vLLM will not load it: init_lora_weights='pissa' (changes the base weights)"),
    ("vllm alora", {"alora_invocation_tokens": [5]}, "vLLM", "vLLM will not load it: Activated LoRA (alora_invocation_tokens is set)"),
    ("vllm replication", {"layer_replication": [[0, 2]]}, "vLLM", "vLLM will not load it: layer_replication (layer_replication is set)"),
    ("vllm bdlora", {"use_bdlora": {"n": 2}}, "vLLM", "vLLM will not load it: block-diagonal LoRA (use_bdlora is set)"),
    ("vllm qalora", {"use_qalora": True}, "vLLM", "vLLM will not load it: QALoRA (use_qalora is set)"),
    ("vllm bias", {"bias": "all"}, "vLLM", "vLLM will not load it: bias='all' (only 'none')"),
    ("sglang fields", {"target_modules": None}, "SGLang", "SGLang will not load it: target_modules missing (required fields)"),
    ("sglang peft_type", {"peft_type": "LOHA"}, "SGLang", "SGLang will not load it: peft_type 'LOHA' (only LORA)"),
    (
        "sglang q without v",
        {"target_modules": ["q_proj", "k_proj"]},
        "SGLang",
        "SGLang will not load it: q_proj without v_proj (its loader stacks q, k, v and fails on the missing v_proj)",
    ),
    ("sglang dora", {"use_dora": True}, "SGLang", "SGLang will not load it: DoRA (use_dora is set)"),
    ("sglang modules_to_save", {"modules_to_save": ["lm_head"]}, "SGLang", "SGLang loads it: modules_to_save ['lm_head'] dropped"),
    ("sglang bias", {"bias": "lora_only"}, "SGLang", "SGLang loads it: biases ignored (bias='lora_only', lora_bias=False)"),
    ("sglang lora_bias", {"lora_bias": True}, "SGLang", "SGLang loads it: biases ignored (bias='none', lora_bias=True)"),
    ("sglang rslora", {"use_rslora": True}, "SGLang", "SGLang loads it: use_rslora ignored (scales by lora_alpha / r, not / sqrt(r))"),
]


def _config(changes: dict) -> dict:
    config = {**OK, **changes}
    return {k: v for k, v in config.items() if v is not None}


@pytest.mark.parametrize("changes, server, line", [case[1:] for case in BROKEN], ids=[case[0] for case in BROKEN])
def test_each_rule_is_broken_by_a_config_of_its_own(changes, server, line):
    assert serving_problems(_config({})) == []
    assert line in serving_problems(_config(changes), server)
    assert line in serving_problems(_config(changes))  # both servers' lists


def test_every_rule_of_each_server_has_its_breaking_config():
    for server, rules in RULES.items():
        cases = [_config(changes) for _, changes, s, _ in BROKEN if s == server]
        for i, rule in enumerate(rules):
            assert rule.broken(_config({})) is None, (server, i)
            assert any(rule.broken(c) for c in cases), f"{server} rule {i} has no config that breaks it"
    assert len(VLLM_RULES) + len(SGLANG_RULES) <= len(BROKEN)


def test_lora_on_the_output_head_and_embeddings_is_no_refusal():
    """vLLM expects lm_head and embed_tokens LoRA on Llama-family models; SGLang loads them when targeted."""
    config = _config({"target_modules": ["q_proj", "v_proj", "lm_head", "embed_tokens"]})
    assert serving_problems(config) == []
    assert serving_problems(_config({"modules_to_save": ["classifier", "score"]}), "vLLM") == []  # classification heads load


@pytest.mark.parametrize(
    "rank, flag", [(1, ""), (8, ""), (16, ""), (17, " --max-lora-rank 32"), (32, " --max-lora-rank 32"), (300, " --max-lora-rank 320")]
)
def test_the_vllm_command_asks_for_the_rank_it_needs(rank, flag):
    vllm, sglang = serve_commands({"r": rank}, "org/base", "runs/1/step-000010/adapter")
    assert vllm == f"vllm serve org/base --enable-lora{flag} --lora-modules step-000010=runs/1/step-000010/adapter"
    assert (
        sglang == "python -m sglang.launch_server --model-path org/base --enable-lora --lora-paths step-000010=runs/1/step-000010/adapter"
    )
    assert vllm_max_lora_rank(rank) >= rank and vllm_max_lora_rank(513) is None


def test_serving_report_reads_the_checkpoints_adapter(tmp_path):
    step = tmp_path / "step-000004"
    (step / "adapter").mkdir(parents=True)
    assert serving_report(step, "org/base") == ([], [])  # no adapter_config.json: no adapter
    (step / "adapter" / "adapter_config.json").write_text(json.dumps({**OK, "r": 32, "target_modules": ["q_proj"]}))
    commands, problems = serving_report(step, "org/base")
    assert commands[0] == f"vllm serve org/base --enable-lora --max-lora-rank 32 --lora-modules step-000004={step / 'adapter'}"
    assert problems == ["SGLang will not load it: q_proj without v_proj (its loader stacks q, k, v and fails on the missing v_proj)"]


def test_fuzzed_configs_give_lines_never_exceptions():
    """serving_problems on hostile adapter_config.json values (any JSON type for any field the rules read):
    a list of one-line strings, never an exception; serve_commands likewise."""
    import random

    rng = random.Random(2024)
    values = [None, True, False, 0, -3, 7, 2**40, 1.5, "", "x", "pissa", "all-linear", [], ["q_proj"], ["lm_head", 3], {}, {"q": 600}]
    keys = [*OK, "rank_pattern", "modules_to_save", "use_dora", "lora_bias", "init_lora_weights", "use_rslora", "use_qalora"]
    for _ in range(500):
        config = {k: rng.choice(values) for k in rng.sample(keys, rng.randint(0, len(keys)))}
        lines = serving_problems(config)
        assert all(isinstance(line, str) and line and "\n" not in line for line in lines), config
        assert len(serve_commands(config, "org/base", "ckpt/adapter")) == 2
