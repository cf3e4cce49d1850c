"""slimtune.gguf.header: the GGUF head (header, metadata, tensor infos) is the ``gguf`` package's public
writer's, byte for byte, whether the arrays go through the one fast path (packed in one go, on the
``gguf`` series it was checked against) or through the public writer (any other ``gguf``); the fast path
is chosen by the installed version and the private names it needs. The whole export with either path:
tests/test_gguf.py."""

from __future__ import annotations

import importlib.metadata

import gguf
import numpy as np
import pytest

from slimtune.gguf import header

V = gguf.GGUFValueType
# every kind of value the fast path takes over, and each it leaves to the package
KV = [
    ("a.tokens", ["<s>", "héllo", "\u0120world", "日本", "", "a\x00b"], V.ARRAY, None),
    ("a.tokens_inferred", ["x", "yz"], V.ARRAY, None),
    ("a.types", [1, 2, 3, 6, -4], V.ARRAY, V.INT32),
    ("a.inferred_ints", [5, 70000, -1], V.ARRAY, None),
    ("a.u32", [0, 2**32 - 1], V.ARRAY, V.UINT32),
    ("a.floats", [0.5, -1e-3, 3], V.ARRAY, V.FLOAT32),
    ("a.inferred_floats", [0.25, 1e30], V.ARRAY, None),
    ("a.bools", [True, False, True], V.ARRAY, V.BOOL),
    ("a.bools_inferred", [True, False], V.ARRAY, None),
    ("a.scalar", 7, V.UINT32, None),
    ("a.name", "tiny", V.STRING, None),
]
TENSOR = ("t", (2, 32), 2 * 34, gguf.GGMLQuantizationType.Q8_0)


def _package_bytes(path, kv) -> bytes:
    """The head as the package's own ``GGUFWriter`` writes it."""
    w = gguf.GGUFWriter(path, "llama")
    for key, value, vtype, sub in kv:
        w.add_key_value(key, value, vtype, sub_type=sub)
    name, shape, nbytes, qtype = TENSOR
    w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path.read_bytes()


def _counting_fast_path(monkeypatch) -> list:
    calls = []
    real = header._PackedWriter._pack_val
    monkeypatch.setattr(header._PackedWriter, "_pack_val", lambda self, *a, **k: (calls.append(a), real(self, *a, **k))[1])
    return calls


def test_installed_gguf_takes_the_fast_path_of_its_series():
    version = importlib.metadata.version("gguf")
    series = tuple(int(n) for n in version.split(".")[:2])
    assert header.fast_packing() == (series in header._FAST_SERIES)
    assert header.fast_packing("0.17.0") and header.fast_packing("0.19.4.dev1")
    assert not header.fast_packing("0.99.0") and not header.fast_packing("0.16.9") and not header.fast_packing("1.17.0")


def test_fast_path_needs_the_private_names(monkeypatch):
    monkeypatch.delattr(gguf.GGUFWriter, "_simple_value_packing")
    assert not header.fast_packing("0.17.0")
    monkeypatch.undo()
    monkeypatch.setattr(gguf.GGUFWriter, "_pack_val", None)
    assert not header.fast_packing("0.17.0")


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "public"])
def test_head_is_the_gguf_packages_bytes(tmp_path, monkeypatch, fast):
    """The head ``write_head`` writes (header, metadata, tensor infos) is byte for byte the package's own,
    for each kind of value the fast path takes over and each it leaves to the package, on the fast path
    and on the public one (no array goes through the fast path then); a mixed array is refused as the
    package refuses it. (Moved here from test_gguf_export_inputs.py with the writer.)"""
    installed = tuple(int(n) for n in importlib.metadata.version("gguf").split(".")[:2])
    monkeypatch.setattr(header, "_FAST_SERIES", (installed,) if fast else ())
    assert header.fast_packing() == fast
    calls = _counting_fast_path(monkeypatch)
    kv = [(key, value, vtype if sub is None else sub) for key, value, vtype, sub in KV]  # write_head's form of each pair
    size = header.write_head(tmp_path / "ours.gguf", "llama", kv, [TENSOR])
    ours = (tmp_path / "ours.gguf").read_bytes()
    assert ours == _package_bytes(tmp_path / "package.gguf", KV) and size == len(ours) > 200
    assert bool(calls) == fast  # the fast path's writer packed the head, or the package's own did
    with pytest.raises(ValueError):
        header.write_head(tmp_path / "mixed.gguf", "llama", [("a.mixed", ["x", 1], V.ARRAY)], [])
    with pytest.raises(ValueError):
        _package_bytes(tmp_path / "mixed-package.gguf", [("a.mixed", ["x", 1], V.ARRAY, None)])
