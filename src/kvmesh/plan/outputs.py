"""What `kvmesh plan --output DIR` writes: plan.json, plan.png (cost against TTFT p90 with the
target) and values.yaml, the Helm values of deploy/helm/kvmesh that deploy the chosen plan with
vLLM pods behind the kvmesh router (flags as vLLM names them)."""

from __future__ import annotations

from pathlib import Path

from kvmesh.plan.candidates import MTP_CONFIG, Candidate
from kvmesh.plan.results import PlanResult
from kvmesh.plan.targets import Targets

# the Hugging Face checkpoints the emulated models stand for (the vLLM pods' model)
HF_MODELS = {
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "qwen3-32b": "Qwen/Qwen3-32B",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B-Instruct",
    "glm-5.2-moe": "zai-org/GLM-5-FP8",
}
GPUS_PER_NODE = 8


def helm_values(candidate: Candidate, model: str) -> dict:
    """Values for deploy/helm/kvmesh: vLLM pods of the plan's layout, replicas, P/D pools,
    host tier and MTP, and the router preset the plan was simulated with."""
    hf = HF_MODELS.get(model, model)
    per_pod = candidate.gpus_per_unit
    vllm: dict = {"tensorParallelSize": candidate.tp or 1}
    extra = ["--enable-prompt-tokens-details"]
    if candidate.mtp:
        extra += ["--speculative-config", MTP_CONFIG]
    vllm["extraArgs"] = extra
    server: dict = {"type": "vllm", "gpus": per_pod, "vllm": vllm}
    if candidate.layout:
        kind, n = candidate.layout[:2], int(candidate.layout[2:])
        if kind == "tp":
            vllm["tensorParallelSize"] = n
        else:
            server["dataParallel"] = {"size": n, "expertParallel": True}
    if candidate.host_tier_gib:
        server["hostTier"] = {
            "enabled": True,
            "sizeGiB": candidate.host_tier_gib * max(1, candidate.ranks_per_unit),
        }
    # pod memory: the host tier's DRAM above a base for vLLM's processes (an assumption)
    host = server.get("hostTier", {}).get("sizeGiB", 0)
    server["resources"] = {
        "requests": {"cpu": str(4 * per_pod), "memory": f"{32 + host}Gi"},
        "limits": {"memory": f"{64 + host}Gi"},
    }
    values: dict = {
        "model": {"servedModelName": hf.rsplit("/", 1)[-1], "vllmModel": hf},
        "modelServer": server,
        "router": {"preset": candidate.policy},
    }
    if candidate.prefill_units:
        values["pd"] = {
            "enabled": True,
            "prefill": {"replicas": candidate.prefill_units},
            "decode": {"replicas": candidate.decode_units},
        }
    else:
        server["replicas"] = candidate.units
    return values


def values_text(result: PlanResult, model: str, gpu: str) -> str:
    import yaml

    c = result.candidate
    head = [
        "# Helm values for deploy/helm/kvmesh: the plan `kvmesh plan` chose, as vLLM pods",
        f"# behind the kvmesh router. {c.gpus} x {gpu.upper()}: {c.shape()}, {c.techniques()}.",
        f"#   helm install kvmesh deploy/helm/kvmesh -f {'values.yaml'}",
        "# Simulated: TTFT p90 "
        f"{result.ttft_p90_s:.2f} s, {result.user_tok_s:.0f} tok/s per user, "
        f"{result.summary['output_tok_per_min']:,} output tok/min.",
    ]
    if c.gpus_per_unit > GPUS_PER_NODE:
        head.append(
            f"# A {c.unit_name()} pod spans {c.gpus_per_unit} GPUs, more than one "
            f"{GPUS_PER_NODE}-GPU node: run it as a multi-node vLLM deployment (LWS) instead."
        )
    head += [
        f"# Check model.vllmModel: {HF_MODELS.get(model, model)} stands for {model}; the router",
        "# needs that model's tokenizer: mount it and set router.tokenizer (router.extraVolumes).",
    ]
    body = yaml.safe_dump(helm_values(c, model), sort_keys=False)
    return "\n".join(head) + "\n" + body


def plot_plans(path: Path, results: list[PlanResult], chosen: list[PlanResult], t: Targets) -> None:
    """Every simulated candidate's $/h against its TTFT p90, the target as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for meets, colour, name in ((True, "tab:green", "meets"), (False, "tab:red", "misses")):
        pts = [r for r in results if r.meets == meets]
        ax.scatter(
            [r.ttft_p90_s for r in pts], [r.usd_per_hour for r in pts], c=colour, label=name, s=24
        )
    for i, r in enumerate(chosen, 1):
        ax.annotate(
            f"#{i}", (r.ttft_p90_s, r.usd_per_hour), xytext=(4, 4 + 8 * (i - 1)),
            textcoords="offset points", fontsize=8,
        )  # fmt: skip
    ax.axvline(t.ttft_p90_s, color="k", linestyle="--", label=f"target {t.ttft_p90_s:g} s")
    if t.budget_usd_per_hour:
        ax.axhline(t.budget_usd_per_hour, color="grey", linestyle=":", label="budget")
    if all(r.ttft_p90_s > 0 for r in results):
        ax.set_xscale("log")
    ax.set_xlabel("TTFT p90, s (simulated)")
    ax.set_ylabel("fleet cost, $ / hour")
    ax.set_title(
        f"kvmesh plan: {t.agents} agents, {t.user_tok_s:g} tok/s per user; "
        + ", ".join(f"#{i} {r.candidate.shape()}" for i, r in enumerate(chosen, 1)),
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
