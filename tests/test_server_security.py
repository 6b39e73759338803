"""Security of the HTTP surface: loopback by default, the API key on every route but /health, size limits, and no
request field that can make the server read or write a file (messages and template kwargs are data, never template
source; a per-request chat template is refused). File access is watched with a Python audit hook.
"""
from __future__ import annotations

import inspect
import secrets
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import pytest

from tests.fake_engine import FakeEngine, LiveServer, tiny_plan
from xserv_aot.serve import build_engine
from xserv_aot.server import create_app, run_server, server_config

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
ROUTES = {("POST", CHAT), ("POST", COMP), ("GET", "/v1/models"), ("GET", "/v1/models/{name:path}"),
          ("GET", "/health"), ("GET", "/version"), ("GET", "/metrics"), ("GET", "/openapi.json"),
          ("POST", "/tokenize"), ("POST", "/detokenize")}


def test_loopback_by_default():
    from xserv_aot.cli import serve
    assert inspect.signature(serve).parameters["host"].default.default == "127.0.0.1"
    assert inspect.signature(run_server).parameters["host"].default == "127.0.0.1"
    assert server_config(create_app(FakeEngine(), model_name="m")).host == "127.0.0.1"


def _routes(app) -> set:
    return {(m, r.path) for r in app.routes for m in r.methods if m != "HEAD"}


def test_api_key_guards_every_route_but_health():
    eng, key = FakeEngine(), "k-" + secrets.token_hex(8)
    app = create_app(eng, model_name="m", api_key=key)
    assert _routes(app) == ROUTES                      # a new route must be added here (and so be tested)
    calls = {("POST", CHAT): {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
             ("POST", COMP): {"prompt": "hi", "max_tokens": 2}, ("POST", "/tokenize"): {"prompt": "hi"},
             ("POST", "/detokenize"): {"tokens": [70]}}
    paths = {"/v1/models/{name:path}": "/v1/models/m"}
    with LiveServer(app) as url, httpx.Client(base_url=url, timeout=20) as client:
        def call(method, path, headers):
            return client.request(method, paths.get(path, path), json=calls.get((method, path)), headers=headers)
        for method, path in sorted(ROUTES) + [("GET", "/no/such/route"), ("POST", "/v1/models")]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key},
                            {"Authorization": f"Basic {key}"}, {"Authorization": f"Bearer {key.upper()}"},
                            {"X-Api-Key": key}):
                r = call(method, path, headers)
                if path == "/health":
                    assert r.status_code == 200
                else:
                    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (method, path)
            r = call(method, path, {"Authorization": f"Bearer {key}"})
            assert r.status_code != 401 and r.status_code < 500, (method, path, r.status_code)
        assert len(eng.requests) == 2                    # only the two authorized generations reached the engine
        doc = client.get("/openapi.json", headers={"Authorization": f"Bearer {key}"}).json()
        assert doc["security"] == [{"bearer": []}] and doc["paths"]["/health"]["get"]["security"] == []


def test_header_limits_and_server_survives():
    with LiveServer(create_app(FakeEngine(), model_name="m")) as url:
        many = {f"x-h{i}": "v" * 200 for i in range(100)}                 # 20 KB in small headers
        for headers in ({"x-big": "a" * 40_000}, many):
            r = httpx.get(url + "/version", headers=headers, timeout=20)
            assert r.status_code in (400, 431)
        assert httpx.get(url + "/version", timeout=20).status_code == 200


class FileWatch:
    """Records file and process events (Python audit hook) that touch `watched` paths, while armed."""
    EVENTS = ("open", "os.listdir", "os.scandir", "os.remove", "os.rename", "os.mkdir", "os.symlink", "os.link",
              "os.truncate", "os.chmod", "shutil.copyfile", "shutil.rmtree")
    PROCESS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "pty.spawn")

    def __init__(self, *watched: str):
        self.watched, self.hits, self.armed = watched, [], False
        sys.addaudithook(self._hook)                    # audit hooks cannot be removed; disarmed it is a no-op

    def _hook(self, event, args):
        if not self.armed:
            return
        if event in self.PROCESS:
            self.hits.append((event, args[:1], threading.current_thread().name))
        elif event in self.EVENTS and any(w in str(a) for a in args[:2] for w in self.watched):
            self.hits.append((event, args[:2]))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The real engine (tiny Qwen3 + its real chat template), wrapped to record the prompt ids it is given."""
    ae = build_engine(tiny_plan(tmp_path_factory), backend="cpu", model_name="tiny")

    class Recording:
        def __init__(self):
            self.prompts = []

        def __getattr__(self, name):
            return getattr(ae, name)

        def generate(self, rid, ids, params):
            self.prompts.append(list(ids))
            return ae.generate(rid, ids, params)
    rec = Recording()
    with LiveServer(create_app(rec, model_name="tiny", manage_engine=True)) as url:
        yield rec, url


@pytest.fixture
def short_tmp():
    """A temp dir with a short path, so hostile prompts naming files in it fit the tiny model's context."""
    d = tempfile.mkdtemp(prefix="x")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def test_no_request_field_reads_or_writes_files(recorded, short_tmp):
    rec, url = recorded
    tok, tmp_path = rec.tokenizer, short_tmp
    secret = tmp_path / "secret.txt"
    marker = "TOPSECRET-" + secrets.token_hex(6)
    secret.write_text(marker)
    pwned = tmp_path / "pwned"
    attacks = [f"{{% include '{secret}' %}}", f"{{% import '{secret}' as s %}}{{{{ s }}}}",
               f"{{% extends '{secret}' %}}", "{{ 7*7 }}{{ ''.__class__.__mro__[1].__subclasses__() }}",
               f"{{{{ cycler.__init__.__globals__.os.popen('touch {pwned}').read() }}}}",
               f"{{{{ lipsum.__globals__['os'].system('cat {secret} > {pwned}') }}}}", str(secret), f"file://{secret}"]
    watch = FileWatch(str(tmp_path), "/etc/passwd")
    watch.armed = True                                                   # the watch itself sees a read
    assert secret.read_text() == marker
    watch.armed = False
    assert watch.hits and watch.hits[0][0] == "open"
    watch.hits.clear()
    bodies = []
    for a in attacks:
        messages = [{"role": "user", "content": a, "name": a},
                    {"role": "assistant", "content": "ok", "reasoning_content": a,
                     "tool_calls": [{"function": {"name": a, "arguments": {"path": a}}}]},
                    {"role": "user", "content": [{"type": "text", "text": a}]}]
        bodies += [(CHAT, {"messages": messages, "max_tokens": 2, "stop": [a[:20]],
                           "chat_template_kwargs": {"enable_thinking": a, "template": a, "path": str(secret),
                                                    "include": a}}),
                   (COMP, {"prompt": a, "max_tokens": 2, "stop": [a[:20]]}),
                   (CHAT, {"messages": messages[:2], "max_tokens": 2, "chat_template": a}),
                   (CHAT, {"messages": messages[:2], "max_tokens": 2, "chat_template_kwargs": {"chat_template": a}}),
                   (COMP, {"prompt": "hi", "max_tokens": 2, "model": str(secret)})]
    watch.armed = True
    try:
        replies = [httpx.post(url + path, json=body, timeout=30) for path, body in bodies]
    finally:
        watch.armed = False
    assert watch.hits == []
    assert not pwned.exists()
    for (path, body), r in zip(bodies, replies):
        assert marker not in r.text and "root:" not in r.text
        if "chat_template" in body or "chat_template" in body.get("chat_template_kwargs", {}):
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] in ("chat_template", "chat_template_kwargs"), r.text
        elif "model" in body:
            assert r.status_code == 404
        else:
            assert r.status_code == 200, r.text
    prompts = [tok.decode(p, skip_special_tokens=False).replace(str(tmp_path), "") for p in rec.prompts]
    assert not any(marker in p or "root:" in p or "49" in p for p in prompts)
    a, body = attacks[0], bodies[0][1]                                  # the hostile text reached the model as text
    assert prompts[0].count(a.replace(str(tmp_path), "")) >= 3, prompts[0][:400]
    want = tok.encode_chat([{**m, "content": a if m["role"] == "user" else "ok"} for m in body["messages"]],
                           add_generation_prompt=True, **body["chat_template_kwargs"])
    assert rec.prompts[0] == list(want)
