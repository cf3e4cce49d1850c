"""A stand-in for the Hugging Face Hub for tests: repos laid out in a hub cache as huggingface_hub writes it
(``fill_cache``), and a local HTTP server on 127.0.0.1 that answers the endpoints ``snapshot_download`` and
``model_info`` call (``HubServer``), pointed at with HF_ENDPOINT. No network is ever used.

Endpoints served (huggingface_hub 1.x/2.x), for model repos and, under ``datasets/`` (keys
``datasets/org/name`` in ``repos``), dataset repos:

- ``GET /api/models/{repo}[/revision/{rev}]`` (``/api/datasets/...``): the repo's info (``sha``, ``siblings``);
- ``GET /api/models/{repo}/tree/{commit}`` (``/api/datasets/...``): its files (``path``, ``size``, ``oid``, ``lfs``);
- ``HEAD|GET /{repo}/resolve/{rev}/{file}`` (``/datasets/{repo}/...``): a file, with ``X-Repo-Commit`` and ``ETag``.

Errors as the hub sends them: ``X-Error-Code: RepoNotFound`` (404), ``GatedRepo`` (401 without the token),
``RevisionNotFound`` (404), ``EntryNotFound`` (404)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class Repo:
    """A model repo: ``files`` (path in the repo -> bytes) at each commit, ``refs`` (branch or tag -> commit)."""

    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    token: str | None = None  # gated: only requests with this bearer token may read it

    @classmethod
    def of_directory(cls, directory: Path, commit: str, extra: dict[str, bytes] | None = None, token: str | None = None) -> Repo:
        files = {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir()) if p.is_file()}
        files.update(extra or {})
        return cls({commit: files}, {"main": commit}, token)

    def commit_of(self, revision: str) -> str | None:
        return revision if revision in self.commits else self.refs.get(revision)


def commit_hash(text: str) -> str:
    """A 40-hex commit hash made from ``text`` (as the hub's are: sha1)."""
    return hashlib.sha1(text.encode()).hexdigest()


def fill_cache(cache: Path, repo_id: str, repo: Repo, kind: str = "models") -> Path:
    """``repo`` in the hub cache layout huggingface_hub reads: ``models--org--name/blobs/<sha256>``
    (``datasets--org--name`` with ``kind="datasets"``), ``snapshots/<commit>/<file>`` (a relative symlink to
    its blob) and ``refs/<branch>`` (the commit). Returns the repo's folder."""
    folder = Path(cache) / (f"{kind}--" + repo_id.replace("/", "--"))
    for commit, files in repo.commits.items():
        for name, data in files.items():
            blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = folder / "snapshots" / commit / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.unlink(missing_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    for ref, commit in repo.refs.items():
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return folder


class HubServer:
    """The repos in ``repos`` (id -> Repo) served on 127.0.0.1 at a free port, in a thread; ``requests``
    lists every (method, path) asked. Use as a context manager; ``endpoint`` is the HF_ENDPOINT value."""

    def __init__(self, repos: dict[str, Repo]):
        self.repos = repos
        self.requests: list[tuple[str, str]] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _handler(server: HubServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _send(self, status: int, data: bytes = b"", headers: dict | None = None, body: bool = True) -> None:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _error(self, status: int, code: str, body: bool = True) -> None:
            self._send(status, json.dumps({"error": code}).encode(), {"X-Error-Code": code, "Content-Type": "application/json"}, body)

        def _answer(self, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            server.requests.append((self.command, path))
            api = path.startswith(("/api/models/", "/api/datasets/"))
            kind = "datasets/" if path.startswith(("/api/datasets/", "/datasets/")) else ""
            prefix = f"/api/{kind or 'models/'}" if api else f"/{kind}"
            parts = path.removeprefix(prefix).split("/")
            repo_id, rest = kind + "/".join(parts[:2]), parts[2:]
            repo = server.repos.get(repo_id)
            if repo is None:
                return self._error(404 if api or not rest else 401, "RepoNotFound", body)
            if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
                return self._error(401, "GatedRepo", body)
            if api:
                return self._api(repo_id, repo, rest, body)
            if len(rest) < 3 or rest[0] != "resolve":
                return self._error(404, "EntryNotFound", body)
            commit = repo.commit_of(rest[1])
            if commit is None:
                return self._error(404, "RevisionNotFound", body)
            name = "/".join(rest[2:])
            data = repo.commits[commit].get(name)
            if data is None:
                return self._error(404, "EntryNotFound", body)
            headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"', "Content-Type": "application/octet-stream"}
            self._send(200, data, headers, body)

        def _api(self, repo_id: str, repo: Repo, rest: list[str], body: bool) -> None:
            revision = rest[1] if len(rest) >= 2 and rest[0] in ("revision", "tree") else "main"
            commit = repo.commit_of(revision)
            if commit is None:
                return self._error(404, "RevisionNotFound", body)
            files = repo.commits[commit]
            if rest and rest[0] == "tree":
                listing = [
                    {
                        "type": "file",
                        "path": name,
                        "size": len(data),
                        "oid": hashlib.sha1(data).hexdigest(),
                        "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134},
                    }
                    for name, data in files.items()
                ]
                return self._send(200, json.dumps(listing).encode(), {"Content-Type": "application/json"}, body)
            info = {"id": repo_id.removeprefix("datasets/"), "sha": commit, "private": False, "siblings": [{"rfilename": n} for n in files]}
            self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)

    return Handler
