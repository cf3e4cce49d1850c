"""Every slimtune module imports on its own, the module import graph has no cycle and no import goes up
the layer table of docs/architecture.md: imports inside functions count too (a cycle or an upward edge
hidden in a function is still one), ``TYPE_CHECKING`` ones as well. The docs name every module (the
layer table; tests/README.md's module table) and every test file (tests/README.md)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "slimtune"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
TESTS_README = ROOT / "tests" / "README.md"
_LAYER_ROW = re.compile(r"^\| (\d+) [^|]*\| `([^`]+)` \|", re.M)


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        mods[name] = path
    return mods


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the slimtune modules it imports anywhere in its source (``from slimtune.x import y``
    counts as ``slimtune.x.y`` when that is a module, else ``slimtune.x``); a package's own
    ``__init__`` re-exports are left out (importing a submodule runs it first anyway)."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("slimtune"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in mods else resolve(node.module))
            elif isinstance(node, ast.Import):
                targets |= {resolve(a.name) for a in node.names if a.name.startswith("slimtune")}
        graph[name] = {t for t in targets if t and t != name and t != "slimtune"}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (iterative depth-first search, three colours)."""
    colour = dict.fromkeys(graph, 0)
    for start in graph:
        if colour[start]:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        colour[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour.get(child, 2) == 1:
                return path[path.index(child) :] + [child]
            elif colour.get(child) == 0:
                colour[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph[child]))))
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_among_slimtune_modules():
    mods = _modules()
    graph = import_graph(mods)
    assert len(graph) == len(mods) > 30
    assert "slimtune.formats.manifest" in graph["slimtune.checkpoint.atomic"]  # the graph sees real edges
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def layer_table(text: str) -> dict[str, int]:
    """Module path (relative to slimtune/) -> layer number, from the rows ``| N name | `path` | ... |``
    of docs/architecture.md's layer table; a module in two rows is an error."""
    layers: dict[str, int] = {}
    for number, path in _LAYER_ROW.findall(text):
        assert path not in layers, f"docs/architecture.md: {path} is in the layer table twice"
        layers[path] = int(number)
    return layers


def upward_edges(graph: dict[str, set[str]], layer_of: dict[str, int]) -> list[str]:
    """Every import from a module to one in a higher layer, as ``a (layer i) -> b (layer j)``."""
    return [
        f"{a} (layer {layer_of[a]}) imports {b} (layer {layer_of[b]})"
        for a in sorted(graph)
        for b in sorted(graph[a])
        if layer_of[b] > layer_of[a]
    ]


def _layers_by_module(mods: dict[str, Path]) -> dict[str, int]:
    table = layer_table(ARCHITECTURE.read_text())
    paths = {name: path.relative_to(PACKAGE).as_posix() for name, path in mods.items()}
    missing = sorted(p for p in paths.values() if p not in table)
    assert not missing, f"docs/architecture.md's layer table lacks {missing}: give each a row in its layer"
    stale = sorted(set(table) - set(paths.values()))
    assert not stale, f"docs/architecture.md's layer table names modules that do not exist: {stale}"
    return {name: table[p] for name, p in paths.items()}


def test_the_layer_check_finds_an_upward_import():
    table = layer_table("| 1 base | `errors.py` | x |\n| 2 formats | `formats/hf.py` | y |\n")
    assert table == {"errors.py": 1, "formats/hf.py": 2}
    layer_of = {"slimtune.errors": 1, "slimtune.formats.hf": 2}
    assert upward_edges({"slimtune.errors": {"slimtune.formats.hf"}, "slimtune.formats.hf": set()}, layer_of) == [
        "slimtune.errors (layer 1) imports slimtune.formats.hf (layer 2)"
    ]
    assert upward_edges({"slimtune.errors": set(), "slimtune.formats.hf": {"slimtune.errors"}}, layer_of) == []
    with pytest.raises(AssertionError, match="twice"):
        layer_table("| 1 base | `errors.py` | x |\n| 3 model | `errors.py` | y |\n")


def test_no_import_goes_up_the_layer_table():
    mods = _modules()
    layer_of = _layers_by_module(mods)
    assert len(set(layer_of.values())) >= 8  # the table was read, layer by layer
    bad = upward_edges(import_graph(mods), layer_of)
    assert not bad, "imports that go up docs/architecture.md's layer table:\n" + "\n".join(bad)


def test_tests_readme_names_every_test_file_and_every_module():
    text = TESTS_README.read_text()
    table = text[text.index("## Module -> tests") :]
    named = set(re.findall(r"`([^`]+)`", table))
    files = sorted(p.name for p in (ROOT / "tests").glob("*.py") if p.name != "__init__.py")
    files += sorted(f"{p.parent.name}/" for p in (ROOT / "tests").glob("*/sitecustomize.py"))
    assert [f for f in files if f"`{f}`" not in text] == [], "tests/README.md does not name these test files"
    mods = [p.relative_to(PACKAGE).as_posix() for p in _modules().values() if p.read_text().strip()]
    assert [m for m in mods if m not in named] == [], "tests/README.md's module table does not name these modules"


def test_every_module_imports_in_a_fresh_interpreter():
    names = [n for n in _modules() if n != "slimtune.__main__"]
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\nprint('imported', len(sys.argv) - 1)"
    done = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == f"imported {len(names)}"


def public_names(mods: dict[str, Path]) -> dict[str, list[str]]:
    """Public (no leading ``_``) top-level class and function name -> the modules that define it."""
    names: dict[str, list[str]] = {}
    for name, path in mods.items():
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                names.setdefault(node.name, []).append(name)
    return names


def test_the_name_check_finds_a_shared_name(tmp_path):
    (tmp_path / "a.py").write_text("def load():\n    pass\n\n\nclass Options:\n    pass\n\n\ndef _private():\n    pass\n")
    (tmp_path / "b.py").write_text("def load():\n    pass\n\n\ndef _private():\n    pass\n")
    names = public_names({"a": tmp_path / "a.py", "b": tmp_path / "b.py"})
    assert names == {"load": ["a", "b"], "Options": ["a"]}


def test_no_two_modules_define_the_same_public_name():
    """One name, one meaning: no two slimtune modules define a public class or function of the same name."""
    names = public_names(_modules())
    assert names["MergeSource"] == ["slimtune.formats.merge_source"] and len(names) > 300  # the scan saw the package
    shared = {n: mods for n, mods in sorted(names.items()) if len(mods) > 1}
    assert not shared, f"public names defined in more than one module: {shared}"


def test_every_data_file_of_the_package_ships():
    """The files slimtune reads beside its modules (configs, C loops) are package data: a wheel install
    has them, not only an editable one."""
    import fnmatch

    table = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.package-data]", 1)[1]
    patterns = re.findall(r'"([^"]+)"', re.search(r"^slimtune = \[(.*)\]$", table, re.M).group(1))  # tomllib: Python 3.11+
    data = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")]
    assert data and [f for f in data if not any(fnmatch.fnmatch(f, pat) for pat in patterns)] == []
