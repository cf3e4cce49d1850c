"""The benches' own checks (bench/) (the figures themselves are printed by the benches, never asserted here)."""

import pytest

from bench.cli import main
from slimtune.synthetic import preset_config


def test_gguf_peer_rejects_a_type_the_converter_cannot_write_before_writing_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["gguf", "--preset", "tiny", "--type", "q4_0", "--peer", "llama.cpp", "--out", str(tmp_path)])
    assert "convert_hf_to_gguf.py writes f32, f16, bf16, q8_0" in str(e.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("preset", ["tiny", "llama3-8b"])
def test_synthetic_presets_name_their_architecture_and_take_a_larger_vocabulary(preset):
    config = preset_config(preset, vocab_size=49152)  # llama.cpp's converter picks its model class by architectures
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.vocab_size == 49152


def test_the_floors_of_a_job_are_the_largest_of_read_write_and_cpu(tmp_path):
    """bench/floors.py on a small base: every floor is there, the CPU floor with the hash check covers the
    one without, and each floor is the largest of the disk's and the CPU's seconds; the read and the write
    at once take at least as long as the longer of the two alone would allow (within the probes' noise:
    they are separate runs), and the floor of both at once is the largest of that and the CPU."""
    from bench.floors import floors, ratio_floor

    base = tmp_path / "base.safetensors"
    base.write_bytes(bytes(range(256)) * 40_000)
    f = floors([base], tmp_path, 4_000_000, hashed_bytes=4_000_000, verify_bytes=base.stat().st_size, quantize=("q4_k_m", 1 << 20))
    assert set(f) == {
        "read_s",
        "write_s",
        "hash_core_s",
        "quantize_core_s",
        "cores",
        "cpu_s",
        "cpu_no_verify_s",
        "floor_s",
        "floor_no_verify_s",
    } | ({"read_and_write_s", "floor_both_s", "floor_both_no_verify_s"} if f["read_s"] is not None else set())
    assert f["quantize_core_s"] > 0 and f["hash_core_s"] > 0 and f["cores"] >= 1
    assert f["cpu_s"] > f["cpu_no_verify_s"] > 0
    disk = [s for s in (f["read_s"], f["write_s"]) if s is not None]
    assert f["floor_s"] == max([f["cpu_s"], *disk]) and f["floor_no_verify_s"] == max([f["cpu_no_verify_s"], *disk])
    assert ratio_floor(f, 2 * f["floor_s"]) == 0.5 and sorted(p.name for p in tmp_path.iterdir()) == ["base.safetensors"]
    if f["read_s"] is not None:
        assert f["floor_both_s"] == max(f["cpu_s"], f["read_and_write_s"]) and f["read_and_write_s"] > 0
        assert f["floor_both_no_verify_s"] == max(f["cpu_no_verify_s"], f["read_and_write_s"])
        assert ratio_floor(f, 4 * f["floor_both_s"], both=True) == 0.25
    assert ratio_floor({"floor_s": 1.0}, 2.0, both=True) is None  # not measured: none, not a guess


def test_the_save_bench_prints_its_floors(tmp_path, capsys):
    import json

    main(["save", "--preset", "tiny", "--out", str(tmp_path)])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["floors"]["read_s"] is None  # the save reads no base: the model is in memory
    assert row["floors"]["quantize_core_s"] is None and row["floors"]["hash_core_s"] > 0
    assert row["ratio_floor"] > 0 and row["ratio_floor"] == pytest.approx(row["floors"]["floor_s"] / row["save_s"], rel=0.1, abs=0.02)


def test_the_vision_preset_overrides_its_language_model_and_keeps_the_tower_whole():
    config = preset_config("qwen2.5-vl-7b", num_hidden_layers=2)
    assert config.model_type == "qwen2_5_vl" and config.text_config.num_hidden_layers == 2
    assert config.text_config.hidden_size == 3584 and config.vision_config.depth == 32


def test_a_synthetic_vision_model_is_filled_under_the_models_names_and_saves_the_published_keys(tmp_path):
    """synthetic_qlora_model of a vision-language config fills the model's parameters (named
    model.language_model... where the file says model.layers...), and its merged save holds the tower."""
    from transformers import AutoConfig

    from slimtune.checkpoint.save import save_checkpoint
    from slimtune.checkpoint.writer import WriteOptions
    from slimtune.formats.safetensors import read_header
    from slimtune.synthetic import synthetic_qlora_model
    from slimtune.vision_families import TINY

    config = AutoConfig.for_model("qwen2_5_vl", **TINY["qwen2_5_vl"], dtype="bfloat16")
    config.text_config.vocab_size = 300
    model = synthetic_qlora_model(config)
    assert not [n for n, p in model.named_parameters() if p.is_meta]
    save_checkpoint(model, tmp_path / "out", WriteOptions(progress=False))
    keys = {k for f in (tmp_path / "out").glob("*.safetensors") for k in read_header(f).tensors}
    assert "model.layers.0.self_attn.q_proj.weight" in keys and "visual.blocks.0.attn.qkv.weight" in keys
    assert "visual.merger.mlp.0.weight" in keys and "lm_head.weight" in keys
