"""adapter_config.json field by field against the real PEFT: every variant PEFT merges, slimtune's merge
gives the same weights (within test_merge.py's tolerance policy: one bf16 ulp, two for DoRA); every
variant slimtune refuses, it refuses with one line naming the field, tensor or module. Never different."""

from __future__ import annotations

import copy
import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from slimtune.checkpoint.writer import WriteOptions
from slimtune.errors import SlimtuneError
from slimtune.formats.merge_source import MergeSource
from slimtune.merge import merge_from_files

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig kwargs, and optional edits of the saved adapter_config.json (PEFT loads the edited file too)
MERGED = {
    "list": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), {}),
    "regex_string": (dict(r=4, lora_alpha=8, target_modules=r".*\.layers\.1\..*(q_proj|down_proj)"), {}),
    "all_linear": (dict(r=2, lora_alpha=4, target_modules="all-linear"), {}),
    "layers_to_transform": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"], layers_to_transform=[1]), {}),
    "layers_pattern": (dict(r=4, lora_alpha=8, target_modules=["up_proj"], layers_to_transform=0, layers_pattern="layers"), {}),
    "exact_name_bypasses_layers": (
        dict(r=4, lora_alpha=8, target_modules=["model.layers.0.mlp.gate_proj", "v_proj"], layers_to_transform=[1]),
        {},
    ),
    "exclude_modules": (dict(r=4, lora_alpha=8, target_modules=ALL, exclude_modules=["layers.0.self_attn.q_proj", "down_proj"]), {}),
    "rank_alpha_patterns": (
        dict(
            r=4,
            lora_alpha=8,
            target_modules=ALL,
            rank_pattern={"q_proj": 2, r"layers\.1\.mlp\.up_proj": 6},
            alpha_pattern={"v_proj": 3, r"layers\.0\.self_attn\.k_proj": -5},
        ),
        {},
    ),
    "rslora_patterns": (dict(r=8, lora_alpha=16, use_rslora=True, target_modules=ALL, rank_pattern={"o_proj": 2}), {}),
    "negative_and_zero_alpha": (dict(r=4, lora_alpha=-16, target_modules=["q_proj", "k_proj"], alpha_pattern={"k_proj": 0}), {}),
    "fan_in_fan_out_on_linear": (dict(r=4, lora_alpha=8, target_modules=["q_proj"]), {"fan_in_fan_out": True}),
    "dora": (dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "down_proj"]), {}),
    "modules_to_save": (dict(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"]), {}),
    "embedding": (dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]), {}),
    "gaussian_init_float_alpha": (dict(r=4, lora_alpha=7.5, init_lora_weights="gaussian", target_modules=["v_proj"]), {}),
}
ULPS = {"dora": 2}


@pytest.fixture(scope="module")
def base_model(tiny_base):
    return AutoModelForCausalLM.from_pretrained(str(tiny_base), dtype=torch.bfloat16)


def make_adapter(base_model, out_dir, seed=0, **kwargs):
    model = peft.get_peft_model(copy.deepcopy(base_model), peft.LoraConfig(task_type="CAUSAL_LM", **kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name or "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.05)
            elif "lora_magnitude_vector" in name:
                p.mul_(1 + 0.1 * torch.rand(p.shape, generator=gen).to(p.dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(str(out_dir))
    return out_dir


def edit_config(adapter, **changes):
    path = adapter / "adapter_config.json"
    config = json.loads(path.read_text())
    for k, v in changes.items():
        if v is _DELETE:
            config.pop(k, None)
        else:
            config[k] = v
    path.write_text(json.dumps(config))


_DELETE = object()


def peft_merged(base_model, adapter) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.PeftModel.from_pretrained(copy.deepcopy(base_model), str(adapter)).eval()
        return model.merge_and_unload().state_dict()


def slimtune_merged(tiny_base, adapter, out) -> dict[str, torch.Tensor]:
    merge_from_files(MergeSource(tiny_base, adapter), out, WriteOptions(progress=False))
    tensors = {}
    for f in sorted(out.glob("model-*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.mark.parametrize("variant", sorted(MERGED))
def test_variant_merges_as_peft_does(variant, base_model, tiny_base, tmp_path):
    kwargs, edits = MERGED[variant]
    adapter = make_adapter(base_model, tmp_path / "adapter", **kwargs)
    edit_config(adapter, **edits)
    ours = slimtune_merged(tiny_base, adapter, tmp_path / "merged")
    theirs = peft_merged(base_model, adapter)
    base = base_model.state_dict()
    changed = 0
    for name, t in ours.items():
        ref = theirs[name]
        diff = (t.double() - ref.double()).abs()
        allowed = ULPS.get(variant, 1) * t.double().abs().clamp_min(ref.double().abs()) * 2**-8 + 1e-30
        assert (diff <= allowed).all(), (variant, name, diff.max().item())
        changed += not torch.equal(ref, base[name])
        # a tensor PEFT leaves alone, slimtune leaves bit-identical (and vice versa)
        assert torch.equal(t, base[name]) == torch.equal(ref, base[name]), (variant, name)
    assert set(ours) == set(theirs)
    assert changed > 0, variant  # the variant does change something, so the comparison means something


def _plain(base_model, tmp_path, **kwargs):
    return make_adapter(base_model, tmp_path / "adapter", **{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **kwargs})


REFUSED_CONFIG = {
    "r_fraction": ({"r": 8.5}, "r must be a positive integer"),
    "r_zero": ({"r": 0}, "r must be a positive integer"),
    "r_bool": ({"r": True}, "r must be a positive integer"),
    "r_string": ({"r": "4"}, "r must be a positive integer"),
    "alpha_string_nan": ({"lora_alpha": "nan"}, "lora_alpha must be a finite number"),
    "alpha_null": ({"lora_alpha": None}, "lora_alpha must be a finite number"),
    "target_number": ({"target_modules": 5}, "target_modules must be"),
    "target_bad_regex": ({"target_modules": "(q_proj"}, "target_modules"),
    "target_missing": ({"target_modules": _DELETE}, "target_modules is missing"),
    "targets_exclude_weights": ({"target_modules": ["k_proj"]}, "does not select it"),
    "layers_exclude_weights": ({"layers_to_transform": [0]}, "does not select it"),
    "rank_pattern_list": ({"rank_pattern": ["q_proj"]}, "rank_pattern must be an object"),
    "rank_pattern_zero": ({"rank_pattern": {"q_proj": 0}}, "rank_pattern"),
    "rank_pattern_regex": ({"rank_pattern": {"(": 4}}, "not a valid regular expression"),
    "rank_pattern_mismatch": ({"rank_pattern": {"q_proj": 2}}, "rank_pattern['q_proj']"),
    "alpha_pattern_string": ({"alpha_pattern": {"q_proj": "x"}}, "alpha_pattern"),
    "bias_all": ({"bias": "all"}, "bias"),
    "pissa": ({"init_lora_weights": "pissa"}, "init_lora_weights"),
    "layer_replication": ({"layer_replication": [[0, 1]]}, "layer_replication"),
    "use_dora_string": ({"use_dora": "yes"}, "use_dora must be true or false"),
    "peft_type": ({"peft_type": "IA3"}, "peft_type"),
    "modules_to_save_number": ({"modules_to_save": 3}, "modules_to_save"),
    "regex_and_layers": ({"target_modules": ".*q_proj", "layers_to_transform": [0]}, "layers_to_transform cannot be used"),
}


@pytest.mark.parametrize("variant", sorted(REFUSED_CONFIG))
def test_config_variant_is_refused_naming_the_field(variant, base_model, tiny_base, tmp_path):
    changes, needle = REFUSED_CONFIG[variant]
    adapter = _plain(base_model, tmp_path)
    edit_config(adapter, **changes)
    with pytest.raises(SlimtuneError, match=_escape(needle)) as info:
        merge_from_files(MergeSource(tiny_base, adapter), tmp_path / "out", WriteOptions(progress=False))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def _escape(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize(
    "raw, needle",
    [
        ("[]", "expected a JSON object, found array"),
        ('"x"', "found string"),
        ("null", "found null"),
        ("5", "found integer"),
        ('{"r": NaN, "lora_alpha": 8, "target_modules": ["q_proj"]}', "NaN"),
        ('{"r": 4, "lora_alpha": Infinity, "target_modules": ["q_proj"]}', "Infinity"),
        ('{"r": 4, "lora_alpha": 1e400, "target_modules": ["q_proj"]}', "out of range"),
        ('{"r": 4, "r": 8, "lora_alpha": 8, "target_modules": ["q_proj"]}', "duplicate key"),
    ],  # fmt: skip
)
def test_malformed_adapter_config_json_is_refused(raw, needle, base_model, tiny_base, tmp_path):
    adapter = _plain(base_model, tmp_path)
    (adapter / "adapter_config.json").write_text(raw)
    with pytest.raises(SlimtuneError, match=needle):
        merge_from_files(MergeSource(tiny_base, adapter), tmp_path / "out", WriteOptions(progress=False))


def test_tensor_faults_are_refused_naming_the_tensor(base_model, tiny_base, tmp_path):
    dora = make_adapter(base_model, tmp_path / "dora", r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj"])
    edit_config(dora, use_dora=False)  # a magnitude vector PEFT would not apply
    with pytest.raises(SlimtuneError, match="lora_magnitude_vector but use_dora is false"):
        merge_from_files(MergeSource(tiny_base, dora), tmp_path / "o1", WriteOptions(progress=False))

    plain = _plain(base_model, tmp_path)
    state = load_file(plain / "adapter_model.safetensors")
    key = next(k for k in state if k.endswith("lora_B.weight"))
    for bad in (float("nan"), float("inf")):
        broken = tmp_path / f"broken{bad}"
        shutil.copytree(plain, broken)
        poisoned = dict(state)
        poisoned[key] = state[key].clone()
        poisoned[key][0, 0] = bad
        save_file(poisoned, broken / "adapter_model.safetensors")
        with pytest.raises(SlimtuneError, match=_escape(key) + ".*NaN or infinite"):
            merge_from_files(MergeSource(tiny_base, broken), tmp_path / "o2", WriteOptions(progress=False))

    huge = tmp_path / "huge"
    shutil.copytree(plain, huge)
    edit_config(huge, lora_alpha=1e9)  # finite, but the merged weight overflows fp16
    with pytest.raises(SlimtuneError, match="non-finite values in torch.float16"):
        merge_from_files(MergeSource(tiny_base, huge), tmp_path / "o3", WriteOptions(dtype="fp16", progress=False))
    assert not (tmp_path / "o3").exists()

    for name, obj in [("list", [1, 2]), ("intkeys", {1: torch.zeros(1)}), ("values", {"base_model.model.x.lora_A.weight": 3})]:
        binary = tmp_path / f"bin_{name}"
        shutil.copytree(plain, binary)
        (binary / "adapter_model.safetensors").unlink()
        torch.save(obj, binary / "adapter_model.bin")
        with pytest.raises(SlimtuneError, match="adapter_model.bin"):
            merge_from_files(MergeSource(tiny_base, binary), tmp_path / "o4", WriteOptions(progress=False))


@pytest.mark.parametrize(
    "lora",
    [
        dict(),  # the defaults: r 8, alpha 16, the attention and MLP projections
        dict(rank=12, alpha=7.0, use_rslora=True, target_modules=["all-linear"]),  # loads with --max-lora-rank 16
        dict(rank=64, alpha=128.0, target_modules=["q_proj", "v_proj"]),
    ],
)
def test_written_adapter_configs_pass_vllms_loading_rules(lora, tiny_base, tmp_path):
    """The adapter_config.json slimtune writes, against vLLM's and SGLang's loader rules (neither server, CUDA-only,
    is installed: the rules are the ones formats/serving.py spells out, asserted here field by field too).
    SGLang loads an rsLoRA adapter but scales it by alpha / r: said, not refused."""
    from slimtune.checkpoint.save import save_checkpoint
    from slimtune.formats.serving import VLLM_MAX_LORA_RANKS, serving_problems, vllm_max_lora_rank
    from slimtune.lora import LoRAConfig
    from slimtune.model import load_qlora_model

    model = load_qlora_model(tiny_base, LoRAConfig(**lora), progress=False)
    save_checkpoint(model, tmp_path / "ckpt", WriteOptions(progress=False, adapter_only=True))
    config = json.loads((tmp_path / "ckpt" / "adapter" / "adapter_config.json").read_text())
    assert serving_problems(config, "vLLM") == []
    rslora = ["SGLang loads it: use_rslora ignored (scales by lora_alpha / r, not / sqrt(r))"]
    assert serving_problems(config, "SGLang") == (rslora if lora.get("use_rslora") else [])
    assert {"r", "lora_alpha", "target_modules"} <= config.keys() and config["modules_to_save"] is None
    assert not config["use_dora"] and config["bias"] == "none"
    assert not {"lm_head", "embed_tokens"} & set(config["target_modules"])
    assert vllm_max_lora_rank(config["r"]) in VLLM_MAX_LORA_RANKS and config["r"] <= VLLM_MAX_LORA_RANKS[-1]
