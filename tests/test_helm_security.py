"""The Helm chart's hardening (issue 38): Pod Security "restricted" for every pod it renders, a
read-only root filesystem with emptyDirs where the processes write, graceful drain, startup
probes, and, behind values, a NetworkPolicy, a PodDisruptionBudget, anti-affinity, Prometheus
Operator monitors, and an InferencePool that fits the Inference Extension CRDs it declares.

Rendered by Helm's own engine as in tests/test_helm_chart.py (same helpers and values sets)."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.helm_crd_schemas import CRD_SCHEMAS, inference_pool_schema
from tests.test_helm_chart import (
    CHART,
    K8S_VERSION,
    NAMESPACE,
    RELEASE,
    VALUE_SETS,
    container,
    model_servers,
    one,
    render,
    render_values,
)

helm = pytest.importorskip("helm_python", reason="needs helm-python-sdk (the test extra)")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

ROUTER = f"{RELEASE}-kvmesh-router"


# --- Pod Security Standards, "restricted" profile (kubernetes.io/docs/concepts/security/
# pod-security-standards), as a checker: the baseline rules plus restricted's own ----------------
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {
    None,
    "",
    "container_t",
    "container_init_t",
    "container_kvm_t",
    "container_engine_t",
}


def restricted_violations(pod: dict) -> list[str]:
    """What in a pod spec breaks Pod Security "restricted" (empty: it passes), plus this chart's
    own rule that every container's root filesystem is read-only."""
    bad = []
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(host):
            bad.append(host)
    psc = pod.get("securityContext") or {}
    for vol in pod.get("volumes") or []:
        kinds = set(vol) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            bad.append(f"volume {vol['name']}: {sorted(kinds)}")
    for sysctl in psc.get("sysctls") or []:
        if sysctl["name"] not in SAFE_SYSCTLS:
            bad.append(f"sysctl {sysctl['name']}")
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        bad.append("pod hostProcess")
    if psc.get("runAsUser") == 0:
        bad.append("pod runAsUser 0")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if pod_seccomp not in (None, "RuntimeDefault", "Localhost"):
        bad.append(f"pod seccomp {pod_seccomp}")
    for key in ("appArmorProfile",):
        if (psc.get(key) or {}).get("type") == "Unconfined":
            bad.append("pod appArmor Unconfined")
    se = psc.get("seLinuxOptions") or {}
    if se.get("type") not in SELINUX_TYPES or se.get("user") or se.get("role"):
        bad.append("pod seLinuxOptions")
    every = [
        *pod.get("initContainers", []),
        *pod.get("containers", []),
        *pod.get("ephemeralContainers", []),
    ]
    for c in every:
        name, sc = c["name"], c.get("securityContext") or {}
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation not false")
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            bad.append(f"{name}: runAsNonRoot not true")
        if sc.get("runAsUser") == 0:
            bad.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type") or pod_seccomp
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile {seccomp}")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            bad.append(f"{name}: capabilities not dropping ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: capabilities added {caps['add']}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            bad.append(f"{name}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            bad.append(f"{name}: procMount")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            bad.append(f"{name}: hostProcess")
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            bad.append(f"{name}: appArmor Unconfined")
        se = sc.get("seLinuxOptions") or {}
        if se.get("type") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            bad.append(f"{name}: seLinuxOptions")
        if sc.get("readOnlyRootFilesystem") is not True:  # this chart's rule
            bad.append(f"{name}: root filesystem writable")
    return bad


def pod_specs(docs: list[dict]) -> dict[str, dict]:
    kinds = {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}
    pods = {
        d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs if d["kind"] in kinds
    }
    pods.update({d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Pod"})
    return pods


def test_the_checker_finds_what_restricted_refuses():
    good = {
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "volumes": [{"name": "t", "emptyDir": {}}],
        "containers": [
            {
                "name": "c",
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
                },
            }
        ],
    }
    assert restricted_violations(good) == []
    breaks = [
        ("hostNetwork", lambda p: p.update(hostNetwork=True)),
        ("hostPID", lambda p: p.update(hostPID=True)),
        ("hostPath", lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}})),
        ("seccomp", lambda p: p["securityContext"].pop("seccompProfile")),
        ("runAsNonRoot", lambda p: p["securityContext"].pop("runAsNonRoot")),
        ("runAsUser 0", lambda p: p["securityContext"].update(runAsUser=0)),
        ("privileged", lambda p: p["containers"][0]["securityContext"].update(privileged=True)),
        (
            "escalation",
            lambda p: p["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
        ),  # noqa: E501
        (
            "caps",
            lambda p: p["containers"][0]["securityContext"]["capabilities"].update(
                add=["SYS_ADMIN"]
            ),
        ),  # noqa: E501
        ("rootfs", lambda p: p["containers"][0]["securityContext"].pop("readOnlyRootFilesystem")),
        (
            "hostPort",
            lambda p: p["containers"][0].update(ports=[{"containerPort": 1, "hostPort": 1}]),
        ),  # noqa: E501
        ("init", lambda p: p.update(initContainers=[{"name": "i"}])),
    ]
    for label, breaking in breaks:
        pod = yaml.safe_load(yaml.safe_dump(good))
        breaking(pod)
        assert restricted_violations(pod), label


@pytest.mark.parametrize("values", VALUE_SETS)
def test_every_pod_passes_pod_security_restricted(values):
    pods = pod_specs(render(values))
    assert ROUTER in pods and len(pods) >= 2
    for name, pod in pods.items():
        assert restricted_violations(pod) == [], name


@pytest.mark.parametrize("values", ["defaults", "vllm", "host-tier"])
def test_read_only_root_has_tmp_and_home_on_emptydirs(values):
    for d in [one(render(values), "Deployment", ROUTER), *model_servers(render(values))]:
        pod = d["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        c = container(d)
        env = {e["name"]: e.get("value") for e in c["env"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        home = env["HOME"]
        # every path the processes write (kvmesh's tokenizer cache under ~/.cache, HF_HOME,
        # torch/triton caches, vLLM's cache and config) is under /tmp or HOME, both emptyDirs
        writes = [env["XDG_CACHE_HOME"], env["HF_HOME"]]
        if c["name"] == "vllm":
            writes += [env["VLLM_CACHE_ROOT"], env["VLLM_CONFIG_ROOT"], env["NUMBA_CACHE_DIR"]]
            assert env["USER"]  # getpass.getuser() for a uid the image has no account for
        for path in writes:
            assert path.startswith(home + "/"), path
        for path in ("/tmp", home):
            assert "emptyDir" in volumes[mounts[path]], path


def test_router_and_engines_have_startup_probes():
    docs = render("defaults")
    router = container(one(docs, "Deployment", ROUTER))
    # alive as soon as /metrics answers; readiness (/health) waits for engines
    assert router["startupProbe"]["httpGet"] == {"path": "/metrics", "port": "http"}
    assert "initialDelaySeconds" not in router["livenessProbe"]  # the startup probe gates it
    for values in ("defaults", "vllm", "pd"):
        for d in model_servers(render(values)):
            assert container(d)["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}


@pytest.mark.parametrize("values", ["defaults", "vllm", "pd"])
def test_pods_drain_before_sigterm(values):
    docs = render(values)
    for d in [one(docs, "Deployment", ROUTER), *model_servers(docs)]:
        pod = d["spec"]["template"]["spec"]
        grace = pod["terminationGracePeriodSeconds"]
        # the kubelet's own sleep (no binary needed in the image): endpoints drop the pod first
        sleep = container(d)["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert 0 < sleep < grace and grace >= 60
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == ">=1.30.0-0"  # the sleep action: beta, on by default, 1.30


def test_drain_values():
    values = {
        "router": {"terminationGracePeriodSeconds": 300, "preStopSleepSeconds": 0},
        "modelServer": {"terminationGracePeriodSeconds": 90, "preStopSleepSeconds": 20},
    }
    docs = render_values(values)
    router = one(docs, "Deployment", ROUTER)
    assert router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 300
    assert "lifecycle" not in container(router)
    for d in model_servers(docs):
        assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 90
        assert container(d)["lifecycle"] == {"preStop": {"sleep": {"seconds": 20}}}


# --- behind values ---------------------------------------------------------------------------
def _router_pod_labels(docs: list[dict]) -> dict:
    return one(docs, "Deployment", ROUTER)["spec"]["template"]["metadata"]["labels"]


def _ingress_ports(rule: dict) -> set[int]:
    return {p["port"] for p in rule["ports"]}


def test_network_policy_is_off_by_default():
    assert [d for d in render("defaults") if d["kind"] == "NetworkPolicy"] == []


def test_network_policy_lets_only_the_gateway_reach_ext_proc():
    docs = render("hardened")
    policy = one(docs, "NetworkPolicy")
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    assert spec["podSelector"]["matchLabels"].items() <= _router_pod_labels(docs).items()
    (rule,) = spec["ingress"]
    assert _ingress_ports(rule) == {9002, 8000}
    gateway = one(docs, "Gateway")["metadata"]["name"]
    assert rule["from"] == [
        {"podSelector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name": gateway}}}
    ]


def test_network_policy_peers_from_values():
    gateway_peer = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "istio-system"}},
        "podSelector": {"matchLabels": {"istio": "ingressgateway"}},
    }
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}
    values = {
        "networkPolicy": {
            "enabled": True,
            "gatewayPeers": [gateway_peer],
            "httpPeers": [prometheus],
        },
        "router": {"port": 8080, "extProcPort": 9102},
    }
    policy = one(render_values(values), "NetworkPolicy")
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    gateway_rule, http_rule = policy["spec"]["ingress"]
    assert gateway_rule["from"] == [gateway_peer] and _ingress_ports(gateway_rule) == {8080, 9102}
    # other peers reach the HTTP port only, never the unauthenticated ext_proc port
    assert http_rule["from"] == [prometheus] and _ingress_ports(http_rule) == {8080}


def test_network_policy_needs_peers_without_the_charts_gateway():
    values = {
        "networkPolicy": {"enabled": True},
        "gateway": {"create": False},
        "httpRoute": {"parentRefs": [{"name": "shared", "namespace": "infra"}]},
    }
    with (
        helm.Chart.load(CHART) as chart,
        pytest.raises(helm.HelmError, match=re.escape("needs networkPolicy.gatewayPeers")),
    ):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_router_pod_disruption_budget():
    docs = render("hardened")
    pdb = one(docs, "PodDisruptionBudget")
    kubernetes_validate.validate(pdb, K8S_VERSION, strict=True)
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= _router_pod_labels(docs).items()
    for d in model_servers(docs):  # the router's only
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert not pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    pdb = one(
        render_values({"router": {"podDisruptionBudget": {"minAvailable": 2}}}),
        "PodDisruptionBudget",
    )  # noqa: E501
    assert pdb["spec"]["minAvailable"] == 2 and "maxUnavailable" not in pdb["spec"]
    off = render_values({"router": {"podDisruptionBudget": {"enabled": False}}})
    assert [d for d in off if d["kind"] == "PodDisruptionBudget"] == []


def test_router_replicas_spread_over_nodes():
    docs = render("defaults")
    labels = _router_pod_labels(docs)
    anti = one(docs, "Deployment", ROUTER)["spec"]["template"]["spec"]["affinity"][
        "podAntiAffinity"
    ]
    (preferred,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    term = preferred["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= labels.items()
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in anti

    hard = one(render("hardened"), "Deployment", ROUTER)["spec"]["template"]["spec"]["affinity"]
    (required,) = hard["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required["topologyKey"] == "kubernetes.io/hostname"

    none = one(render_values({"router": {"podAntiAffinity": "none"}}), "Deployment", ROUTER)
    assert "affinity" not in none["spec"]["template"]["spec"]
    own = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "pool", "operator": "In", "values": ["cpu"]}]}]}}}  # fmt: skip
    mine = one(render_values({"router": {"affinity": own}}), "Deployment", ROUTER)
    assert mine["spec"]["template"]["spec"]["affinity"] == own
    with (
        helm.Chart.load(CHART) as chart,
        pytest.raises(helm.HelmError, match="router.podAntiAffinity must be soft, hard or none"),
    ):
        chart.render({"router": {"podAntiAffinity": "always"}}, name=RELEASE, namespace=NAMESPACE)


def test_monitors_scrape_the_router_and_model_servers():
    assert not [d for d in render("defaults") if d["apiVersion"] == "monitoring.coreos.com/v1"]
    docs = render("hardened")
    monitor = one(docs, "ServiceMonitor")
    jsonschema.validate(monitor, CRD_SCHEMAS[("monitoring.coreos.com/v1", "ServiceMonitor")])
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    # a ServiceMonitor selects Services by their labels, and names the Service's port
    service = one(docs, "Service", ROUTER)
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )  # noqa: E501
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in [p["name"] for p in service["spec"]["ports"]]
    assert endpoint["path"] == "/metrics"

    pods = one(docs, "PodMonitor")
    jsonschema.validate(pods, CRD_SCHEMAS[("monitoring.coreos.com/v1", "PodMonitor")])
    (endpoint,) = pods["spec"]["podMetricsEndpoints"]
    servers = model_servers(docs)
    assert servers
    for d in servers:
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert pods["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert endpoint["port"] in [p["name"] for p in container(d)["ports"]]
    assert not pods["spec"]["selector"]["matchLabels"].items() <= _router_pod_labels(docs).items()


# --- the InferencePool against the CRD release it declares -----------------------------------
@pytest.mark.parametrize(
    "pool_values, app_protocol",
    [
        ({}, None),  # default: v1.0.0 CRDs, no appProtocol field
        ({"crdVersion": "v1.3.1"}, None),
        ({"crdVersion": "v1.4.0"}, "http"),
        ({"crdVersion": "v1.6.0", "appProtocol": "kubernetes.io/h2c"}, "kubernetes.io/h2c"),
    ],
)
def test_inference_pool_fits_its_crd_version(pool_values, app_protocol):
    pool = one(render_values({"inferencePool": pool_values}), "InferencePool")
    jsonschema.validate(pool, inference_pool_schema(pool_values.get("crdVersion", "v1.0.0")))
    assert pool["spec"].get("appProtocol") == app_protocol


def test_h2c_needs_crds_that_have_app_protocol():
    with (
        helm.Chart.load(CHART) as chart,
        pytest.raises(
            helm.HelmError, match=re.escape("needs the Inference Extension CRDs v1.4.0 or later")
        ),
    ):
        chart.render(
            {"inferencePool": {"appProtocol": "kubernetes.io/h2c"}},
            name=RELEASE,
            namespace=NAMESPACE,
        )


@pytest.mark.parametrize("values", ["defaults", "vllm", "hardened"])
@pytest.mark.parametrize("k8s", ["1.30.0", kubernetes_validate.latest_version()])
def test_valid_from_the_charts_minimum_kubernetes_to_the_newest(values, k8s):
    """The fields the hardening uses (the preStop sleep action, PDB, NetworkPolicy) exist in the
    schemas of the chart's kubeVersion floor and of the newest release."""
    minimum = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    assert minimum == ">=1.30.0-0"
    for doc in render(values):
        if doc["apiVersion"].split("/")[0] in ("v1", "apps", "policy", "networking.k8s.io",
                                                "rbac.authorization.k8s.io"):  # fmt: skip
            kubernetes_validate.validate(doc, k8s, strict=True)
