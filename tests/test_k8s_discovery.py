"""Endpoint discovery from the Kubernetes API, against a local aiohttp server that speaks the
API's list and watch semantics (not a real cluster): pods come, turn unready and go; roles come
from labels; an InferencePool gives the selector and target ports; a 410 Gone relists and
converges; a bookmark advances the resourceVersion a watch resumes from; and a real Router's
pool follows the pods."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
import time
from pathlib import Path

import pytest
import yaml
from aiohttp import web

from kvmesh.router.app import Router, RouterConfig, start_router
from kvmesh.router.endpoints import EndpointPool
from kvmesh.router.k8s_discovery import K8sDiscovery, K8sDiscoveryError, connect, parse_selector
from tests.helpers import free_port
from tests.test_router_proxy import Engine, exchange, post
from tests.test_router_resilience import endpoint_of

pytest.importorskip("kubernetes_asyncio")
TOKEN = "test-token"
NS = "llm"


async def until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def pod(name: str, ip: str, ready: bool = True, role: str | None = None, **extra) -> dict:
    labels = {"app": "vllm", **({"llm-d.ai/role": role} if role else {})}
    labels.update(extra.pop("labels", {}))
    return {
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels, **extra},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


class FakeApi:
    """Pods and InferencePools of one namespace. Every change gets the next resourceVersion
    and is kept in a history that watches replay from; compact() forgets history, so a watch
    from an older version gets 410 Gone (an HTTP 410, or an ERROR event if gone_as_event)."""

    def __init__(self) -> None:
        self.rv = 100
        self.pods: dict[str, dict] = {}
        self.pools: dict[str, dict] = {}
        self.history: list[tuple[int, str, dict]] = []
        self.oldest = 0  # watches from before this version are gone
        self.gone_as_event = False
        self.watchers: list[asyncio.Queue] = []
        self.lists = 0
        self.watch_versions: list[str] = []
        self.selectors: list[str] = []

    async def start(self) -> FakeApi:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        app.router.add_get(
            "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools/{name}",
            self._pool,
        )
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def close(self) -> None:
        self.drop_watches()
        await self.runner.cleanup()

    def kubeconfig(self, folder) -> str:
        path = folder / "kubeconfig"
        path.write_text(
            yaml.safe_dump({
                "apiVersion": "v1", "kind": "Config", "current-context": "test",
                "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                "users": [{"name": "u", "user": {"token": TOKEN}}],
                "contexts": [{"name": "test", "context": {"cluster": "fake", "user": "u",
                                                         "namespace": NS}}],
            })
        )  # fmt: skip
        return str(path)

    # ---- changes --------------------------------------------------------------------------
    def _emit(self, kind: str, obj: dict) -> None:
        self.rv += 1
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.history.append((self.rv, kind, obj))
        for q in self.watchers:
            q.put_nowait((kind, obj))

    def put(self, p: dict) -> None:
        kind = "MODIFIED" if p["metadata"]["name"] in self.pods else "ADDED"
        self.pods[p["metadata"]["name"]] = p
        self._emit(kind, p)

    def delete(self, name: str) -> None:
        self._emit("DELETED", self.pods.pop(name))

    def bookmark(self) -> None:
        self.rv += 1
        for q in self.watchers:
            q.put_nowait(
                ("BOOKMARK", {"kind": "Pod", "metadata": {"resourceVersion": str(self.rv)}})
            )

    def compact(self) -> None:
        self.oldest, self.history = self.rv + 1, []

    def drop_watches(self) -> None:
        for q in self.watchers:
            q.put_nowait(None)

    # ---- handlers -------------------------------------------------------------------------
    def _authorized(self, request: web.Request) -> None:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            raise web.HTTPUnauthorized()

    async def _pool(self, request: web.Request) -> web.Response:
        self._authorized(request)
        found = self.pools.get(request.match_info["name"])
        if found is None or request.match_info["ns"] != NS:
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        return web.json_response(found)

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        self._authorized(request)
        selector = dict(kv.split("=", 1) for kv in request.query["labelSelector"].split(","))
        self.selectors.append(request.query["labelSelector"])

        def selected(p: dict) -> bool:
            labels = p["metadata"].get("labels") or {}
            return all(labels.get(k) == v for k, v in selector.items())

        if request.query.get("watch") != "true":
            self.lists += 1
            items = [p for p in self.pods.values() if selected(p)]
            return web.json_response(
                {"kind": "PodList", "metadata": {"resourceVersion": str(self.rv)}, "items": items}
            )
        since = int(request.query["resourceVersion"])
        self.watch_versions.append(request.query["resourceVersion"])
        assert request.query["allowWatchBookmarks"] == "true"
        gone = since + 1 < self.oldest
        if gone and not self.gone_as_event:
            return web.json_response({"kind": "Status", "code": 410, "reason": "Gone"}, status=410)
        resp = web.StreamResponse()
        resp.content_type = "application/json"
        await resp.prepare(request)
        if gone:
            status = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
            await resp.write(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
            return resp
        queue: asyncio.Queue = asyncio.Queue()
        for rv, kind, obj in self.history:
            if rv > since:
                queue.put_nowait((kind, obj))
        self.watchers.append(queue)
        try:
            while (item := await queue.get()) is not None:
                kind, obj = item
                if kind == "BOOKMARK" or selected(obj):
                    await resp.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
        finally:
            self.watchers.remove(queue)
        return resp


@pytest.fixture
async def api():
    fake = await FakeApi().start()
    yield fake
    await fake.close()


@contextlib.asynccontextmanager
async def discovering(api: FakeApi, tmp_path, **kw):
    pool = EndpointPool([])
    kw.setdefault("selector", "app=vllm")
    found = K8sDiscovery(pool, kubeconfig=api.kubeconfig(tmp_path), **kw)
    await found.start()
    try:
        yield pool, found
    finally:
        await found.stop()


def urls(pool: EndpointPool) -> dict[str, str]:
    return {name: e.url for name, e in pool.endpoints.items()}


# ---- tests ---------------------------------------------------------------------------------


async def test_pods_come_turn_unready_and_go(api, tmp_path) -> None:
    api.put(pod("a", "10.0.0.1"))
    api.put(pod("b", "10.0.0.2", ready=False))
    api.put(pod("other", "10.0.0.9", labels={"app": "sglang"}))
    added, removed = [], []
    async with discovering(api, tmp_path, target_port=8200) as (pool, _):
        pool.on_added, pool.on_removed = added.append, removed.append
        assert urls(pool) == {"a": "http://10.0.0.1:8200"}  # the selector, ready pods only
        assert api.selectors[0] == "app=vllm"
        api.put(pod("b", "10.0.0.2"))  # turns ready
        await until(lambda: "b" in pool.endpoints)
        api.put(pod("c", "10.0.0.3"))
        await until(lambda: "c" in pool.endpoints)
        api.put(pod("a", "10.0.0.1", ready=False))
        await until(lambda: "a" not in pool.endpoints)
        terminating = pod("b", "10.0.0.2", deletionTimestamp="2026-12-06T00:00:00Z")
        api.put(terminating)
        await until(lambda: "b" not in pool.endpoints)
        api.delete("c")
        await until(lambda: not pool.endpoints)
        assert [e.name for e in added] == ["b", "c"] and sorted(removed) == ["a", "b", "c"]


async def test_roles_and_data_parallel_size_come_from_the_pod(api, tmp_path) -> None:
    api.put(pod("p", "10.0.0.1", role="prefill"))
    api.put(pod("d", "10.0.0.2", role="decode", annotations={"kvmesh.ai/data-parallel-size": "2"}))
    async with discovering(api, tmp_path, kv_events="auto") as (pool, _):
        assert pool.endpoints["p"].labels["llm-d.ai/role"] == "prefill"
        assert sorted(pool.endpoints) == ["d#dp0", "d#dp1", "p"]
        assert {pool.endpoints[n].dp_rank for n in ("d#dp0", "d#dp1")} == {0, 1}
        assert all(e.kv_events == "auto" for e in pool.endpoints.values())
        kept = pool.endpoints["p"]
        removed: list[str] = []
        pool.on_removed = removed.append
        api.put(pod("p", "10.0.0.1", role="both"))  # relabelled: kept, labels follow
        await until(lambda: pool.endpoints["p"].labels["llm-d.ai/role"] == "both")
        assert pool.endpoints["p"] is kept and not removed
        api.put(pod("d", "10.0.0.2", role="decode"))  # one rank now: the ranks are replaced
        await until(lambda: "d" in pool.endpoints)
        assert sorted(removed) == ["d#dp0", "d#dp1"]


async def test_inference_pool_gives_selector_and_target_ports(api, tmp_path) -> None:
    api.pools["qwen"] = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "qwen", "namespace": NS},
        "spec": {
            "selector": {"matchLabels": {"app": "vllm", "model": "qwen"}},
            "targetPorts": [{"number": 8000}, {"number": 8001}],
        },
    }
    api.put(pod("q", "10.0.0.1", labels={"model": "qwen"}))
    api.put(pod("q2", "10.0.0.2", labels={"model": "qwen"}, annotations={
        "llm-d.ai/active-ports": "8001"}))  # fmt: skip
    api.put(pod("v", "10.0.0.3"))  # not the pool's model
    # the namespace is the kubeconfig context's
    async with discovering(api, tmp_path, selector=None, inference_pool="qwen") as (pool, _):
        assert urls(pool) == {
            "q-rank-0": "http://10.0.0.1:8000",
            "q-rank-1": "http://10.0.0.1:8001",
            "q2-rank-1": "http://10.0.0.2:8001",
        }
        assert api.selectors[0] == "app=vllm,model=qwen"
        # the pool is read again when a watch ends: a new selector or port set relists
        api.pools["qwen"]["spec"] = {
            "selector": {"matchLabels": {"app": "vllm"}},
            "targetPorts": [{"number": 9000}],
        }
        await until(lambda: api.watchers)
        api.drop_watches()
        await until(lambda: len(pool.endpoints) == 2)
        assert urls(pool) == {"q": "http://10.0.0.1:9000", "v": "http://10.0.0.3:9000"}
        assert api.selectors[-1] == "app=vllm"  # q2's active port is no target port now
    with pytest.raises(K8sDiscoveryError, match=f"InferencePool {NS}/missing: HTTP 404"):
        async with discovering(api, tmp_path, selector=None, inference_pool="missing"):
            pass


@pytest.mark.parametrize("as_event", [False, True], ids=["http-410", "error-event-410"])
async def test_gone_relists_and_converges(api, tmp_path, as_event) -> None:
    api.gone_as_event = as_event
    for name in "abc":
        api.put(pod(name, f"10.0.0.{ord(name)}"))
    async with discovering(api, tmp_path) as (pool, found):
        kept = pool.endpoints["b"]
        assert api.lists == 1
        await until(lambda: api.watchers)
        # while the watch is down the pods change and the history is compacted away
        api.compact()
        api.drop_watches()
        api.delete("a")
        api.put(pod("c", "10.0.0.3", ready=False))
        api.put(pod("d", "10.0.0.4"))
        api.compact()
        await until(lambda: sorted(pool.endpoints) == ["b", "d"])
        assert api.lists >= 2 and pool.endpoints["b"] is kept  # unchanged pods do not churn
        await until(lambda: found.resource_version == str(api.rv))
        api.put(pod("e", "10.0.0.5"))  # and it watches again after the relist
        await until(lambda: "e" in pool.endpoints)


async def test_bookmark_advances_the_version_a_watch_resumes_from(api, tmp_path) -> None:
    api.put(pod("a", "10.0.0.1"))
    async with discovering(api, tmp_path) as (pool, found):
        await until(lambda: len(api.watchers) == 1)
        api.bookmark()
        await until(lambda: found.resource_version == str(api.rv))
        api.compact()  # the bookmark's version is still watchable; an older one is not
        api.drop_watches()
        await until(lambda: len(api.watch_versions) >= 2)
        assert api.watch_versions[-1] == str(api.rv) and api.lists == 1  # no relist needed
        api.put(pod("b", "10.0.0.2"))
        await until(lambda: "b" in pool.endpoints)


async def test_refusals_are_clear(api, tmp_path, monkeypatch) -> None:
    assert parse_selector("app=vllm, tier = gpu") == {"app": "vllm", "tier": "gpu"}
    for bad in ("app", "=x", "a==b", ""):
        with pytest.raises(ValueError):
            parse_selector(bad)
    with pytest.raises(ValueError, match="one"):
        RouterConfig(k8s_selector="app=a", k8s_inference_pool="p")
    with pytest.raises(ValueError, match="endpoints-file"):
        RouterConfig(k8s_selector="app=a", endpoints_file="x.yaml")
    api_url, api.url = api.url, f"http://127.0.0.1:{free_port()}"  # nobody there
    with pytest.raises(K8sDiscoveryError, match="Kubernetes API"):
        async with discovering(api, tmp_path):
            pass
    api.url = api_url
    with pytest.raises(K8sDiscoveryError, match="no such file"):
        await connect(str(tmp_path / "nowhere"))
    # in a pod: the service account's token, CA and namespace
    import certifi

    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("sa-token")
    (sa / "ca.crt").write_text(Path(certifi.where()).read_text())  # any CA bundle will do
    (sa / "namespace").write_text("inference\n")
    monkeypatch.setattr("kvmesh.router.k8s_discovery.SERVICE_ACCOUNT_DIR", str(sa))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    client, namespace = await connect(None)
    try:
        assert namespace == "inference" and client.configuration.host == "https://10.96.0.1:443"
        assert client.configuration.api_key["BearerToken"] == "Bearer sa-token"
    finally:
        await client.close()


async def test_router_pool_follows_the_pods(api, tmp_path, tokenizer) -> None:
    engine = await Engine().start()
    port = engine.server.sockets[0].getsockname()[1]
    api.put(pod("engine-0", "127.0.0.1", role="decode"))
    cfg = RouterConfig(
        preset="round-robin", kv_events=None, engine_model_check=False, scrape_interval=0.05,
        k8s_selector="app=vllm", k8s_target_port=port, kubeconfig=api.kubeconfig(tmp_path),
    )  # fmt: skip
    router = Router(cfg, tokenizer)
    server = await start_router(router, "127.0.0.1", 0)
    rport = server.server.sockets[0].getsockname()[1]
    body = {"model": "m", "prompt": "hello", "max_tokens": 1}
    try:
        assert list(router.pool.endpoints) == ["engine-0"]  # listed before the router is up
        assert router.pool.endpoints["engine-0"].labels["llm-d.ai/role"] == "decode"
        raw = await exchange(rport, post("/v1/completions", body))
        assert endpoint_of(raw) == "engine-0" and len(engine.requests) == 1
        assert "engine-0" in router.links
        api.put(pod("engine-0", "127.0.0.1", ready=False))
        await until(lambda: not router.pool.endpoints)
        assert "engine-0" not in router.links  # the router's own removal path ran
        api.put(pod("engine-1", "127.0.0.1"))
        await until(lambda: "engine-1" in router.pool.endpoints)
        await until(lambda: router.pool.endpoints["engine-1"].healthy)
        raw = await exchange(rport, post("/v1/completions", body))
        assert endpoint_of(raw) == "engine-1" and len(engine.requests) == 2
    finally:
        await server.cleanup()
        engine.server.close()
    assert router.discovery is not None and router.discovery._task is None  # stopped


async def test_the_command_lists_the_pool_before_ready_and_refuses_a_missing_one(
    api, tmp_path
) -> None:
    api.pools["qwen"] = {
        "metadata": {"name": "qwen"},
        "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}]},
    }
    api.put(pod("vllm-0", "127.0.0.2", role="prefill"))
    api.put(pod("vllm-1", "127.0.0.3", role="decode"))
    api.put(pod("vllm-2", "127.0.0.4", ready=False))
    cmd = [sys.executable, "-m", "kvmesh.cli", "--log-level", "WARNING", "router", "--port", "0"]
    cmd += ["--preset", "round-robin", "--kubeconfig", api.kubeconfig(tmp_path)]

    async def output(*flags: str) -> tuple[asyncio.subprocess.Process, str]:
        proc = await asyncio.create_subprocess_exec(
            *cmd, *flags, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        text = ""
        while line := (await asyncio.wait_for(proc.stdout.readline(), 60)).decode():
            text += line
            if "ready" in line:
                break
        return proc, text

    proc, text = await output("--k8s-inference-pool", "qwen")
    proc.terminate()
    await proc.wait()
    assert re.search(r"ready: .* \(2 endpoints, 0 healthy", text), text  # nobody at those IPs
    proc, text = await output("--k8s-inference-pool", "missing")
    assert await proc.wait() == 2 and f"InferencePool {NS}/missing: HTTP 404" in text, text
