"""--speculative-config as vLLM spells it: defaults, normalisation, and refusals naming the key."""

from __future__ import annotations

import json

import pytest

from kvmesh.engine.spec.config import SpeculativeConfig

parse = SpeculativeConfig.from_cli


def test_ngram_prompt_lookup_bounds_default_and_mirror() -> None:
    c = parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    c = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
         "prompt_lookup_max": 6, "disable_by_batch_size": 8}
    )  # fmt: skip
    assert c.to_dict() == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 6,
        "disable_by_batch_size": 8,
        "disable_padded_drafter_batch": False,
    }
    assert c.resolve() == 3
    assert c.use_speculation(7) and not c.use_speculation(8)


def test_method_inference_and_mtp_aliases() -> None:
    assert (
        SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 2}).method
        == "ngram"
    )
    assert (
        SpeculativeConfig.from_dict(
            {"model": "yuhuili/EAGLE3-LLaMA3.1", "num_speculative_tokens": 2}
        ).method
        == "eagle3"
    )
    assert (
        SpeculativeConfig.from_dict(
            {"model": "org/EAGLE-llama2", "num_speculative_tokens": 2}
        ).method
        == "eagle"
    )
    assert (
        SpeculativeConfig.from_dict({"model": "/m/small", "num_speculative_tokens": 2}).method
        == "draft_model"
    )
    assert parse('{"method": "deepseek_mtp"}').method == "mtp"
    assert parse('{"method": "glm4_moe_mtp", "num_speculative_tokens": 2}').method == "mtp"


def test_mtp_resolves_k_from_the_model() -> None:
    assert parse('{"method": "mtp"}').resolve(num_nextn_predict_layers=1) == 1
    assert parse('{"method": "mtp", "num_speculative_tokens": 3}').resolve(1) == 3
    assert parse('{"method": "mtp", "num_speculative_tokens": 4}').resolve(2) == 4
    with pytest.raises(ValueError, match="multiple of num_nextn_predict_layers"):
        parse('{"method": "mtp", "num_speculative_tokens": 3}').resolve(2)
    with pytest.raises(ValueError, match="num_nextn_predict_layers >= 1"):
        parse('{"method": "mtp", "num_speculative_tokens": 3}').resolve(0)
    # a head file stands in for the missing layers
    head = parse('{"method": "mtp", "model": "heads/smollm2_mtp.safetensors"}')
    assert head.resolve(0) == 1


NGRAM = {"method": "ngram", "num_speculative_tokens": 2}
DRAFT = {"method": "draft_model", "model": "m", "num_speculative_tokens": 2}


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        (NGRAM | {"lookup_max": 4}, "'lookup_max'"),
        (NGRAM | {"num_speculative_tokens": 0}, "num_speculative_tokens"),
        (NGRAM | {"num_speculative_tokens": "3"}, "num_speculative_tokens"),
        (NGRAM | {"num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        (NGRAM | {"prompt_lookup_min": 0}, "prompt_lookup_min"),
        (NGRAM | {"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        (NGRAM | {"model": "x"}, "model"),
        (NGRAM | {"method": "mtp", "prompt_lookup_max": 2}, "prompt_lookup_max"),
        (NGRAM | {"method": "draft_model"}, "model is required"),
        (NGRAM | {"method": "eagle"}, "model is required"),
        (NGRAM | {"method": "medusa"}, "not supported by kvmesh"),
        (NGRAM | {"method": "lookahead"}, "unknown method"),
        (NGRAM | {"disable_by_batch_size": 1}, "disable_by_batch_size"),
        (NGRAM | {"draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size"),
        (DRAFT | {"quantization": "fp8"}, "quantization"),
        (DRAFT | {"max_model_len": 0}, "max_model_len"),
        (DRAFT | {"enforce_eager": "yes"}, "enforce_eager"),
        (NGRAM | {"speculative_token_tree": "[]"}, "speculative_token_tree"),
        ({"num_speculative_tokens": 2}, "method"),
        (["ngram"], "JSON object"),
    ],
)
def test_bad_configs_are_refused_with_the_key_named(raw, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse(json.dumps(raw))
    with pytest.raises(ValueError, match="not valid JSON"):
        parse("{method: ngram}")
