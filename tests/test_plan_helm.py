"""The Helm values `kvmesh plan --output` writes render with deploy/helm/kvmesh (Helm's own
engine, as tests/test_helm_chart.py renders it), every manifest validates, and the vLLM pods,
replicas, P/D pools and router preset are the plan's."""

from __future__ import annotations

import pytest
import yaml

from kvmesh.plan.candidates import Candidate
from kvmesh.plan.outputs import values_text
from kvmesh.plan.results import PlanResult

helm = pytest.importorskip("helm_python", reason="needs helm-python-sdk (the test extra)")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

from tests.test_helm_chart import (  # noqa: E402
    CHART,
    NAMESPACE,
    RELEASE,
    container,
    flag,
    model_servers,
    one,
    render_values,
    validate_manifests,
)

SUMMARY = {"ttft_ms_p50": 20.0, "ttft_ms_p90": 30.0, "user_tok_s_p50": 160.0,
           "output_tok_per_min": 17000, "preemptions": 0, "hit_rate": 0.9}  # fmt: skip


def rendered(candidate: Candidate, model: str) -> list[dict]:
    result = PlanResult(candidate, SUMMARY, 4.7, 0.002, 4.4, 1.9, 30.0)
    values = yaml.safe_load(values_text(result, model, "h100"))
    docs = render_values(values)
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []
    validate_manifests(docs)
    return docs


def test_an_aggregated_tp_plan_deploys_its_replicas_of_vllm() -> None:
    docs = rendered(Candidate("", 2, 3, 0, "kvmesh", 0, False), "llama-3.1-8b")
    (server,) = model_servers(docs)
    assert server["spec"]["replicas"] == 3
    c = container(server)
    assert c["command"] == ["vllm", "serve"]
    assert c["args"][0] == "meta-llama/Llama-3.1-8B-Instruct"
    assert flag(c["args"], "--tensor-parallel-size") == "2"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    router = container(one(docs, "Deployment", f"{RELEASE}-kvmesh-router"))
    assert flag(router["args"], "--preset") == "kvmesh"


def test_a_pd_wide_ep_plan_with_tier_and_mtp_deploys_both_pools() -> None:
    docs = rendered(Candidate("dp8", 0, 3, 1, "pd", 16, True), "glm-5.2-moe")
    servers = {d["metadata"]["labels"]["llm-d.ai/role"]: d for d in model_servers(docs)}
    assert {r: d["spec"]["replicas"] for r, d in servers.items()} == {"prefill": 1, "decode": 2}
    args = container(servers["decode"])["args"]
    assert flag(args, "--data-parallel-size") == "8" and "--enable-expert-parallel" in args
    assert '"method": "mtp"' in flag(args, "--speculative-config")
    transfer = flag(args, "--kv-transfer-config")
    assert "NixlConnector" in transfer and "OffloadingConnector" in transfer
    assert container(servers["decode"])["resources"]["limits"]["nvidia.com/gpu"] == 8
    router = container(one(docs, "Deployment", f"{RELEASE}-kvmesh-router"))
    assert flag(router["args"], "--preset") == "pd"
