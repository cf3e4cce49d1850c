"""Models by hub id (slimtune.formats.hub) through huggingface_hub's real code path, never the network: a cache
the test lays out as the hub does (``models--org--name/snapshots/<commit>/``, ``refs/main``) with
HF_HUB_OFFLINE=1, and a local HTTP server on 127.0.0.1 speaking the hub's endpoints for downloads
(tests/hub_server.py). ``finetune``, ``merge --base`` and ``export --base`` with a hub id; the failures."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants

from slimtune.cli import main
from slimtune.config import load_config
from slimtune.errors import SlimtuneError
from slimtune.formats import hub
from slimtune.formats.hub import ModelSource, parse_hub_id, resolve_model
from tests.conftest import run_cli
from tests.hub_server import HubServer, Repo, commit_hash, fill_cache

CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens, so "no network"
ONE, TWO = commit_hash("one"), commit_hash("two")


class HubEnv:
    """huggingface_hub pointed at a cache and endpoint of the test's own, in this process (its constants,
    read at import) and for subprocesses (the environment)."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
        self.home, self.mp = tmp_path / "hf", monkeypatch
        self.cache = self.home / "hub"
        self.env = {"HF_HOME": str(self.home), "HF_HUB_CACHE": str(self.cache), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        for k, v in self.env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(self.cache))
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(self.home / "token"))
        monkeypatch.setattr(hub, "_RESOLVED", {})
        self.offline(True)
        self.point_at(CLOSED)

    def offline(self, on: bool) -> None:
        self.mp.setattr(constants, "HF_HUB_OFFLINE", on)
        self.mp.setenv("HF_HUB_OFFLINE", "1" if on else "0")

    def point_at(self, endpoint: str) -> None:
        self.mp.setattr(constants, "ENDPOINT", endpoint)
        self.mp.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        self.mp.setenv("HF_ENDPOINT", endpoint)


@pytest.fixture
def hub_env(tmp_path, monkeypatch) -> HubEnv:
    return HubEnv(tmp_path, monkeypatch)


def two_commits(tiny_base: Path, tmp_path: Path) -> Repo:
    """The tiny base at commit ONE (tag v1) and, with other weights, at TWO (main)."""
    other = tmp_path / "other"
    shutil.copytree(tiny_base, other)
    data = bytearray((other / "model.safetensors").read_bytes())
    data[-4:] = b"\x00\x00\x00\x00"  # the last bf16 values of the last tensor: a different model, same layout
    (other / "model.safetensors").write_bytes(bytes(data))
    one, two = Repo.of_directory(tiny_base, ONE), Repo.of_directory(other, TWO)
    return Repo({**one.commits, **two.commits}, {"main": TWO, "v1": ONE})


def test_hub_ids_are_told_from_paths(tmp_path):
    assert parse_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") == ("HuggingFaceTB/SmolLM2-135M-Instruct", None)
    assert parse_hub_id("org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    for path in ("./org/name", "/abs/org", "~/a/b", "a/b/c", "org/na--me", "{output_dir}/base", "org/", "name"):
        assert parse_hub_id(path) is None, path
    cfg = load_config("tiny", [f"output_dir={tmp_path / 'o'}", "model.path=org/name@v1"])
    assert cfg.model.path == "org/name@v1"  # a hub id survives validation as written
    cfg = load_config("tiny", [f"output_dir={tmp_path / 'o'}", "model.path=./org/name"])
    assert cfg.model.path == str(Path("org/name").resolve())  # a path is made absolute, as before


def test_offline_cache_resolves_ids_and_revisions(hub_env, tiny_base, tmp_path):
    fill_cache(hub_env.cache, "org/tiny", two_commits(tiny_base, tmp_path))
    snapshots = hub_env.cache / "models--org--tiny" / "snapshots"
    assert resolve_model("org/tiny") == ModelSource(snapshots / TWO, "org/tiny", TWO)
    assert resolve_model("org/tiny@v1") == ModelSource(snapshots / ONE, "org/tiny", ONE)
    assert resolve_model(f"org/tiny@{ONE}").revision == ONE
    assert resolve_model(resolve_model("org/tiny")) == resolve_model("org/tiny")  # a ModelSource as it is
    for name, needle in (
        ("org/tiny@v2", "hub repo org/tiny@v2: not in the hub cache"),
        ("org/absent", "hub repo org/absent: not in the hub cache"),
        ("runs/base", "hub repo runs/base: not in the hub cache"),
    ):
        with pytest.raises(SlimtuneError, match="HF_HUB_OFFLINE is set") as e:
            resolve_model(name)
        assert needle in str(e.value) and "\n" not in str(e.value)
    bins = Repo({ONE: {"config.json": b"{}", "pytorch_model.bin": b"x"}}, {"main": ONE})
    fill_cache(hub_env.cache, "org/bins", bins)
    with pytest.raises(SlimtuneError, match="hub repo org/bins: holds no \\*.safetensors weights"):
        resolve_model("org/bins")


def test_a_local_directory_of_the_same_name_wins(hub_env, tiny_base, tmp_path, monkeypatch, caplog):
    fill_cache(hub_env.cache, "org/tiny", Repo.of_directory(tiny_base, ONE))
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_base, tmp_path / "org" / "tiny")
    with caplog.at_level("WARNING", logger="slimtune.formats.hub"):
        source = resolve_model("org/tiny")
    assert source == ModelSource(tmp_path / "org" / "tiny") and source.name == str(tmp_path / "org" / "tiny")
    local = tmp_path / "org" / "tiny"
    assert [r.getMessage() for r in caplog.records] == [f"org/tiny: the local directory {local} is used, not the hub repo of that name"]


def test_download_fetches_only_the_files_slimtune_reads(hub_env, tiny_base, tmp_path):
    decoys = {"pytorch_model.bin": b"b" * 64, "model.gguf": b"g", "original/consolidated.00.pth": b"p", "original/model.safetensors": b"s"}
    repos = {"org/tiny": Repo.of_directory(tiny_base, ONE, extra=decoys)}
    with HubServer(repos) as server:
        hub_env.offline(False)
        hub_env.point_at(server.endpoint)
        source = resolve_model("org/tiny")
        assert source.revision == ONE and source.hub_id == "org/tiny"
        assert sorted(p.name for p in source.path.iterdir()) == sorted(p.name for p in tiny_base.iterdir())
        fetched = {path.rsplit("/", 1)[-1] for method, path in server.requests if method == "GET" and "/resolve/" in path}
        assert fetched == {p.name for p in tiny_base.iterdir()}
        asked = len(server.requests)
        assert resolve_model("org/tiny") is source and len(server.requests) == asked  # once per process
    hub_env.mp.setattr(hub, "_RESOLVED", {})
    hub_env.offline(True)
    assert resolve_model("org/tiny") == source  # the cache it filled serves the offline run


@pytest.mark.parametrize(
    "name, needle",
    [
        ("org/nope", "hub repo org/nope: no such repo on the hub, or it is private"),
        ("org/gated", "hub repo org/gated: the repo is gated; accept its terms on the hub and set HF_TOKEN"),
        ("org/tiny@v9", "hub repo org/tiny@v9: the repo has no such revision"),
        ("org/bins", "hub repo org/bins: holds no *.safetensors weights at its top level"),
        ("org/offline", f"hub repo org/offline: not in the hub cache ({{cache}}) and the hub ({CLOSED}) cannot be reached"),
    ],
)
def test_hub_failures_are_one_line_exit_2_nothing_left(hub_env, tiny_base, tmp_path, capsys, name, needle):
    bins = Repo({ONE: {"config.json": b"{}", "pytorch_model.bin": b"x" * 100}}, {"main": ONE})
    gated = Repo.of_directory(tiny_base, TWO, token="s3cret")
    repos = {"org/tiny": Repo.of_directory(tiny_base, ONE), "org/gated": gated, "org/bins": bins}
    adapter, out = tmp_path / "adapter", tmp_path / "merged"
    adapter.mkdir()
    with HubServer(repos) as server:
        hub_env.offline(False)
        hub_env.point_at(CLOSED if name == "org/offline" else server.endpoint)
        code = main(["merge", "--base", name, "--adapter", str(adapter), "--out", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2
        assert err[-1].startswith(f"slimtune merge: error: {needle.format(cache=hub_env.cache)}"), err
        assert not out.exists()
        repo_dir = hub_env.cache / ("models--" + name.split("@")[0].replace("/", "--"))
        assert not (repo_dir / "snapshots").exists() and not (repo_dir / "blobs").exists()  # nothing fetched
        if name == "org/gated":  # with the token from the environment it is read
            hub_env.mp.setenv("HF_TOKEN", "s3cret")
            assert resolve_model(name).revision == TWO


def _finetune_args(out: Path, model: str) -> list[str]:
    return ["finetune", "--config", "tiny", f"output_dir={out}", f"model.path={model}", "training.max_steps=2"]
    # the tiny config's model.create_tiny stays true: it must not apply to a hub id


FAST = ["checkpoint.async=false", "logging.progress_bar=false", "dataset.max_seq_len=64"]


def test_finetune_merge_export_with_a_hub_id(hub_env, tiny_base, tmp_path, capsys):
    fill_cache(hub_env.cache, "org/tiny", two_commits(tiny_base, tmp_path))
    out, work = tmp_path / "run", tmp_path / "cwd"
    work.mkdir()
    env = {**os.environ, **hub_env.env, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": CLOSED}
    r = run_cli(*_finetune_args(out, "org/tiny@v1"), *FAST, cwd=work, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"org/tiny@v1: hub revision {ONE}" in r.stdout and "vLLM" not in r.stdout + r.stderr  # the default adapter serves
    assert not any(work.iterdir())  # nothing created at ./org/tiny
    ckpt = out / "step-000002"
    adapter_config = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "org/tiny"
    assert json.loads((ckpt / "slimtune_format.json").read_text())["base"] == {"name": "org/tiny", "revision": ONE}
    card = (ckpt / "README.md").read_text()
    assert "base_model: org/tiny\n" in card and f"| base revision | `{ONE}` (hub commit) |" in card
    assert f"torch {torch.__version__}" in card and "| software | slimtune " in card

    # merge --base and export --base take the hub id (here in this process: the same CLI entry point)
    merged = tmp_path / "merged"
    assert main(["merge", "--base", "org/tiny@v1", "--adapter", str(ckpt), "--out", str(merged), "--merge-base", "quantized"]) == 0
    manifest = json.loads((merged / "slimtune_manifest.json").read_text())
    assert (manifest["base"], manifest["base_revision"]) == ("org/tiny", ONE)
    weights = sorted(p.name for p in ckpt.glob("*.safetensors"))
    assert weights and weights == sorted(p.name for p in merged.glob("*.safetensors"))
    assert all((merged / n).read_bytes() == (ckpt / n).read_bytes() for n in weights)  # what training saved, bit for bit
    gguf = tmp_path / "m.gguf"
    assert main(["export", "--base", "org/tiny@v1", "--adapter", str(ckpt), "--out", str(gguf), "--type", "f32"]) == 0
    assert gguf.stat().st_size > 0
    capsys.readouterr()

    # the run, trained on main at ONE, resumed after main moved on to TWO: refused in one line
    ref = hub_env.cache / "models--org--tiny" / "refs" / "main"
    cfg_run = tmp_path / "run2"
    ref.write_text(ONE)
    assert main([*_finetune_args(cfg_run, "org/tiny"), *FAST, "training.stop_after_steps=1"]) == 0
    ref.write_text(TWO)
    hub_env.mp.setattr(hub, "_RESOLVED", {})
    capsys.readouterr()
    assert main([*_finetune_args(cfg_run, "org/tiny"), *FAST, "resume=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"slimtune finetune: error: cannot resume from {cfg_run / 'step-000001'}: model.path org/tiny is at commit {TWO} now, "
        f"the checkpoint was trained on {ONE} (the repo moved on); set model.path=org/tiny@{ONE} to resume"
    )


def test_the_tiny_config_never_writes_at_a_hub_id(hub_env, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    assert main([*_finetune_args(out, "org/absent"), *FAST]) == 2  # model.create_tiny is true in the tiny config
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("slimtune finetune: error: hub repo org/absent: not in the hub cache"), err
    assert not (tmp_path / "org").exists() and not out.exists()  # no ./org/absent, no output_dir


def _mutated_ids(rng, seeds: list[str], n: int) -> list[str]:
    """Hostile spellings of hub ids and paths: characters inserted, dropped or replaced (separators, dots,
    dashes, unicode, control and shell characters), revisions of every shape, and very long names."""
    alphabet = list("/@.-_~ \\\t\n\x00%$*?:") + ["..", "--", "é", "\u202e", "🙂", "a" * 120, "@main", "@" + "f" * 40, ".git", "{x}"]
    out = []
    for _ in range(n):
        text = list(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(text) + 1)
            op = rng.random()
            if op < 0.45:
                text.insert(i, rng.choice(alphabet))
            elif op < 0.7 and text:
                del text[min(i, len(text) - 1)]
            elif text:
                text[min(i, len(text) - 1)] = rng.choice(alphabet)
        out.append("".join(text))
    return out


def test_fuzzed_hub_ids_resolve_or_refuse_in_one_line(hub_env, tiny_base, tmp_path, monkeypatch):
    # the reader of hub ids (parse_hub_id + resolve_model through huggingface_hub's offline cache): 300
    # seeded hostile names; each resolves to a snapshot inside the cache (or an existing local directory)
    # or is one SlimtuneError line, and nothing is created outside the hub cache
    import random

    fill_cache(hub_env.cache, "org/tiny", two_commits(tiny_base, tmp_path))
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    seeds = ["org/tiny", "org/tiny@v1", f"org/tiny@{ONE}", "org/absent@main", "./org/tiny", "a/b/c", "org/tiny@refs/pr/1"]
    counts = {"resolved": 0, "refused": 0}
    for name in seeds + _mutated_ids(random.Random(1234), seeds, 300):
        hub._RESOLVED.clear()
        try:
            source = resolve_model(name)
        except SlimtuneError as e:
            assert "\n" not in str(e) and str(e).strip(), repr(name)
            counts["refused"] += 1
            continue
        assert source.path.is_dir(), repr(name)
        if source.hub_id is not None:
            assert hub_env.cache in source.path.parents and source.revision in (ONE, TWO), (name, source)
        counts["resolved"] += 1
    assert list(work.iterdir()) == [], "nothing may be created at a path that looks like a hub id"
    assert counts["resolved"] >= 3 and counts["refused"] >= 100, counts  # the three good seeds resolve at least


# ---------------------------------------------------------------------------------------------------
# Datasets by hub id: org/name[@revision][:split] or [:subset:split], in the hub cache's datasets--org--name

README_CONFIGS = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train.jsonl
  - split: test
    path: data/test.jsonl
- config_name: alpaca
  data_files:
  - split: train
    path: alpaca/train.jsonl
---
# A chat dataset with an Alpaca subset
"""


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def chat_dataset(token: str | None = None) -> Repo:
    """A dataset repo as the hub holds one: README configs naming two subsets (default: train and test
    splits of chat rows; alpaca: a train split), data files in subfolders."""
    chats = [
        {"messages": [{"role": "user", "content": f"Is {w} a colour?"}, {"role": "assistant", "content": f"{w}: yes."}]}
        for w in "red green blue cyan".split()
    ]
    alpaca = [{"question": f"Name {w}.", "answer": w} for w in "one two three".split()]  # mapped by dataset.columns
    files = {"README.md": README_CONFIGS.encode(), "data/train.jsonl": _jsonl(chats), "data/test.jsonl": _jsonl(chats[:2])}
    files["alpaca/train.jsonl"] = _jsonl(alpaca)
    return Repo({ONE: files}, {"main": ONE}, token)


def test_dataset_ids_are_told_from_paths():
    assert hub.parse_dataset_id("yahma/alpaca-cleaned") == ("yahma/alpaca-cleaned", None, None, "train")
    assert hub.parse_dataset_id("org/name@v1:test") == ("org/name", "v1", None, "test")
    assert hub.parse_dataset_id("org/name@refs/pr/1:default:train_sft") == ("org/name", "refs/pr/1", "default", "train_sft")
    for path in ("data/train.jsonl", "data/x.parquet", "./org/name", "/abs/org/name", "org/name:a:b:c", "org/name:", "org/name:x y"):
        assert hub.parse_dataset_id(path) is None, path
    cfg = load_config("tiny", values={"dataset.path": "org/name:test", "dataset.mix": ["data/more.jsonl"], "dataset.eval_path": "o/n"})
    assert cfg.dataset.path == "org/name:test" and cfg.dataset.eval_path == "o/n"  # kept as written
    assert Path(cfg.dataset.mix[0]).is_absolute()  # a path, resolved


def _dataset_run(out: Path, *extra: str) -> list[str]:
    return ["finetune", "--config", "tiny", f"output_dir={out}", "training.max_steps=2", *FAST, *extra]


def test_a_hub_dataset_trains_offline_and_the_checkpoint_and_card_record_it(hub_env, tmp_path, monkeypatch, capsys):
    fill_cache(hub_env.cache, "org/chat", chat_dataset(), kind="datasets")
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    out = tmp_path / "run"
    extra = ["dataset.path=org/chat", "dataset.mix=[org/chat:alpaca:train]", "dataset.eval_path=org/chat:test"]
    extra += ["dataset.columns={instruction: question, output: answer}"]  # the same column mapping as for files
    assert main(_dataset_run(out, *extra)) == 0, capsys.readouterr().err
    assert list(work.iterdir()) == []  # nothing at ./org/chat (the tiny config's dataset.create_builtin is true)
    ckpt = out / "step-000002"
    record = json.loads((ckpt / "slimtune_format.json").read_text())
    assert record["datasets"] == [
        {"name": "org/chat", "revision": ONE, "subset": None, "split": "train"},
        {"name": "org/chat", "revision": ONE, "subset": "alpaca", "split": "train"},
        {"name": "org/chat", "revision": ONE, "subset": None, "split": "test"},
    ]
    assert record["shapes"] == {"chat": 4, "alpaca": 3}
    card = (ckpt / "README.md").read_text()
    assert "\ndatasets:\n- org/chat\n" in card.split("\n---\n")[0] + "\n"  # the front matter the hub reads
    assert f"| `org/chat@{ONE}:alpaca:train` |" in card and f"| `org/chat@{ONE}:test` |" in card
    assert any("eval_loss" in m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()))

    # a local directory of the repo's name wins, with one warning line
    (work / "org" / "chat").mkdir(parents=True)
    (work / "org" / "chat" / "train.jsonl").write_bytes(_jsonl([{"text": "a local row"}] * 3))
    hub_env.mp.setattr(hub, "_RESOLVED", {})
    capsys.readouterr()
    assert main(_dataset_run(tmp_path / "run2", "dataset.path=org/chat")) == 0
    assert "org/chat: the local directory" in capsys.readouterr().err
    local = json.loads((tmp_path / "run2" / "step-000002" / "slimtune_format.json").read_text())
    assert local["shapes"] == {"text": 3} and local["datasets"] == []


@pytest.mark.parametrize(
    "name, needle",
    [
        ("org/absent", "hub dataset org/absent: not in the hub cache ({cache}) and HF_HUB_OFFLINE is set"),
        ("org/chat:validation", f"org/chat@{ONE}:validation: no split 'validation'; the dataset has test, train"),
        ("org/chat:nope:train", f"org/chat@{ONE}:nope:train: no such subset (ValueError: BuilderConfig 'nope' not found."),
        ("server org/unknown", "hub dataset org/unknown: no such repo on the hub, or it is private (set HF_TOKEN for private repos)"),
        ("server org/gated", "hub dataset org/gated: the repo is gated; accept its terms on the hub and set HF_TOKEN"),
        ("server org/chat@v9", "hub dataset org/chat@v9: the repo has no such revision"),
    ],
)
def test_hub_dataset_failures_are_one_line_exit_2_nothing_written(hub_env, tmp_path, monkeypatch, capsys, name, needle):
    fill_cache(hub_env.cache, "org/chat", chat_dataset(), kind="datasets")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    online, name = name.startswith("server "), name.removeprefix("server ")
    with HubServer({"datasets/org/chat": chat_dataset(), "datasets/org/gated": chat_dataset(token="s3cret")}) as server:
        if online:
            hub_env.offline(False)
            hub_env.point_at(server.endpoint)
        code = main(_dataset_run(out, f"dataset.path={name}"))
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err[-1].startswith(f"slimtune finetune: error: {needle.format(cache=hub_env.cache)}"), err
        assert not out.exists() and not (tmp_path / "org").exists()
        assert sorted(p.name for p in hub_env.cache.iterdir()) == ["datasets--org--chat"]  # nothing fetched for the others
        if name == "org/gated":  # with the token from the environment it is read
            hub_env.mp.setenv("HF_TOKEN", "s3cret")
            assert hub.resolve_dataset(name).revision == ONE


def test_a_hub_dataset_is_fetched_once_into_the_cache_then_read_offline(hub_env, tmp_path):
    with HubServer({"datasets/org/chat": chat_dataset()}) as server:
        hub_env.offline(False)
        hub_env.point_at(server.endpoint)
        source = hub.resolve_dataset("org/chat:alpaca:train")
        assert source.revision == ONE and hub_env.cache / "datasets--org--chat" in source.path.parents
        assert any(path.startswith("/api/datasets/org/chat") for _, path in server.requests)
    hub_env.offline(True)
    hub_env.point_at(CLOSED)
    hub_env.mp.setattr(hub, "_RESOLVED", {})
    from slimtune.data import read_dataset

    rows = [r.data for r in read_dataset(hub.resolve_dataset("org/chat:alpaca:train"))]
    assert rows[0] == {"question": "Name one.", "answer": "one"} and len(rows) == 3


def test_fuzzed_dataset_ids_resolve_or_refuse_in_one_line(hub_env, tmp_path, monkeypatch):
    # the reader of dataset ids (parse_dataset_id + resolve_dataset + read_dataset through the offline cache):
    # 300 seeded hostile names; each reads rows from the cache's snapshot or is one SlimtuneError line, and
    # nothing is created outside the hub cache
    import random

    from slimtune.data import read_dataset

    fill_cache(hub_env.cache, "org/chat", chat_dataset(), kind="datasets")
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    seeds = ["org/chat", "org/chat:test", "org/chat:alpaca:train", f"org/chat@{ONE}:test", "org/absent:train", "a/b:c:d:e"]
    counts = {"read": 0, "refused": 0}
    for name in seeds + _mutated_ids(random.Random(4321), seeds, 300):
        hub._RESOLVED.clear()
        try:
            rows = list(read_dataset(hub.resolve_dataset(name)))
        except SlimtuneError as e:
            assert "\n" not in str(e) and str(e).strip(), repr(name)
            counts["refused"] += 1
            continue
        assert rows and all(isinstance(r.data, dict) for r in rows), repr(name)
        counts["read"] += 1
    assert list(work.iterdir()) == [], "nothing may be created at a path that looks like a hub id"
    assert counts["read"] >= 4 and counts["refused"] >= 100, counts
