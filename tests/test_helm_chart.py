"""The Helm chart (deploy/helm/kvmesh) and the Dockerfile.

The chart is rendered by Helm's own engine (helm-python-sdk: Helm v4's Go SDK behind a C ABI,
no cluster, no network) for several values sets; every manifest is checked against the
Kubernetes JSON schemas (kubernetes-validate, strict: unknown fields fail) or, for the CRD kinds
(InferencePool, Gateway, HTTPRoute, ServiceMonitor, PodMonitor), against the schemas in
tests/helm_crd_schemas.py, written from the published CRDs (the InferencePool's as the CRD
release the values declare has it). The engine and router command lines are parsed by kvmesh's
own CLI parser, so a flag the chart writes that kvmesh does not take fails here."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.helm_crd_schemas import CRD_SCHEMAS, check_crd_rules, inference_pool_schema

helm = pytest.importorskip("helm_python", reason="needs helm-python-sdk (the test extra)")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="needs kubernetes-validate (the test extra)"
)
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "kvmesh"
K8S_VERSION = "1.33.0"  # Kubernetes schemas (kubernetes-validate ships 1.x releases)
NAMESPACE = "llm"
RELEASE = "demo"

VALUE_SETS: dict[str, dict] = {
    "defaults": {},
    "vllm": {"modelServer": {"type": "vllm", "gpus": 1}},
    "pd": {"pd": {"enabled": True, "prefill": {"replicas": 2}, "decode": {"replicas": 3}}},
    "host-tier": {
        "modelServer": {"hostTier": {"enabled": True, "sizeGiB": 8, "disk": {"enabled": True}}}
    },
    "dp2": {"modelServer": {"dataParallel": {"size": 2, "expertParallel": True}}},
    "vllm-pd-tier-dp2": {
        "modelServer": {
            "type": "vllm",
            "gpus": 2,
            "hostTier": {"enabled": True, "sizeGiB": 100},
            "dataParallel": {"size": 2, "expertParallel": True},
        },
        "pd": {"enabled": True},
        "auth": {"existingSecret": "kvmesh-keys", "useApiKey": True},
    },
    "hardened": {
        "router": {"replicas": 3, "podAntiAffinity": "hard"},
        "inferencePool": {"crdVersion": "v1.4.0", "appProtocol": "kubernetes.io/h2c"},
        "networkPolicy": {"enabled": True},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    },
    "scheduler-config": {
        "router": {
            "replicas": 2,
            "schedulerConfig": "plugins: [{type: queue-scorer}]\n"
            "schedulingProfiles: [{name: default, plugins: [{pluginRef: queue-scorer}]}]\n",
        },
        "gateway": {"create": False},
        "httpRoute": {"parentRefs": [{"name": "shared-gateway", "namespace": "infra"}]},
    },
}

# --- rendering --------------------------------------------------------------------------------
_RENDERED: dict[str, list[dict]] = {}


def render(name: str) -> list[dict]:
    """The manifests of one values set, rendered by Helm (cached: each set renders once)."""
    if name not in _RENDERED:
        _RENDERED[name] = render_values(VALUE_SETS[name])
    return _RENDERED[name]


def render_values(values: dict) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    docs = []
    for path, text in sorted(files.items()):
        if path.endswith(".txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, (kind, name, [d["metadata"]["name"] for d in found])
    return found[0]


def model_servers(docs: list[dict]) -> list[dict]:
    return [
        d
        for d in docs
        if d["kind"] == "Deployment"
        and d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
        == "model-server"
    ]


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def expand_env(args: list[str], pod_ip: str = "10.1.2.3") -> list[str]:
    """The args as the kubelet passes them: $(POD_IP) expanded."""
    return [a.replace("$(POD_IP)", pod_ip) for a in args]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def validate_manifests(docs: list[dict], crd_version: str | None = None) -> None:
    """Every rendered manifest against its schema: the InferencePool against the CRD release
    the values declare (v1.0.0 unless said), other CRDs' objects against theirs, the rest
    against Kubernetes' own at K8S_VERSION."""
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if doc["kind"] == "InferencePool":
            jsonschema.validate(doc, inference_pool_schema(crd_version or "v1.0.0"))
            check_crd_rules(doc)
        elif key in CRD_SCHEMAS:
            jsonschema.validate(doc, CRD_SCHEMAS[key])
            check_crd_rules(doc)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


# --- the checks -------------------------------------------------------------------------------
@pytest.mark.parametrize("values", VALUE_SETS)
def test_every_manifest_is_valid(values):
    docs = render(values)
    kinds = sorted({d["kind"] for d in docs})
    assert {"Deployment", "Service", "Role", "RoleBinding", "InferencePool"} <= set(kinds)
    validate_manifests(docs, VALUE_SETS[values].get("inferencePool", {}).get("crdVersion"))
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), names


@pytest.mark.parametrize("values", VALUE_SETS)
def test_helm_lint_finds_nothing(values):
    report = helm.lint(CHART, VALUE_SETS[values], strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("values", VALUE_SETS)
def test_pool_picker_route_and_rbac_fit_together(values):
    docs = render(values)
    pool = one(docs, "InferencePool")
    servers = model_servers(docs)
    assert servers
    for d in servers:  # the pool selects every model server pod, and their port
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ports = {p["name"]: p["containerPort"] for p in container(d)["ports"]}
        assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ports["http"]]
        assert labels["llm-d.ai/role"] in ("prefill", "decode", "both")
    router = one(docs, "Deployment", f"{RELEASE}-kvmesh-router")
    router_pod = router["spec"]["template"]
    assert not (
        pool["spec"]["selector"]["matchLabels"].items() <= router_pod["metadata"]["labels"].items()
    )

    picker = pool["spec"]["endpointPickerRef"]  # names the router's Service and ext_proc port
    service = one(docs, "Service", picker["name"])
    assert picker["kind"] == "Service" and picker["group"] == ""
    ext = next(p for p in service["spec"]["ports"] if p["port"] == picker["port"]["number"])
    assert service["spec"]["selector"].items() <= router_pod["metadata"]["labels"].items()
    router_ports = {p["name"]: p["containerPort"] for p in container(router)["ports"]}
    assert router_ports[ext["targetPort"]] == picker["port"]["number"] == 9002
    args = container(router)["args"]
    assert flag(args, "--ext-proc-port") == "9002"
    assert flag(args, "--k8s-inference-pool") == pool["metadata"]["name"]
    assert flag(args, "--k8s-namespace") == NAMESPACE

    route = one(docs, "HTTPRoute")
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert backend == {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": pool["metadata"]["name"],
    }
    gateways = [d for d in docs if d["kind"] == "Gateway"]
    for parent in route["spec"]["parentRefs"]:
        if gateways:
            (gw,) = gateways
            assert parent["name"] == gw["metadata"]["name"]
            assert parent["sectionName"] in [li["name"] for li in gw["spec"]["listeners"]]
        else:
            assert parent == {"name": "shared-gateway", "namespace": "infra"}

    role = one(docs, "Role")
    rules = {
        (g, r): set(rule["verbs"])
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    assert rules == {
        ("", "pods"): {"get", "list", "watch"},
        ("inference.networking.k8s.io", "inferencepools"): {"get", "list", "watch"},
    }
    binding = one(docs, "RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    (subject,) = binding["subjects"]
    account = one(docs, "ServiceAccount")
    assert (
        subject["name"] == account["metadata"]["name"] == router_pod["spec"]["serviceAccountName"]
    )
    assert subject["namespace"] == NAMESPACE


@pytest.mark.parametrize("values", VALUE_SETS)
def test_router_probes_metrics_and_replicas(values):
    docs = render(values)
    router = one(docs, "Deployment", f"{RELEASE}-kvmesh-router")
    assert router["spec"]["replicas"] == VALUE_SETS[values].get("router", {}).get("replicas", 1)
    c = container(router)
    # ready while some engine is in rotation (/health), alive while it answers at all
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "http"}
    notes = router["spec"]["template"]["metadata"]["annotations"]
    http = next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
    assert notes["prometheus.io/scrape"] == "true"
    assert notes["prometheus.io/port"] == str(http) and notes["prometheus.io/path"] == "/metrics"
    assert c["image"] == "kvmesh:0.1.0" and c["args"][0] == "router"


def _parse_router(args: list[str]):
    """The router's args through `kvmesh router`'s parser and its config check."""
    from kvmesh.cli import build_parser
    from kvmesh.commands.router import router_config_from

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        ns, unknown = build_parser().parse_known_args(args)
    assert unknown == [], unknown
    assert "deprecated" not in err.getvalue(), err.getvalue()  # the chart uses today's names
    return router_config_from(ns, [])


def _parse_engine(args: list[str]):
    from kvmesh.cli import build_parser
    from kvmesh.commands.serve import _engine_config

    ns = build_parser().parse_args(args)
    return _engine_config(ns)


@pytest.mark.parametrize("values", VALUE_SETS)
def test_router_command_line_is_kvmeshs(values):
    docs = render(values)
    router = one(docs, "Deployment", f"{RELEASE}-kvmesh-router")
    config = _parse_router(expand_env(container(router)["args"]))
    assert config.block_size == 16 and config.served_model_name == "SmolLM2-135M-Instruct"
    if VALUE_SETS[values].get("router", {}).get("schedulerConfig"):
        assert config.scheduler_config == "/etc/kvmesh/scheduler.yaml"
        cm = one(docs, "ConfigMap")
        assert yaml.safe_load(cm["data"]["scheduler.yaml"])["plugins"] == [{"type": "queue-scorer"}]
    else:
        pd = VALUE_SETS[values].get("pd", {}).get("enabled", False)
        assert config.preset == ("pd" if pd else "kvmesh")
    ms = VALUE_SETS[values].get("modelServer", {})
    assert config.kv_events == ("tcp://*:5557" if ms.get("type") == "vllm" else "auto")
    env = {e["name"]: e for e in container(router)["env"]}
    assert env["PYTHONHASHSEED"]["value"] == "0"


def test_router_tokenizer_and_no_kv_events_take_the_routers_flag_names():
    values = {"router": {"tokenizer": "/m"}, "modelServer": {"kvEvents": {"enabled": False}}}
    router = one(render_values(values), "Deployment", f"{RELEASE}-kvmesh-router")
    args = expand_env(container(router)["args"])
    assert "--model" in args and "--kv-events-config" in args
    config = _parse_router(args)
    assert config.tokenizer == "/m" and config.kv_events is None


@pytest.mark.parametrize("values", [v for v in VALUE_SETS if "vllm" not in v])
def test_kvmesh_engines_command_line(values):
    docs = render(values)
    ms = VALUE_SETS[values].get("modelServer", {})
    for d in model_servers(docs):
        c = container(d)
        assert c["image"] == "kvmesh:0.1.0" and c["args"][0] == "serve"
        config = _parse_engine(expand_env(c["args"]))
        assert config.block_size == 16 and config.served_model_name == "SmolLM2-135M-Instruct"
        events = json.loads(config.kv_events_config)
        assert events["endpoint"] == "tcp://*:5557" and events["replay_endpoint"] == "tcp://*:5657"
        assert events["topic"] == "kv@10.1.2.3:8000@SmolLM2-135M-Instruct"
        tier = ms.get("hostTier", {})
        assert config.kv_offloading_size == (8.0 if tier.get("enabled") else None)
        if tier.get("disk", {}).get("enabled"):
            assert config.kv_offloading_disk_path == "/var/tmp/kvmesh"
            mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
            assert mounts["kv-disk-tier"] == "/var/tmp/kvmesh"
        dp = ms.get("dataParallel", {})
        assert config.data_parallel_size == dp.get("size", 1)
        assert config.enable_expert_parallel == dp.get("expertParallel", False)
        if dp.get("size", 1) > 1:
            notes = d["spec"]["template"]["metadata"]["annotations"]
            assert notes["kvmesh.ai/data-parallel-size"] == "2"
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert ports["kv-events-1"] == 5558 and ports["kv-replay-1"] == 5658
        role = d["spec"]["template"]["metadata"]["labels"]["llm-d.ai/role"]
        if role == "both":
            assert config.kv_transfer_config is None
        else:
            assert json.loads(config.kv_transfer_config) == {
                "kv_connector": "NixlConnector",
                "kv_role": "kv_both",
            }
        env = {e["name"]: e for e in c["env"]}
        assert env["PYTHONHASHSEED"]["value"] == "0"
        key_ref = env["KVMESH_KV_TRANSFER_API_KEY"]["valueFrom"]["secretKeyRef"]
        secret = one(docs, "Secret", key_ref["name"])
        assert len(base64.b64decode(secret["data"][key_ref["key"]])) == 48
        assert d["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize("values", ["vllm", "vllm-pd-tier-dp2"])
def test_vllm_pods_command_line(values):
    docs = render(values)
    ms = VALUE_SETS[values]["modelServer"]
    for d in model_servers(docs):
        c = container(d)
        assert c["command"] == ["vllm", "serve"] and c["image"] == "vllm/vllm-openai:v0.32.0"
        args = expand_env(c["args"])
        assert args[0] == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert "--enable-prefix-caching" in args
        assert flag(args, "--served-model-name") == "SmolLM2-135M-Instruct"
        # vLLM's KVEventsConfig fields (reference/vllm.md §1); the PUB socket binds (wildcard)
        events = json.loads(flag(args, "--kv-events-config"))
        assert set(events) <= {
            "enable_kv_cache_events",
            "publisher",
            "endpoint",
            "replay_endpoint",
            "buffer_steps",
            "hwm",
            "max_queue_size",
            "topic",
        }
        assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
        assert events["endpoint"] == "tcp://*:5557"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == ms["gpus"]
        env = {e["name"]: e for e in c["env"]}
        assert env["PYTHONHASHSEED"]["value"] == "0"
        # the image runs as root; the chart runs it as a user, HOME and vLLM's caches writable
        pod_security = d["spec"]["template"]["spec"]["securityContext"]
        assert pod_security["runAsNonRoot"] is True and pod_security["runAsUser"] != 0
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert env["HOME"]["value"] in mounts
        assert env["VLLM_CACHE_ROOT"]["value"].startswith(env["HOME"]["value"] + "/")
        if not VALUE_SETS[values].get("pd", {}).get("enabled"):
            assert "--kv-transfer-config" not in args
            continue
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["value"] == "$(POD_IP)"
        assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {
            "name": "kvmesh-keys",
            "key": "api-key",
        }
        transfer = json.loads(flag(args, "--kv-transfer-config"))
        assert transfer["kv_connector"] == "MultiConnector"
        nixl, offload = transfer["kv_connector_extra_config"]["connectors"]
        assert nixl == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        assert offload["kv_connector"] == "OffloadingConnector"
        assert offload["kv_connector_extra_config"] == {"cpu_bytes_to_use": 100 * 2**30}
        assert flag(args, "--data-parallel-size") == "2" and "--enable-expert-parallel" in args
        notes = d["spec"]["template"]["metadata"]["annotations"]
        assert notes["kvmesh.ai/data-parallel-size"] == "2"
    # the chart makes no Secret for vLLM pods
    assert [d for d in docs if d["kind"] == "Secret"] == []


def test_vllm_host_tier_alone_is_an_offloading_connector():
    with helm.Chart.load(CHART) as chart:
        files = chart.render(
            {"modelServer": {"type": "vllm", "hostTier": {"enabled": True, "sizeGiB": 0.5}}},
            name=RELEASE,
            namespace=NAMESPACE,
        )
    (d,) = model_servers(
        list(yaml.safe_load_all(files["kvmesh/templates/modelserver-deployments.yaml"]))
    )
    transfer = json.loads(flag(container(d)["args"], "--kv-transfer-config"))
    assert transfer == {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 2**29},
    }


def test_pd_makes_one_deployment_per_role():
    docs = render("pd")
    by_role = {
        d["spec"]["template"]["metadata"]["labels"]["llm-d.ai/role"]: d for d in model_servers(docs)
    }
    assert set(by_role) == {"prefill", "decode"}
    assert (
        by_role["prefill"]["spec"]["replicas"] == 2 and by_role["decode"]["spec"]["replicas"] == 3
    )
    for role, d in by_role.items():  # a Deployment's selector takes only its own role's pods
        assert d["spec"]["selector"]["matchLabels"]["llm-d.ai/role"] == role
        assert d["metadata"]["name"] == f"{RELEASE}-kvmesh-{role}"
    (engine,) = model_servers(render("defaults"))
    assert engine["spec"]["template"]["metadata"]["labels"]["llm-d.ai/role"] == "both"
    assert engine["spec"]["replicas"] == 2


@pytest.mark.parametrize(
    "values, message",
    [
        ({"modelServer": {"type": "sglang"}}, "modelServer.type must be kvmesh or vllm"),
        ({"auth": {"useApiKey": True}}, "auth.useApiKey needs auth.existingSecret"),
        ({"gateway": {"create": False}}, "httpRoute.parentRefs"),
    ],
)
def test_bad_values_fail_with_a_message(values, message):
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError, match=re.escape(message)):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_chart_and_values_files():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["apiVersion"] == "v2" and chart["name"] == "kvmesh"
    assert chart["appVersion"] == project["version"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["router"]["extProcPort"] == 9002
    assert values["modelServer"]["type"] in ("kvmesh", "vllm")


# --- the Dockerfile ---------------------------------------------------------------------------
def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _dockerignored(path: str) -> bool:
    """Whether .dockerignore drops `path` (its patterns as written here: names, ** globs and
    `!` exceptions, the last pattern that matches deciding, as Docker reads them)."""
    import fnmatch

    parts = Path(path).parts
    ignored = False
    for pattern in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = pattern.strip()
        if not pattern or pattern.startswith("#"):
            continue
        keep = pattern.startswith("!")
        pattern = pattern.removeprefix("!").removeprefix("**/")
        for i in range(len(parts)):
            if fnmatch.fnmatch("/".join(parts[: i + 1]), pattern) or fnmatch.fnmatch(
                parts[i], pattern
            ):
                ignored = not keep
                break
    return ignored


def test_dockerfile_builds_the_cpu_image_from_what_is_here():
    steps = _dockerfile()
    # the base image a build argument (pinned by digest where the registry is read)
    assert steps[0] == ("ARG", "PYTHON_IMAGE=python:3.11-slim")
    assert steps[1] == ("FROM", "${PYTHON_IMAGE}")
    runs = " && ".join(arg for word, arg in steps if word == "RUN")
    # the locked dependencies (torch's CPU build among them: tests/test_image_lock.py) come
    # before the project, which is then built offline with nothing more to fetch
    locked = "--extra-index-url https://download.pytorch.org/whl/cpu -r /tmp/lock/requirements.lock"
    assert locked in runs
    project = "pip install --no-deps --no-build-isolation --no-index . "
    assert runs.index(locked) < runs.index(project)
    copies = [shlex.split(arg) for word, arg in steps if word == "COPY"]
    sources = [s for c in copies for s in c[:-1] if not s.startswith("--")]
    assert {"pyproject.toml", "README.md", "src"} <= set(sources)
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not _dockerignored(source), f"{source} is in .dockerignore"
    assert _dockerignored(".venv") and _dockerignored("src/kvmesh/__pycache__")
    users = [arg for word, arg in steps if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert ("ENTRYPOINT", '["kvmesh"]') in steps
    assert steps[-1] == ("CMD", '["up", "--host", "0.0.0.0"]')
    # the chart runs the image as the same non-root user
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == int(users[-1].split(":")[0])
