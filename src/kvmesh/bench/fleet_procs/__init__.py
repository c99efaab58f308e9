"""The one launcher of a benchmark's servers: emulated engines, kvmesh routers, peer routers and
Envoy, as processes on chosen or free ports, each in a process group of its own, found, measured
and stopped together. A `kvmesh bench` scenario composes these parts:

- `procs`: `Proc` (a server in its own session, logging to a file: `tail`, `cpu_seconds`,
  `kill` as a crash, `stop`), `stop_all` (every one signalled at once), `start_healthy` (start
  until GET /health answers, on a given port or again on another free one), `healthy`,
  `wait_healthy` and `await_healthy` (the same wait for a started process, from threads or
  asyncio), `server_env`, `group_members` (CPU seconds of process groups and their
  descendants), `ADMIN_KEY` and `admin_headers`.
- `ports`: `free_port`, `free_run` (a run of free ports), `port_block` (a run below the
  ephemeral range, for servers restarted where their router looks), `taken_ports`.
- `engines`: `serve_command` (`kvmesh serve --emulate N`, KV events on given ports),
  `start_emulated` and `wait_for_urls` (the engines' URLs once printed), and two fleets:
  `zero_latency_engines` (what a router adds) and `start_fleet_engines` (a bench's GPU, model,
  time scale and serve flags).
- `serve`: `EngineProcess` (one `kvmesh serve` with any flags on a given port, healthy) and
  `engine_processes` (several started at once, stopped together).
- `routers`: `Target` (kind and policy of a router under test), `router_command`,
  `start_router`, `peer_bin` and `envoy_binary` (what is installed), `pinning` (servers on one
  CPU, the client on another), `served_model` and `post_status`.
"""
