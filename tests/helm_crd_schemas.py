"""Schemas of the CRD kinds the Helm chart writes (InferencePool, Gateway, HTTPRoute,
ServiceMonitor, PodMonitor) and their CEL rules, for tests/test_helm_chart.py."""

from __future__ import annotations

# --- schemas of the CRD kinds -----------------------------------------------------------------
# Written from the published CRDs, trimmed to the fields this chart writes (a field not listed
# fails: additionalProperties false) with their types, patterns, bounds and required lists:
#   InferencePool: kubernetes-sigs/gateway-api-inference-extension,
#     config/crd/bases/inference.networking.k8s.io_inferencepools.yaml (version v1)
#   Gateway, HTTPRoute: kubernetes-sigs/gateway-api (v1.6),
#     config/crd/standard/gateway.networking.k8s.io_{gateways,httproutes}.yaml (version v1)
# The CEL rules (x-kubernetes-validations) are checked in check_crd_rules.
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
GROUP = {"type": "string", "maxLength": 253, "pattern": r"^$|" + DNS_SUBDOMAIN}
KIND = {
    "type": "string",
    "minLength": 1,
    "maxLength": 63,
    "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
}
NAME = {"type": "string", "minLength": 1, "maxLength": 253}
NS = {
    "type": "string",
    "minLength": 1,
    "maxLength": 63,
    "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
SECTION = {"type": "string", "minLength": 1, "maxLength": 253, "pattern": DNS_SUBDOMAIN}
LABEL_VALUE = {
    "type": "string",
    "maxLength": 63,
    "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
}
DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
PROM_DURATION = {"type": "string",
                 "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                            r"(([0-9]+)s)?(([0-9]+)ms)?)$"}  # fmt: skip
METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 253, "pattern": DNS_SUBDOMAIN},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        "namespace": NS,
    },
    "additionalProperties": False,
}


def _obj(props: dict, required: tuple[str, ...] | list[str] = ()) -> dict:
    return {"type": "object", "properties": props, "required": list(required),
            "additionalProperties": False}  # fmt: skip


def _crd(group_version: str, kind: str, spec: dict) -> dict:
    return _obj(
        {
            "apiVersion": {"const": group_version},
            "kind": {"const": kind},
            "metadata": METADATA,
            "spec": spec,
        },
        ["apiVersion", "kind", "metadata", "spec"],
    )


CRD_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): _crd(
        "inference.networking.k8s.io/v1", "InferencePool",
        _obj({
            "selector": _obj({"matchLabels": {"type": "object", "minProperties": 1,
                                              "maxProperties": 64,
                                              "additionalProperties": LABEL_VALUE}},
                             ["matchLabels"]),
            "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8,
                            "items": _obj({"number": PORT}, ["number"])},
            "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
            "endpointPickerRef": _obj({
                "group": GROUP, "kind": KIND, "name": NAME,
                "port": _obj({"number": PORT}, ["number"]),
                "failureMode": {"enum": ["FailOpen", "FailClose"]},
            }, ["name"]),
        }, ["selector", "targetPorts"]),
    ),
    # Prometheus Operator (prometheus-operator/prometheus-operator, example/prometheus-operator-crd
    # monitoring.coreos.com_{servicemonitors,podmonitors}.yaml, version v1)
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _crd(
        "monitoring.coreos.com/v1", "ServiceMonitor",
        _obj({
            "selector": _obj({"matchLabels": {"type": "object", "minProperties": 1,
                                              "additionalProperties": LABEL_VALUE}}),
            "namespaceSelector": _obj({"matchNames": {"type": "array", "items": NS}}),
            "endpoints": {"type": "array", "minItems": 1, "items": _obj({
                "port": {"type": "string", "minLength": 1}, "path": {"type": "string"},
                "interval": PROM_DURATION, "scrapeTimeout": PROM_DURATION})},
        }, ["selector", "endpoints"]),
    ),
    ("monitoring.coreos.com/v1", "PodMonitor"): _crd(
        "monitoring.coreos.com/v1", "PodMonitor",
        _obj({
            "selector": _obj({"matchLabels": {"type": "object", "minProperties": 1,
                                              "additionalProperties": LABEL_VALUE}}),
            "namespaceSelector": _obj({"matchNames": {"type": "array", "items": NS}}),
            "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _obj({
                "port": {"type": "string", "minLength": 1}, "path": {"type": "string"},
                "interval": PROM_DURATION, "scrapeTimeout": PROM_DURATION})},
        }, ["selector", "podMetricsEndpoints"]),
    ),
    ("gateway.networking.k8s.io/v1", "Gateway"): _crd(
        "gateway.networking.k8s.io/v1", "Gateway",
        _obj({
            "gatewayClassName": NAME,
            "listeners": {"type": "array", "minItems": 1, "maxItems": 64, "items": _obj({
                "name": SECTION, "port": PORT,
                "protocol": {"type": "string", "minLength": 1, "maxLength": 255},
                "hostname": {"type": "string"},
                "allowedRoutes": _obj({"namespaces": _obj({
                    "from": {"enum": ["All", "Selector", "Same", "None"]}})}),
            }, ["name", "port", "protocol"])},
        }, ["gatewayClassName", "listeners"]),
    ),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): _crd(
        "gateway.networking.k8s.io/v1", "HTTPRoute",
        _obj({
            "parentRefs": {"type": "array", "maxItems": 32, "items": _obj({
                "group": GROUP, "kind": KIND, "name": NAME, "namespace": NS,
                "sectionName": SECTION, "port": PORT}, ["name"])},
            "hostnames": {"type": "array", "maxItems": 16, "items": {"type": "string"}},
            "rules": {"type": "array", "minItems": 1, "maxItems": 16, "items": _obj({
                "matches": {"type": "array", "maxItems": 64, "items": _obj({"path": _obj({
                    "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                    "value": {"type": "string", "maxLength": 1024}})})},
                "backendRefs": {"type": "array", "maxItems": 16, "items": _obj({
                    "group": GROUP, "kind": KIND, "name": NAME, "namespace": NS, "port": PORT,
                    "weight": {"type": "integer", "minimum": 0, "maximum": 1000000}}, ["name"])},
                "timeouts": _obj({"request": DURATION, "backendRequest": DURATION}),
            })},
        }),
    ),
}  # fmt: skip


def check_crd_rules(doc: dict) -> None:
    """The CEL rules of the same CRDs that this chart's objects could break."""
    spec = doc["spec"]
    if doc["kind"] == "InferencePool":
        numbers = [p["number"] for p in spec["targetPorts"]]
        assert len(numbers) == len(set(numbers)), "port number must be unique"
        ref = spec.get("endpointPickerRef")
        if ref and ref.get("kind", "Service") == "Service":
            assert "port" in ref, "port is required when kind is 'Service'"
    if doc["kind"] == "Gateway":
        names = [listener["name"] for listener in spec["listeners"]]
        assert len(names) == len(set(names)), "listener names must be unique"
    if doc["kind"] == "HTTPRoute":
        for rule in spec["rules"]:
            for ref in rule.get("backendRefs", []):
                if ref.get("group", "") == "" and ref.get("kind", "Service") == "Service":
                    assert "port" in ref, "Must have port for Service reference"
            for match in rule.get("matches", []):
                path = match.get("path", {})
                if path.get("type", "PathPrefix") in ("Exact", "PathPrefix"):
                    assert path.get("value", "/").startswith("/")


def inference_pool_schema(crd_version: str) -> dict:
    """InferencePool v1 as a given Inference Extension release's CRD has it: spec.appProtocol
    arrived in v1.4.0 (api/v1/inferencepool_types.go at the release tags: v1.0.0-v1.3.1 have no
    such field, and the API server's strict field validation refuses it, or it is pruned)."""
    import copy

    schema = copy.deepcopy(CRD_SCHEMAS[("inference.networking.k8s.io/v1", "InferencePool")])
    major, minor = (int(x) for x in crd_version.lstrip("v").split(".")[:2])
    if (major, minor) < (1, 4):
        del schema["properties"]["spec"]["properties"]["appProtocol"]
    return schema
