"""slimtune.formats.gguf_types, the one list of GGUF type names, and every reader of it: the config's
``checkpoint.gguf``, ``slimtune export --type`` (its help) and ``--adapter-only``, the export's types and
file types, the mixes. Each takes the same names, and each name means the type llama.cpp gives it."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import gguf
import pytest

from slimtune.errors import SlimtuneError
from slimtune.formats.gguf_types import ADAPTER_TYPES, MIX_TYPES, PLAIN_TYPES, TYPE_NAMES

Q, FT = gguf.GGMLQuantizationType, gguf.LlamaFileType
_NAME = re.compile(r"\b(?:f32|f16|bf16|q\d_[0-9a-z_]+)\b")

# What each name means in llama.cpp (its convert_hf_to_gguf.py --outtype, llama-quantize's mixes), spelled
# out here as the oracle of the export's and the mixes' tables.
LLAMA_CPP = {
    "f32": (Q.F32, FT.ALL_F32),
    "f16": (Q.F16, FT.MOSTLY_F16),
    "bf16": (Q.BF16, FT.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, FT.MOSTLY_Q8_0),
    "q4_0": (Q.Q4_0, FT.MOSTLY_Q4_0),
    "q4_1": (Q.Q4_1, FT.MOSTLY_Q4_1),
    "q5_0": (Q.Q5_0, FT.MOSTLY_Q5_0),
    "q5_1": (Q.Q5_1, FT.MOSTLY_Q5_1),
    "q4_k_m": (Q.Q4_K, FT.MOSTLY_Q4_K_M),
    "q4_k_s": (Q.Q4_K, FT.MOSTLY_Q4_K_S),
    "q5_k_m": (Q.Q5_K, FT.MOSTLY_Q5_K_M),
    "q5_k_s": (Q.Q5_K, FT.MOSTLY_Q5_K_S),
    "q6_k": (Q.Q6_K, FT.MOSTLY_Q6_K),
    "q3_k_s": (Q.Q3_K, FT.MOSTLY_Q3_K_S),
    "q3_k_m": (Q.Q3_K, FT.MOSTLY_Q3_K_M),
    "q3_k_l": (Q.Q3_K, FT.MOSTLY_Q3_K_L),
    "q2_k": (Q.Q2_K, FT.MOSTLY_Q2_K),
}


def _export_parser_help(option: str) -> str:
    from slimtune.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    export = sub.choices["export"]
    return next(a.help for a in export._actions if option in a.option_strings)


def test_the_names_are_one_list():
    assert TYPE_NAMES == (*PLAIN_TYPES, *MIX_TYPES)
    assert len(set(TYPE_NAMES)) == len(TYPE_NAMES) == 17
    assert set(ADAPTER_TYPES) <= set(PLAIN_TYPES)
    assert set(TYPE_NAMES) == set(LLAMA_CPP)


def test_the_config_takes_exactly_the_names():
    from slimtune.config.keys import KEYS

    key = KEYS["checkpoint.gguf"]
    assert key.choices == TYPE_NAMES and key.nullable
    for name in TYPE_NAMES:
        assert key.check(name, "c.yaml") == name
    for bad in ("q4_k", "Q8_0", "f8", "gguf"):
        with pytest.raises(SlimtuneError, match=r"checkpoint\.gguf.*must be one of f32, f16, bf16, q8_0"):
            key.check(bad, "c.yaml")


def test_the_cli_help_lists_exactly_the_names():
    names, default = _export_parser_help("--type").split("(default: ")
    assert tuple(_NAME.findall(names)) == TYPE_NAMES and default.rstrip(")") in TYPE_NAMES
    assert tuple(_NAME.findall(_export_parser_help("--adapter-only"))) == ADAPTER_TYPES


def test_the_export_and_the_mixes_give_each_name_llama_cpps_types():
    from slimtune.gguf import export, mix

    assert tuple(export.TYPES) == PLAIN_TYPES and tuple(mix.MIXES) == MIX_TYPES
    assert tuple(export._FILE_TYPES) == TYPE_NAMES
    for name, (qtype, ftype) in LLAMA_CPP.items():
        assert (export.TYPES[name] if name in PLAIN_TYPES else mix.MIXES[name][0]) == qtype, name
        assert export._FILE_TYPES[name] == ftype, name
    for name in TYPE_NAMES:
        export._check_type(name)
    with pytest.raises(SlimtuneError, match="GGUF type 'q4_k': expected one of f32, f16, bf16, q8_0"):
        export._check_type("q4_k")


def test_the_names_load_without_the_gguf_package():
    """The config and the CLI read the names: importing them loads neither ``gguf`` nor torch."""
    code = "import sys, slimtune.formats.gguf_types; print(sorted({'gguf', 'torch', 'numpy'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
