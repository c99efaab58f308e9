"""Credentials: --api-key on engine and router OpenAI routes, --admin-api-key on admin routes,
KV-transfer routes keyed or loopback-only, unguessable P/D transfer ids, shm segment limits, and
KV events bound no wider than the engine's HTTP host."""

from __future__ import annotations

import contextlib
import json
import re
import socket
from pathlib import Path

import pytest

from kvmesh.engine.auth import KV_TRANSFER_LOOPBACK_ONLY, check_kv_transfer
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.emulation.builder import EmulationConfig
from kvmesh.engine.emulation.host import EmulatedFleet
from kvmesh.protocol.auth import bearer_matches, held_blocks_token, is_loopback
from kvmesh.protocol.kv_transfer import PREFILL_REQUEST_PARAMS
from kvmesh.protocol.openai import APIError
from kvmesh.router.app import Router, RouterConfig, start_router
from tests.conftest import emulated_fleet
from tests.helpers import bound_port, free_port, free_ports, http, loop_thread

KEY, ADMIN, TRANSFER = "engine-key", "admin-key", "transfer-key"
COMPLETION = {"prompt": "Hello there.", "max_tokens": 2}
OPEN_ROUTES = ("/health", "/ping", "/metrics", "/version", "/load", "/kv_event_sources")


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_401(answer) -> None:
    code, headers, raw = answer
    err = json.loads(raw)["error"]
    assert code == 401 and err["code"] == 401 and err["type"] == "AuthenticationError"
    assert "Bearer" in err["message"] and KEY not in err["message"]
    assert headers.get("WWW-Authenticate") == "Bearer"


def test_engine_openai_routes_need_the_api_key_and_probes_stay_open(tokenizer):
    with emulated_fleet(tokenizer, engine={"api_key": KEY}) as (urls, _):
        url = urls[0]
        assert_401(http(url + "/v1/completions", COMPLETION))
        assert_401(http(url + "/v1/completions", COMPLETION, auth("wrong")))
        assert_401(http(url + "/v1/completions", COMPLETION, {"Authorization": KEY}))
        assert_401(http(url + "/v1/models"))
        assert_401(http(url + "/tokenize", {"prompt": "hi"}))
        assert_401(http(url + "/detokenize", {"tokens": [1, 2]}))
        assert http(url + "/v1/completions", COMPLETION, auth(KEY))[0] == 200
        assert http(url + "/v1/models", headers=auth(KEY))[0] == 200
        assert http(url + "/tokenize", {"prompt": "hi"}, auth(KEY))[0] == 200
        for path in OPEN_ROUTES:
            assert http(url + path)[0] == 200, path


@contextlib.contextmanager
def routed(tokenizer, engine: dict, **router_kw):
    """Two emulated engines behind a router (round-robin), on one event-loop thread."""
    fleet = EmulatedFleet(EngineConfig(**engine), EmulationConfig(), tokenizer, 2)

    async def start() -> tuple:
        urls = await fleet.start("127.0.0.1", 0)
        config = RouterConfig(endpoints=urls, preset="round-robin", kv_events=None, **router_kw)
        router = Router(config, tokenizer)
        return router, await start_router(router, "127.0.0.1", 0)

    async def stop(state: tuple) -> None:
        await state[1].cleanup()
        await fleet.stop()

    with loop_thread(start, stop) as ((_, server), _loop):
        yield f"http://127.0.0.1:{bound_port(server)}"


def test_router_checks_clients_and_sends_its_endpoint_key(tokenizer):
    with routed(tokenizer, {"api_key": KEY}, api_key="router-key", endpoint_api_key=KEY) as url:
        assert_401(http(url + "/v1/completions", COMPLETION))
        assert_401(http(url + "/v1/completions", COMPLETION, auth(KEY)))  # the engines' key
        assert_401(http(url + "/v1/models"))
        for _ in range(2):  # both engines, round robin
            assert http(url + "/v1/completions", COMPLETION, auth("router-key"))[0] == 200
        assert http(url + "/v1/models", headers=auth("router-key"))[0] == 200
        assert http(url + "/metrics")[0] == 200 and http(url + "/health")[0] in (200, 503)


def test_router_endpoint_key_defaults_to_its_own_and_else_passes_the_client_header(tokenizer):
    with routed(tokenizer, {"api_key": KEY}, api_key=KEY) as url:
        assert http(url + "/v1/completions", COMPLETION, auth(KEY))[0] == 200
    with routed(tokenizer, {"api_key": KEY}) as url:  # no router keys: the engine decides
        assert http(url + "/v1/completions", COMPLETION, auth(KEY))[0] == 200
        assert_401(http(url + "/v1/completions", COMPLETION))


def test_admin_routes_are_absent_without_an_admin_key(tokenizer, monkeypatch):
    monkeypatch.setenv("KVMESH_DEV_MODE", "1")
    with emulated_fleet(tokenizer, engine={"api_key": KEY}, fault_error_rate=1.0) as (urls, _):
        for path in ("/admin/faults", "/admin/timing"):
            code, _, raw = http(urls[0] + path, headers=auth(KEY))
            assert code == 404 and json.loads(raw)["error"]["code"] == 404
        assert http(urls[0] + "/admin/faults", {"error_rate": 0}, auth(KEY))[0] == 404
        assert http(urls[0] + "/reset_prefix_cache", b"", auth(KEY))[0] == 404
        # faults given as flags at start work without any key
        assert http(urls[0] + "/v1/completions", COMPLETION, auth(KEY))[0] == 500


def test_admin_routes_need_the_admin_key(tokenizer, monkeypatch):
    monkeypatch.setenv("KVMESH_DEV_MODE", "1")
    engine = {"api_key": KEY, "admin_api_key": ADMIN}
    with emulated_fleet(tokenizer, engine=engine) as (urls, _):
        url = urls[0]
        assert_401(http(url + "/admin/faults"))
        assert_401(http(url + "/admin/faults", {"error_rate": 1.0}, auth("wrong")))
        assert_401(http(url + "/admin/timing", headers=auth(KEY)))  # the API key is not it
        assert_401(http(url + "/reset_prefix_cache", b""))
        code, _, raw = http(url + "/admin/faults", {"error_rate": 0.5}, auth(ADMIN))
        assert code == 200 and json.loads(raw)["config"]["error_rate"] == 0.5
        assert http(url + "/admin/timing", headers=auth(ADMIN))[0] == 200
        assert http(url + "/reset_prefix_cache", b"", auth(ADMIN))[0] == 200


def test_kv_transfer_check_without_a_key_admits_loopback_callers_only():
    for remote in ("127.0.0.1", "::1", "::ffff:127.0.0.1", "127.8.0.1"):
        check_kv_transfer(None, "POST", "/kv_transfer/blocks", None, remote)
    for remote in ("10.0.0.5", "192.168.1.2", "::ffff:10.0.0.5", "fe80::1", "", None, "x"):
        with pytest.raises(APIError) as err:
            check_kv_transfer(None, "POST", "/kv_transfer/blocks", None, remote)
        assert err.value.status == 403 and err.value.message == KV_TRANSFER_LOOPBACK_ONLY
        assert "--kv-transfer-api-key" in err.value.message
    assert is_loopback("[::1]") and not is_loopback("localhost.evil")


def test_kv_transfer_check_with_a_key_requires_it_from_everyone():
    for remote in ("127.0.0.1", "10.0.0.5"):
        for header in (None, "Bearer wrong", TRANSFER, f"Basic {TRANSFER}"):
            with pytest.raises(APIError) as err:
                check_kv_transfer(TRANSFER, "POST", "/kv_transfer/blocks", header, remote)
            assert err.value.status == 401
        check_kv_transfer(TRANSFER, "POST", "/kv_transfer/blocks", f"Bearer {TRANSFER}", remote)
    # a held-blocks read also takes the token of that one transfer id, and only there
    token = f"Bearer {held_blocks_token(TRANSFER, 'abc')}"
    check_kv_transfer(TRANSFER, "GET", "/kv_transfer/abc", token, "10.0.0.5")
    for method, path in (("GET", "/kv_transfer/abd"), ("POST", "/kv_transfer/abc")):
        with pytest.raises(APIError):
            check_kv_transfer(TRANSFER, method, path, token, "10.0.0.5")
    assert bearer_matches("bearer  k", "k") and not bearer_matches("Bearer k2", "k")


def test_kv_transfer_routes_refuse_a_missing_key(tokenizer):
    blocks = {"block_hashes": ["00" * 32], "first_block": 0}
    for engine, key in (({"kv_transfer_api_key": TRANSFER}, TRANSFER), ({"api_key": KEY}, KEY)):
        with emulated_fleet(tokenizer, engine=engine) as (urls, _):
            assert_401(http(urls[0] + "/kv_transfer/blocks", blocks))
            assert_401(http(urls[0] + "/kv_transfer/some-id"))
            assert http(urls[0] + "/kv_transfer/blocks", blocks, auth(key))[0] == 404  # a miss
    with emulated_fleet(tokenizer) as (urls, _):  # no key: loopback callers (these tests)
        assert http(urls[0] + "/kv_transfer/blocks", blocks)[0] == 404


def test_pd_transfer_id_is_minted_and_the_request_id_reads_nothing(tokenizer):
    engine = {
        "num_gpu_blocks": 2048,
        "kv_transfer_config": json.dumps({"kv_connector": "NixlConnector"}),
        "kv_transfer_api_key": TRANSFER,
    }
    prompt = "The repository layout is as follows. " * 30
    body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": PREFILL_REQUEST_PARAMS}
    rid = {"X-Request-Id": "client-chosen"}
    with emulated_fleet(tokenizer, count=2, engine=engine) as (urls, fleet):
        ids = []
        for _ in range(2):
            code, _, raw = http(urls[0] + "/v1/completions", body, rid)
            params = json.loads(raw)["kv_transfer_params"]
            assert code == 200 and params["do_remote_prefill"]
            ids.append(params["remote_request_id"])
        assert ids[0] != ids[1] and all(re.fullmatch(r"[\w-]{22}", i) for i in ids)
        assert "client-chosen" not in ids[0]
        held = fleet.bundles[0].engine.core.held.held
        assert set(held) == set(ids)
        for path in ("client-chosen", "cmpl-client-chosen", ids[0]):  # no key: refused
            assert http(urls[0] + f"/kv_transfer/{path}")[0] == 401
        code = http(urls[0] + "/kv_transfer/client-chosen", headers=auth(TRANSFER))[0]
        assert code == 404 and set(held) == set(ids)
        # the decode engine reads by the minted id, with a token for that read
        decode = {"prompt": prompt, "max_tokens": 2, "kv_transfer_params": params}
        out = json.loads(http(urls[1] + "/v1/completions", decode)[2])
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert set(held) == {ids[0]}


def listening_addresses(port: int) -> set[str]:
    """Local addresses listening on a TCP port, from /proc/net/tcp{,6} (hex, as the kernel
    writes them)."""
    found = set()
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net") / name
        if not path.exists():
            pytest.skip("needs Linux /proc/net")
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(addr)
    return found


@pytest.mark.parametrize(
    ("host", "expected"), [("127.0.0.1", {"0100007F"}), ("0.0.0.0", {"00000000"})]
)
def test_wildcard_event_endpoint_binds_the_http_host_only(tokenizer, host, expected):
    from kvmesh.engine.emulation.builder import build_emulated_engine

    port, replay = free_port(), free_port()
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}
    events["replay_endpoint"] = f"tcp://*:{replay}"
    config = EngineConfig(kv_events_config=json.dumps(events), host=host)
    bundle = build_emulated_engine(config, EmulationConfig(), tokenizer)
    try:
        assert bundle.publisher.endpoint == f"tcp://{host}:{port}"
        assert listening_addresses(port) == expected
        assert listening_addresses(replay) == expected
    finally:
        bundle.close()


def test_bind_endpoint():
    from kvmesh.protocol.zmq_events import bind_endpoint

    assert bind_endpoint("tcp://*:5557", "127.0.0.1") == "tcp://127.0.0.1:5557"
    assert bind_endpoint("tcp://*:5557", "::1") == "tcp://[::1]:5557"
    assert bind_endpoint("tcp://*:5557", None) == "tcp://*:5557"
    assert bind_endpoint("ipc:///tmp/kv", "127.0.0.1") == "ipc:///tmp/kv"
    assert bind_endpoint("tcp://10.0.0.1:5557", "127.0.0.1") == "tcp://10.0.0.1:5557"


def test_shm_segments_outstanding_are_limited(tmp_path):
    import asyncio

    from kvmesh.engine.shm_transfer import SegmentWriter

    async def run() -> None:
        writer = SegmentWriter(tmp_path, max_segments=2)
        first = await writer.answer([b"x" * 100])
        assert first and await writer.answer([b"y" * 100])
        assert await writer.answer([b"z"]) is None  # two outstanding: bytes instead
        (tmp_path / first["shm_name"]).unlink()  # the puller collected one
        assert await writer.answer([b"z"])
        writer.close()
        small = SegmentWriter(tmp_path, max_share=0.0)
        assert await small.answer([b"x"]) is None
        assert not list(tmp_path.iterdir())

    asyncio.run(run())


def test_keys_from_flags_or_environment(monkeypatch):
    from kvmesh.cli import build_parser
    from kvmesh.commands.router import router_config_from
    from kvmesh.commands.serve import _engine_config

    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    monkeypatch.setenv("KVMESH_ADMIN_API_KEY", "admin-env")
    monkeypatch.delenv("KVMESH_KV_TRANSFER_API_KEY", raising=False)
    config = _engine_config(build_parser().parse_args(["serve", "--host", "0.0.0.0"]))
    assert (config.api_key, config.admin_api_key, config.kv_transfer_api_key) == (
        "from-env",
        "admin-env",
        None,
    )
    assert config.host == "0.0.0.0" and "from-env" not in repr(config)
    args = build_parser().parse_args(["serve", "--api-key", "flag"])
    assert _engine_config(args).api_key == "flag"
    rargs = build_parser().parse_args(["router", "--endpoint", "http://e:1"])
    rcfg = router_config_from(rargs, rargs.endpoint)
    assert rcfg.api_key == "from-env" and rcfg.upstream_authorization(None) == "Bearer from-env"
    assert RouterConfig().upstream_authorization("Bearer c") == "Bearer c"
    for bad in ("two words", "line\r\nX-Injected: 1", ""):
        with pytest.raises(ValueError):
            EngineConfig(api_key=bad)
        with pytest.raises(ValueError):
            RouterConfig(endpoint_api_key=bad)


def test_keyed_peer_pull_and_pd_through_the_router(tokenizer):
    """With keys everywhere: an engine pulls a peer's blocks with the KV-transfer key, and
    P/D through the router sends the endpoint key on both legs; the decode engine reads the
    held blocks with the token of that transfer."""
    import yaml

    from tests.test_router_pd import PD_CONFIG

    base, port = free_ports(2), free_port()
    engine = EngineConfig(
        num_gpu_blocks=2048,
        api_key=KEY,
        kv_transfer_api_key=TRANSFER,
        kv_peer_allowlist=f"127.0.0.1:{base}",
        kv_transfer_config=json.dumps({"kv_connector": "NixlConnector"}),
    )
    fleet = EmulatedFleet(
        engine, EmulationConfig(emulate_ttft_ms=20.0, emulate_itl_ms=5.0), tokenizer, 2
    )
    tmp = Path(__import__("tempfile").mkdtemp())

    async def start() -> tuple:
        urls = await fleet.start("127.0.0.1", base)
        roles = [{"url": urls[0], "labels": {"llm-d.ai/role": "prefill"}}]
        roles.append({"url": urls[1], "labels": {"llm-d.ai/role": "decode"}})
        (tmp / "endpoints.yaml").write_text(yaml.safe_dump(roles))
        (tmp / "epp.yaml").write_text(PD_CONFIG)
        config = RouterConfig(
            endpoints_file=str(tmp / "endpoints.yaml"),
            scheduler_config=str(tmp / "epp.yaml"),
            kv_events=None,
            api_key="router-key",
            endpoint_api_key=KEY,
        )
        router = Router(config, tokenizer)
        return router, await start_router(router, "127.0.0.1", port), urls

    async def stop(state: tuple) -> None:
        await state[1].cleanup()
        await fleet.stop()

    with loop_thread(start, stop) as ((_, _, urls), _loop):
        text = "A peer holds this long shared context already. " * 20
        body = {"prompt": text, "max_tokens": 2}
        assert http(urls[0] + "/v1/completions", body, auth(KEY))[0] == 200
        headers = {"x-kv-cache-source-host-port": f"127.0.0.1:{base}", **auth(KEY)}
        out = json.loads(http(urls[1] + "/v1/completions", body, headers)[2])
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # pulled, keyed
        prompt = "An uncached context for prefill and decode. " * 40
        body = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True}
        code, headers, raw = http(
            f"http://127.0.0.1:{port}/v1/completions", body, auth("router-key")
        )
        assert code == 200 and headers["x-kvmesh-endpoint"] == urls[1]
        assert json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert fleet.bundles[0].faults.num_requests == 2  # the peer's own and the prefill leg
        assert not fleet.bundles[0].engine.core.held.held  # read with the transfer's token


def raw_answer(url: str, data: bytes, whole: bool = False) -> bytes:
    """What the server answers to data: up to the end of the first head, or (``whole``) all
    it sends until it closes."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(data)
        out = b""
        while (whole or b"\r\n\r\n" not in out) and (chunk := sock.recv(65536)):
            out += chunk
        return out


def test_100_continue_only_once_the_key_is_checked_and_no_key_is_echoed(tokenizer):
    post = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
    wait = b"Expect: 100-continue\r\n\r\n"
    secret = "sk-SECRET-never-echoed"
    malformed = post + f"Authorization: Bearer {secret}\x01\r\n\r\n{{}}".encode()
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(emulated_fleet(tokenizer, engine={"api_key": KEY}))[0][0]
        router = stack.enter_context(routed(tokenizer, {"api_key": KEY}, api_key=KEY))
        for url in (engine, router):
            refused = raw_answer(url, post + b"Authorization: Bearer wrong\r\n" + wait)
            assert refused.startswith(b"HTTP/1.1 401"), refused
            assert raw_answer(url, post + f"Authorization: Bearer {KEY}\r\n".encode() + wait) == (
                b"HTTP/1.1 100 Continue\r\n\r\n"
            )
            answer = raw_answer(url, malformed, whole=True).decode("latin-1")
            assert " 400 " in answer.split("\r\n")[0] and secret not in answer
            assert json.loads(answer.partition("\r\n\r\n")[2])["error"]["code"] == 400
