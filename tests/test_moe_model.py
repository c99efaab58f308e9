"""Our sparse-MoE decoders against HF transformers: greedy tokens and logits must match.

Tiny random Qwen3-MoE (q/k norm, norm_topk_prob, a dense layer via mlp_only_layers), Mixtral
(softmax over the top-k) and Qwen2-MoE (QKV bias, sigmoid-gated shared expert, sparse every 2nd
layer) checkpoints saved with save_pretrained and loaded through `load_model`. Also: fused 3D
expert tensors load to the same model, and the whole engine serves a MoE with HF's tokens.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvmesh.engine.models.loader import load_model
from kvmesh.engine.models.moe import MoeForCausalLM, SparseMoeBlock
from tests.test_model_hf import NEW_TOKENS, PagedLoop, _perturb, hf_greedy

PROMPTS = [
    "The capital of France is",
    "Write a haiku about paged attention and key-value caches, please.",
    "1, 2, 3,",
]
COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=1000.0,
    max_position_embeddings=256,
    num_experts_per_tok=2,
)
FAMILIES = {
    "qwen3_moe": (
        "Qwen3Moe",
        dict(
            num_hidden_layers=3,
            head_dim=32,
            intermediate_size=96,  # the dense layer (mlp_only_layers)
            moe_intermediate_size=32,
            num_experts=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        ),
    ),
    "mixtral": ("Mixtral", dict(num_hidden_layers=2, intermediate_size=48, num_local_experts=4)),
    "qwen2_moe": (
        "Qwen2Moe",
        dict(
            num_hidden_layers=2,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=6,
            norm_topk_prob=False,
            decoder_sparse_step=2,  # layer 0 dense, layer 1 sparse
        ),
    ),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # torch on one thread: conftest


@pytest.fixture(scope="module")
def tokenizer():
    from kvmesh.engine.tokenizer import default_gguf_path, load_gguf_tokenizer

    return load_gguf_tokenizer(default_gguf_path())


def save_tiny(family: str, path, tokenizer):
    """A perturbed random HF model of `family`, saved with save_pretrained; returns it."""
    import transformers

    cls, kw = FAMILIES[family]
    config = getattr(transformers, f"{cls}Config")(vocab_size=len(tokenizer), **COMMON, **kw)
    torch.manual_seed(0)
    hf = getattr(transformers, f"{cls}ForCausalLM")(config).eval()
    _perturb(hf)
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return hf


class MoeCase:
    def __init__(self, family: str, path, tokenizer) -> None:
        self.path = path
        self.hf = save_tiny(family, path, tokenizer)
        self.loaded = load_model(str(path))
        self.prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
        with torch.inference_mode():
            self.refs = [hf_greedy(self.hf, p) for p in self.prompts]

    def check(self, i: int, tokens: list[int], logits: list[torch.Tensor]) -> None:
        ref_tokens, ref_logits = self.refs[i]
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.stack(logits), ref_logits, atol=1e-3, rtol=0)


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, tmp_path_factory, tokenizer) -> MoeCase:
    return MoeCase(request.param, tmp_path_factory.mktemp(request.param), tokenizer)


def decode_all(loop: PagedLoop, pending: dict[int, list[int]], out: dict[int, list]) -> None:
    while pending:
        seqs = list(pending)
        logits = loop.step([(s, [pending[s][-1]]) for s in seqs])
        for s, row in zip(seqs, logits, strict=True):
            out[s].append(row)
            pending[s].append(int(row.argmax()))
            if len(pending[s]) == NEW_TOKENS:
                del pending[s]


def run_mixed(loaded, prompts: list[list[int]]) -> tuple[dict, dict]:
    """Seq 0 prefills alone, then decodes while 1 and 2 prefill in one batch; batched decode."""
    loop = PagedLoop(loaded)
    first = loop.step([(0, prompts[0])])[0]
    pending, out = {0: [int(first.argmax())]}, {0: [first], 1: [], 2: []}
    logits = loop.step([(0, [pending[0][-1]]), (1, prompts[1]), (2, prompts[2])])
    for s, row in enumerate(logits):
        out[s].append(row)
        pending.setdefault(s, []).append(int(row.argmax()))
    tokens = dict(pending)
    decode_all(loop, pending, out)
    return tokens, out


def test_loads_as_moe(case: MoeCase) -> None:
    model = case.loaded.model
    assert isinstance(model, MoeForCausalLM)
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert (
        sparse
        == {"Qwen3": [True, False, True], "Mixtr": [True, True], "Qwen2": [False, True]}[
            case.loaded.config.architecture[:5]
        ]
    )


def test_prefill_then_decode(case: MoeCase) -> None:
    loop, prompt = PagedLoop(case.loaded), case.prompts[1]
    logits = loop.step([(0, prompt[:5])])
    logits = loop.step([(0, prompt[5:])])  # chunked prefill
    tokens, out = [int(logits[0].argmax())], {0: [logits[0]]}
    decode_all(loop, {0: tokens}, out)
    case.check(1, tokens, out[0])


def test_mixed_batch_then_batched_decode(case: MoeCase) -> None:
    tokens, out = run_mixed(case.loaded, case.prompts)
    for s in range(3):
        case.check(s, tokens[s], out[s])


def test_fused_3d_expert_tensors(case: MoeCase, tmp_path) -> None:
    """transformers-5 fused names (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    from safetensors.torch import load_file, save_file

    (src,) = case.path.glob("*.safetensors")
    flat = load_file(src)
    fused: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in flat.items():
        if ".experts." not in name:
            fused[name] = t
            continue
        prefix, rest = name.split(".experts.")
        e, proj, _ = rest.split(".")
        experts.setdefault(prefix.replace("block_sparse_moe", "mlp"), {}).setdefault(int(e), {})[
            {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(proj, proj)
        ] = t
    for prefix, per in experts.items():
        order = sorted(per)
        gate_up = [torch.cat([per[e]["gate_proj"], per[e]["up_proj"]]) for e in order]
        fused[f"{prefix}.experts.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{prefix}.experts.down_proj"] = torch.stack([per[e]["down_proj"] for e in order])
    for f in case.path.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    save_file(fused, tmp_path / "model.safetensors")
    again = load_model(str(tmp_path))
    for a, b in zip(case.loaded.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_engine_serves_moe_with_hf_tokens(case: MoeCase) -> None:
    from kvmesh.engine.builder import assemble
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.sequence import Request, SamplingParams
    from kvmesh.engine.torch_runner import TorchRunner

    config = EngineConfig(num_gpu_blocks=64, max_num_batched_tokens=24)  # chunked prefill too
    loaded = case.loaded
    bundle = assemble(config, TorchRunner(config, loaded), loaded.tokenizer, "m", "p", ())
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    reqs = [Request(str(i), ids, params) for i, ids in enumerate(case.prompts)]
    for r in reqs:
        bundle.engine.core.add_request(r)
    for _ in range(500):
        if not bundle.engine.core.has_work():
            break
        bundle.engine.core.step()
    bundle.publisher.close()
    for r, (ref_tokens, _) in zip(reqs, case.refs, strict=True):
        assert r.output_token_ids == ref_tokens


def test_rejects_bad_moe_checkpoints(tmp_path, tokenizer) -> None:
    hf_dir = tmp_path / "m"
    save_tiny("mixtral", hf_dir, tokenizer)
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["num_experts_per_tok"] = 9  # more than the 4 experts
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        load_model(str(hf_dir))
    cfg["num_experts_per_tok"], cfg["num_local_experts"] = 2, 3  # checkpoint holds expert 3
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="expert index"):
        load_model(str(hf_dir))
