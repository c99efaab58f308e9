"""A tiny round-robin HTTP balancer, the front of router replicas in `kvmesh bench fleet
--router-replicas`: each request goes to the next upstream in turn with its method, path, query,
headers (hop-by-hop ones dropped) and body, and the answer streams back with the upstream's
status and headers, as a Kubernetes Service balancing per request or Envoy's ROUND_ROBIN would.
No retries, no health checks. GET /health is its own; GET /metrics counts the requests sent to
each upstream as kvmesh_router_requests_total{endpoint, outcome} (outcome ok below status 400).

    python -m kvmesh.bench.rr_front --port 8000 http://127.0.0.1:8101 http://127.0.0.1:8102
"""

from __future__ import annotations

import argparse
import contextlib
import itertools

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

# not passed on in either direction (RFC 9110 7.6.1, plus what the client session sets itself)
HOP = frozenset(
    ("connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer")
    + ("upgrade", "host", "content-length")
)
FRONT_HEADER = "x-kvmesh-front"  # on answers: the upstream that served
HTTP = web.AppKey("http", aiohttp.ClientSession)  # the upstream session


def make_app(upstreams: list[str]) -> web.Application:
    app = web.Application(client_max_size=64 * 2**20)
    turn = itertools.cycle(upstreams)
    counts: dict[tuple[str, str], int] = {}

    async def session(app: web.Application):
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        app[HTTP] = aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False
        )
        yield
        await app[HTTP].close()

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics(request: web.Request) -> web.Response:
        lines = ["# TYPE kvmesh_router_requests_total counter"]
        for (up, outcome), n in counts.items():
            lines.append(f'kvmesh_router_requests_total{{endpoint="{up}",outcome="{outcome}"}} {n}')
        return web.Response(text="\n".join(lines) + "\n")

    async def proxy(request: web.Request) -> web.StreamResponse:
        up = next(turn)
        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in HOP)
        body = await request.read()
        url = up + request.rel_url.raw_path_qs
        try:
            async with app[HTTP].request(request.method, url, headers=headers, data=body) as r:
                kept = CIMultiDict((k, v) for k, v in r.headers.items() if k.lower() not in HOP)
                kept.add(FRONT_HEADER, up)
                out = web.StreamResponse(status=r.status, headers=kept)
                await out.prepare(request)
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                outcome = "ok" if r.status < 400 else f"http_{r.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            counts[up, "connect_error"] = counts.get((up, "connect_error"), 0) + 1
            msg = {"message": f"upstream {up}: {type(exc).__name__}", "type": "BadGateway"}
            return web.json_response({"error": {**msg, "code": 502}}, status=502)
        counts[up, outcome] = counts.get((up, outcome), 0) + 1
        return out

    app.cleanup_ctx.append(session)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("upstreams", nargs="+", help="Base URLs, taken in turn.")
    args = parser.parse_args(argv)
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    upstreams = [u.rstrip("/") for u in args.upstreams]
    web.run_app(make_app(upstreams), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
