"""Load shedding at the endpoint picker: a request whose InferenceObjective has a negative
priority is answered 429 while no endpoint has capacity; others are placed as ever."""

from __future__ import annotations

import json

import pytest
import yaml

pytest.importorskip("grpc")

from kvmesh.router.ext_proc import DESTINATION  # noqa: E402
from kvmesh.router.shedding import load_objectives  # noqa: E402
from tests import test_ext_proc as base  # noqa: E402
from tests.test_ext_proc import body, headers, picker, process, set_headers  # noqa: E402

fleet = base.fleet  # its fixture, shared
OBJECTIVES = [
    {"kind": "InferenceObjective", "metadata": {"name": "batch"}, "spec": {"priority": -1}},
    {"kind": "InferenceObjective", "metadata": {"name": "chat"}, "spec": {"priority": 10}},
    {"kind": "InferenceObjective", "metadata": {"name": "plain"}, "spec": {}},
]
REQUEST = {"prompt": "summarise this", "max_tokens": 2}


def objectives_file(tmp_path, documents) -> str:
    path = tmp_path / "objectives.yaml"
    path.write_text(yaml.safe_dump_all(documents))
    return str(path)


async def answer(port: int, objective: str | None):
    extra = {"x-gateway-inference-objective": objective} if objective else {}
    return (await process(port, [headers("/v1/completions", **extra), body(REQUEST)]))[-1]


async def test_sheddable_requests_get_429_only_while_the_pool_is_saturated(
    tokenizer, fleet, tmp_path
) -> None:
    config = {"kv_events": None, "scrape_interval": 30.0}  # the test sets the load itself
    config["inference_objectives"] = objectives_file(tmp_path, OBJECTIVES)
    with picker(tokenizer, fleet, **config) as (router, port, _):
        base.wait_for(lambda: len(router.pool.candidates()) == 2)
        placed = await answer(port, "batch")  # room: even a sheddable request is placed
        assert DESTINATION in set_headers(placed.request_body.response)
        endpoints = list(router.pool.endpoints.values())
        for e in endpoints:
            e.waiting = 5  # the queue threshold: no capacity anywhere
        shed = (await answer(port, "batch")).immediate_response
        assert shed.status.code == 429
        assert json.loads(shed.body)["error"]["code"] == 429
        assert set_headers(shed)["retry-after"] == "1"
        for objective in ("chat", "plain", "unknown", None):  # priority >= 0: queued, not shed
            placed = await answer(port, objective)
            assert DESTINATION in set_headers(placed.request_body.response), objective
        endpoints[0].waiting, endpoints[1].kv_usage = 0, 0.8  # one has room again; one's KV full
        placed = await answer(port, "batch")
        assert set_headers(placed.request_body.response)[DESTINATION] in {
            base.address(e.url) for e in endpoints
        }
        endpoints[0].kv_usage = 0.9
        assert (await answer(port, "batch")).immediate_response.status.code == 429


def test_objectives_load_from_manifests_or_a_list(tmp_path) -> None:
    assert load_objectives(objectives_file(tmp_path, OBJECTIVES)) == {
        "batch": -1,
        "chat": 10,
        "plain": 0,
    }
    listed = [{"kind": "List", "items": OBJECTIVES[:1]}]
    assert load_objectives(objectives_file(tmp_path, listed)) == {"batch": -1}
    for bad in (
        [{"kind": "InferencePool", "metadata": {"name": "x"}}],
        [{"kind": "InferenceObjective", "metadata": {"name": "x"}, "spec": {"priority": "high"}}],
        [{"kind": "InferenceObjective", "spec": {"priority": 1}}],
    ):
        with pytest.raises(ValueError, match="--inference-objectives"):
            load_objectives(objectives_file(tmp_path, bad))
    with pytest.raises(ValueError, match="--inference-objectives"):
        load_objectives(str(tmp_path / "missing.yaml"))
