"""Data-parallel serving without processes: the DP / EP flags, the front door's merged /metrics
and /kv_event_sources, and its choice of rank (fewest in flight, the header, live ranks only)."""

from __future__ import annotations

import pytest

from kvmesh.commands.flags import config_from_args
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.dp.eplb_config import EPLBConfig
from kvmesh.engine.dp.frontdoor import FrontDoor
from kvmesh.engine.dp.surfaces import merge_event_sources, merge_metrics
from kvmesh.protocol.openai import APIError


def test_parallel_flags_are_validated() -> None:
    assert EngineConfig(data_parallel_size=2, data_parallel_rank=1).data_parallel_rank == 1
    ep = {"data_parallel_size": 2, "enable_expert_parallel": True}
    eplb = {**ep, "enable_eplb": True}
    for bad, match in (
        ({"data_parallel_size": 0}, "data-parallel-size"),
        ({"data_parallel_size": 2, "data_parallel_rank": 2}, "data-parallel-rank"),
        ({"data_parallel_rpc_port": 70000}, "rpc-port"),
        ({**ep, "expert_placement_strategy": "random"}, "placement"),
        ({"enable_expert_parallel": True}, "data-parallel-size 2"),
        ({"data_parallel_size": 2, "enable_eplb": True}, "needs --enable-expert-parallel"),
        ({**ep, "eplb_config": "{}"}, "needs --enable-eplb"),
        ({**eplb, "eplb_config": '{"nope": 1}'}, "unknown keys"),
        ({**eplb, "eplb_config": "[1]"}, "JSON object"),
        ({**eplb, "eplb_config": "{"}, "not valid JSON"),
        ({**eplb, "eplb_config": '{"num_redundant_experts": -1}'}, "num_redundant_experts"),
        ({**eplb, "eplb_config": '{"step_interval": 0}'}, "step_interval"),
        ({**eplb, "eplb_config": '{"policy": "greedy"}'}, "policy"),
    ):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad)
    cfg = EngineConfig(**eplb, eplb_config='{"num_redundant_experts": 2, "window_size": 8}')
    assert cfg.eplb() == EPLBConfig(num_redundant_experts=2, window_size=8)


def test_data_parallel_rank_flag_is_only_set_when_given() -> None:
    from kvmesh.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--data-parallel-size", "2"])
    assert "data_parallel_rank" not in vars(args)  # internal LB
    assert config_from_args(EngineConfig, args).data_parallel_rank == 0
    args = parser.parse_args(["serve", "--data-parallel-size", "2", "--data-parallel-rank", "1"])
    assert vars(args)["data_parallel_rank"] == 1  # external LB: this rank alone


def test_metrics_pages_merge_into_one_family_each() -> None:
    def page(rank: int) -> str:
        return (
            "# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="{rank}"}} {rank}.0\n'
            "# HELP vllm:cache_config_info Cache.\n# TYPE vllm:cache_config_info gauge\n"
            'vllm:cache_config_info{block_size="16"} 1.0\n'
        )

    merged = merge_metrics([page(0), page(1) + "# HELP x_total X.\n# TYPE x_total counter\n"])
    assert merged.splitlines() == [
        "# HELP vllm:num_requests_running Running.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0"} 0.0',
        'vllm:num_requests_running{engine="1"} 1.0',
        "# HELP vllm:cache_config_info Cache.",
        "# TYPE vllm:cache_config_info gauge",
        'vllm:cache_config_info{block_size="16"} 1.0',
        "# HELP x_total X.",
        "# TYPE x_total counter",
    ]
    assert merge_event_sources([{"1": {"endpoint": "b"}}, {"0": {"endpoint": "a"}}]) == {
        "0": {"endpoint": "a"},
        "1": {"endpoint": "b"},
    }


def test_front_door_picks_fewest_in_flight_and_honours_the_header() -> None:
    door = FrontDoor(3)
    for i in range(3):
        door.mark_ready(i, f"http://r{i}")
    door.ranks[0].in_flight, door.ranks[1].in_flight, door.ranks[2].in_flight = 2, 0, 1
    assert door.pick(None).rank == 1
    door.ranks[1].in_flight = 5
    assert door.pick(None).rank == 2
    assert door.pick(" 0 ").rank == 0  # the header wins over load
    for bad, status in (("x", 400), ("3", 400), ("-1", 400)):
        with pytest.raises(APIError) as err:
            door.pick(bad)
        assert err.value.status == status
    door.mark_down(0, "killed")
    with pytest.raises(APIError) as err:
        door.pick("0")
    assert err.value.status == 503
    for r in door.ranks:
        r.in_flight = 0
    assert {door.pick(None).rank for _ in range(4)} == {1, 2}  # ties rotate over the live ones
