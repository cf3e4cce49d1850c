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
    one without, and each floor is the largest of the disk's and the CPU's seconds."""
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
    }
    assert f["quantize_core_s"] > 0 and f["hash_core_s"] > 0 and f["cores"] >= 1
    assert f["cpu_s"] > f["cpu_no_verify_s"] > 0
    disk = [s for s in (f["read_s"], f["write_s"]) if s is not None]
    assert f["floor_s"] == max([f["cpu_s"], *disk]) and f["floor_no_verify_s"] == max([f["cpu_no_verify_s"], *disk])
    assert ratio_floor(f, 2 * f["floor_s"]) == 0.5 and sorted(p.name for p in tmp_path.iterdir()) == ["base.safetensors"]


def test_the_save_bench_prints_its_floors(tmp_path, capsys):
    import json

    main(["save", "--preset", "tiny", "--out", str(tmp_path)])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["floors"]["read_s"] is None  # the save reads no base: the model is in memory
    assert row["floors"]["quantize_core_s"] is None and row["floors"]["hash_core_s"] > 0
    assert row["ratio_floor"] > 0 and row["ratio_floor"] == pytest.approx(row["floors"]["floor_s"] / row["save_s"], rel=0.1, abs=0.02)
