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
