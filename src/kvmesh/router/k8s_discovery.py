"""Endpoints discovered from the Kubernetes API: the ready pods (status.podIP set, Ready
condition True, no deletionTimestamp) of an InferencePool (inference.networking.k8s.io/v1) or of
a label selector, kept current by list + watch. A pod gives http://POD_IP:PORT per target port,
named after the pod (``<pod>-rank-<i>`` with several ports, as llm-d; ``llm-d.ai/active-ports``
narrows them), labelled with the pod's labels (``llm-d.ai/role``), split into ranks by a
``kvmesh.ai/data-parallel-size`` annotation as the endpoints file's ``data_parallel_size``.

Invariants: endpoints enter and leave the EndpointPool only as the endpoints-file reload moves
them (``EndpointPool.add`` / ``remove``), so KV-event subscriptions and the
indexes follow; only names this module added (a base name and its ``#dp<r>`` ranks) are touched;
an unchanged pod never churns (a label change is applied in place). A watch resumes from the
last resourceVersion seen (BOOKMARKs advance it); a 410 Gone (HTTP or ERROR event) relists, and
the relist's diff removes pods deleted meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from kvmesh.router.endpoints import Endpoint, EndpointPool, data_parallel_ranks

logger = logging.getLogger(__name__)
POOL_API = ("inference.networking.k8s.io", "v1", "inferencepools")
ACTIVE_PORTS = ("llm-d.ai/active-ports", "inference.networking.k8s.io/active-ports")
DP_SIZE_KEY = "kvmesh.ai/data-parallel-size"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
RETRIED = (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError)
Spec = tuple[str, tuple[tuple[str, str], ...], int]  # (url, sorted labels, data-parallel size)


class K8sDiscoveryError(Exception):
    """Discovery cannot start: no config, the API unreachable, the pool missing or forbidden."""


class _Gone(Exception):
    """The watch's resourceVersion is too old (410): only a relist recovers."""


def parse_selector(text: str) -> dict[str, str]:
    """'k=v,k2=v2' (equality only, as an InferencePool's matchLabels) -> {k: v, k2: v2}."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip() or value.startswith("="):
            raise ValueError(f"--k8s-selector: {part!r} is not key=value")
        out[key.strip()] = value.strip()
    if not out:
        raise ValueError("--k8s-selector: give at least one key=value")
    return out


@dataclass(frozen=True, slots=True)
class Target:
    """The pods to watch: their namespace, matchLabels and the engines' ports on them."""

    namespace: str
    selector: tuple[tuple[str, str], ...]
    ports: tuple[int, ...]

    @property
    def label_selector(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.selector)


def pool_target(namespace: str, pool: dict) -> Target:
    """An InferencePool's pods: spec.selector.matchLabels on spec.targetPorts[].number."""
    spec = pool.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels") or {}
    ports = tuple(int(p["number"]) for p in spec.get("targetPorts") or [] if "number" in p)
    if not labels or not ports:
        name = (pool.get("metadata") or {}).get("name")
        raise K8sDiscoveryError(f"InferencePool {namespace}/{name}: no matchLabels/targetPorts")
    return Target(namespace, tuple(sorted(labels.items())), ports)


def pod_specs(pod: dict, target: Target) -> dict[str, Spec]:
    """The endpoints a pod should have now: none unless ready and still matching."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    labels = meta.get("labels") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    ip = status.get("podIP")
    if not ready or not ip or meta.get("deletionTimestamp"):
        return {}
    if any(labels.get(k) != v for k, v in target.selector):
        return {}
    notes = {**labels, **(meta.get("annotations") or {})}
    ports = list(enumerate(target.ports))
    active = next((notes[k] for k in ACTIVE_PORTS if k in notes), None)
    if active is not None:
        wanted = {p.strip() for p in active.split(",")}
        ports = [(i, p) for i, p in ports if str(p) in wanted]
    try:
        size = max(1, int(notes.get(DP_SIZE_KEY, 1)))
    except ValueError:
        logger.warning("pod %s: %s is not an integer", meta.get("name"), DP_SIZE_KEY)
        size = 1
    host = f"[{ip}]" if ":" in ip else ip
    frozen = tuple(sorted((str(k), str(v)) for k, v in labels.items()))
    name = meta["name"]
    out: dict[str, Spec] = {}
    for i, port in ports:
        out[name if len(target.ports) == 1 else f"{name}-rank-{i}"] = (
            f"http://{host}:{port}", frozen, size,
        )  # fmt: skip
    return out


async def _check(resp: aiohttp.ClientResponse, what: str) -> None:
    if resp.status == 410:
        raise _Gone()
    if resp.status != 200:
        raise K8sDiscoveryError(f"{what}: HTTP {resp.status} {(await resp.text())[:500]}")


async def connect(kubeconfig: str | None):
    """(ApiClient, default namespace): in-cluster (service account token and CA) when no
    kubeconfig is given and KUBERNETES_SERVICE_HOST is set, else the kubeconfig's context."""
    try:
        from kubernetes_asyncio import client, config
        from kubernetes_asyncio.config.incluster_config import InClusterConfigLoader
    except ImportError as exc:
        need = "Kubernetes discovery needs kubernetes_asyncio: pip install 'kvmesh[k8s]'"
        raise K8sDiscoveryError(need) from exc
    if kubeconfig is not None and not Path(kubeconfig).is_file():
        raise K8sDiscoveryError(f"--kubeconfig {kubeconfig}: no such file")
    cfg = client.Configuration()
    try:
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            sa = Path(SERVICE_ACCOUNT_DIR)
            InClusterConfigLoader(str(sa / "token"), str(sa / "ca.crt")).load_and_set(cfg)
            ns_file = sa / "namespace"
            namespace = ns_file.read_text().strip() if ns_file.exists() else None
        else:
            await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
            _, active = config.list_kube_config_contexts(kubeconfig)
            namespace = ((active or {}).get("context") or {}).get("namespace")
        return client.ApiClient(cfg), namespace  # reads the CA here
    except (config.ConfigException, OSError, ValueError) as exc:
        raise K8sDiscoveryError(f"no Kubernetes API configuration: {exc}") from exc


class K8sDiscovery:
    """Keeps ``pool`` equal to the ready pods the target selects (see the module's invariants).
    ``start`` lists once (raising K8sDiscoveryError when it cannot), then a task watches."""

    def __init__(
        self,
        pool: EndpointPool,
        *,
        inference_pool: str | None = None,
        selector: str | None = None,
        target_port: int = 8000,
        namespace: str | None = None,
        kubeconfig: str | None = None,
        kv_events: str | None = None,
        watch_timeout: int = 60,
    ) -> None:
        self.pool, self.inference_pool, self.kv_events = pool, inference_pool, kv_events
        self.selector = parse_selector(selector) if selector else None
        self.target_port, self.namespace, self.kubeconfig = target_port, namespace, kubeconfig
        self.watch_timeout = watch_timeout  # seconds a watch lasts; the pool is re-read after
        self.target: Target | None = None
        self.resource_version: str | None = None  # None: the next step is a relist
        self.specs: dict[str, Spec] = {}  # base endpoint name -> what it was added as
        self.by_pod: dict[str, set[str]] = {}  # pod -> its base endpoint names
        self._api = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._api, default_ns = await connect(self.kubeconfig)
        self.namespace = self.namespace or default_ns or "default"
        try:
            self.target = await self._resolve()
            await self._relist()
        except K8sDiscoveryError:
            await self.stop()
            raise
        except RETRIED as exc:
            host = self._api.configuration.host
            await self.stop()
            raise K8sDiscoveryError(f"Kubernetes API at {host}: {exc!r}") from exc
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._api is not None:
            await self._api.close()
            self._api = None

    async def _get(self, path: str, **query) -> aiohttp.ClientResponse:
        """GET an API path (the client adds host and credentials); the caller releases it."""
        timeout = aiohttp.ClientTimeout(sock_connect=10, sock_read=self.watch_timeout + 30)
        return await self._api.call_api(
            path, "GET", query_params=[(k, v) for k, v in query.items() if v is not None],
            auth_settings=["BearerToken"], _preload_content=False, _request_timeout=timeout,
        )  # fmt: skip

    async def _get_json(self, path: str, what: str, **query) -> dict:
        resp = await self._get(path, **query)
        try:
            await _check(resp, what)
            return json.loads(await resp.read())
        finally:
            resp.release()

    async def _resolve(self) -> Target:
        if self.inference_pool is None:
            return Target(self.namespace, tuple(sorted(self.selector.items())), (self.target_port,))
        group, version, plural = POOL_API
        path = f"/apis/{group}/{version}/namespaces/{self.namespace}/{plural}/{self.inference_pool}"
        what = f"InferencePool {self.namespace}/{self.inference_pool}"
        return pool_target(self.namespace, await self._get_json(path, what))

    @property
    def _pods_path(self) -> str:
        return f"/api/v1/namespaces/{self.target.namespace}/pods"

    async def _relist(self) -> None:
        selector = self.target.label_selector
        data = await self._get_json(self._pods_path, "list pods", labelSelector=selector)
        pods = {p["metadata"]["name"]: p for p in data.get("items") or []}
        for name in list(self.by_pod):
            if name not in pods:
                self._apply(name, {})
        for name, pod in pods.items():
            self._apply(name, pod_specs(pod, self.target))
        self.resource_version = (data.get("metadata") or {}).get("resourceVersion")
        logger.info("kubernetes: %d pods, endpoints: %s", len(pods), ", ".join(self.specs))

    async def _watch(self) -> None:
        """One watch from resource_version until the server ends it; raises _Gone on 410."""
        resp = await self._get(
            self._pods_path, labelSelector=self.target.label_selector, watch="true",
            resourceVersion=self.resource_version, allowWatchBookmarks="true",
            timeoutSeconds=str(self.watch_timeout),
        )  # fmt: skip
        try:
            await _check(resp, "watch pods")
            while line := await resp.content.readline():
                if line.strip():
                    self._event(json.loads(line))
        finally:
            resp.release()

    def _event(self, event: dict) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Gone()
            raise K8sDiscoveryError(f"watch pods: {obj.get('message') or obj}")
        meta = obj.get("metadata") or {}
        if kind in ("ADDED", "MODIFIED"):
            self._apply(meta["name"], pod_specs(obj, self.target))
        elif kind == "DELETED":
            self._apply(meta["name"], {})
        self.resource_version = meta.get("resourceVersion") or self.resource_version

    async def _run(self) -> None:
        """Watch, resume, relist on 410 or a changed pool; back off on errors (at most 30 s)."""
        delay = 0.0
        while True:
            try:
                if self.resource_version is None:
                    await self._relist()
                await self._watch()
                target = await self._resolve()
                if target != self.target:
                    logger.info("kubernetes: target now %s: relisting", target)
                    self.target, self.resource_version = target, None
                delay = 0.0
            except _Gone:
                logger.info("kubernetes: resourceVersion %s gone: relisting", self.resource_version)
                self.resource_version = None
            except (K8sDiscoveryError, *RETRIED) as exc:
                delay = min(30.0, max(0.25, delay * 2))
                logger.warning("kubernetes discovery: %s; again in %.3g s", exc, delay)
                await asyncio.sleep(delay)

    def _apply(self, pod: str, wanted: dict[str, Spec]) -> None:
        """Moves the pool from what the pod had to ``wanted``, touching only what changed."""
        for base in self.by_pod.get(pod, set()) - wanted.keys():
            self._remove(base)
        for base, spec in wanted.items():
            old = self.specs.get(base)
            if old == spec:
                continue
            if old is not None and (old[0], old[2]) == (spec[0], spec[2]):
                for e in self._named(base):  # labels only: keep its indexes and feeds
                    e.labels = dict(spec[1])
                self.specs[base] = spec
                continue
            if old is not None:
                self._remove(base)
            self._add(base, spec)
        if wanted:
            self.by_pod[pod] = set(wanted)
        else:
            self.by_pod.pop(pod, None)

    def _named(self, base: str) -> list[Endpoint]:
        return [
            e for n, e in self.pool.endpoints.items() if n == base or n.startswith(base + "#dp")
        ]

    def _add(self, base: str, spec: Spec) -> None:
        url, labels, size = spec
        self.specs[base] = spec
        endpoint = Endpoint(url, base, dict(labels), kv_events=self.kv_events)
        for e in data_parallel_ranks(endpoint, size):
            self.pool.add(e)
        logger.info("kubernetes: endpoint %s (%s) added", base, url)

    def _remove(self, base: str) -> None:
        self.specs.pop(base, None)
        for e in self._named(base):
            self.pool.remove(e.name)
        logger.info("kubernetes: endpoint %s removed", base)
