"""`kvmesh up`: the whole stack on this machine, as the processes a user would start by hand.

One `kvmesh serve` child runs the engine (or `--emulate N` emulated engines) on the ports after
--port, one `kvmesh router` child runs the router on --port, each with its own event loop and
interpreter, so the router's scrapes, KV-event ingestion and proxying never wait for engine
steps (nor for the GIL they hold). Invariants: every child is started with the flags the user
gave `up` (secrets go by environment, never argv); nothing starts while one of the ports is
taken (up_ports says by what); `kvmesh ready` is printed only once every child answers
GET /health on its own port; a child that fails before that stops the others and `up` exits
with its code (1 if it was 0); one that exits later is restarted with back-off, a crash loop
ends `up` (up_supervisor); no child outlives `up`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from kvmesh.commands import up_ports, up_supervisor
from kvmesh.commands.flags import Renamed, config_from_args, flag_of
from kvmesh.commands.serve import check_model, engine_settings, up_router_config
from kvmesh.commands.serve_flags import EMULATION_HELP, ENGINE_HELP
from kvmesh.commands.up_supervisor import START_TIMEOUT_S, RestartPolicy, Stack
from kvmesh.engine.config import EngineConfig
from kvmesh.protocol import auth
from kvmesh.protocol.wording import plural

SECRET_FIELDS = {  # EngineConfig field -> the environment variable its child reads it from
    "api_key": auth.API_KEY_ENV,
    "admin_api_key": auth.ADMIN_KEY_ENV,
    "kv_transfer_api_key": auth.KV_TRANSFER_KEY_ENV,
}
ROUTER_OWN = {"endpoints", "endpoints_file", "api_key", "endpoint_api_key", "kv_events"}


def flags_for(config, names: Iterable[str], renamed: Renamed | None = None) -> list[str]:
    """The command-line flags that give `config`'s fields `names` their values (those at the
    class default are left out): the inverse of commands.flags.config_from_args."""
    defaults, out = type(config)(), []
    for name in names:
        value = getattr(config, name)
        if value == getattr(defaults, name) or value is None:
            continue
        flag = flag_of(name, renamed)
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


def child_env(config: EngineConfig) -> dict[str, str]:
    """This process's environment with the engine's keys as its children read them, the
    kvmesh this process runs first on their path, and one NONE_HASH seed for all of them."""
    env = dict(os.environ)
    for name, var in SECRET_FIELDS.items():
        value = getattr(config, name)
        if value:
            env[var] = value
        else:
            env.pop(var, None)
    import kvmesh

    src = str(Path(kvmesh.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if not config.prefix_caching_hash_algo.startswith("sha256"):
        # xxhash roots its chain in a per-process random seed unless PYTHONHASHSEED is set:
        # engines and router in separate processes must share one (protocol.hashing.none_hash)
        env.setdefault("PYTHONHASHSEED", str(secrets.randbelow(2**32)))
    return env


def with_ipc_events(config: EngineConfig) -> tuple[EngineConfig, str | None]:
    """KV events over ipc:// in a fresh folder when none are configured: (config, folder)."""
    if config.kv_events_config:
        return config, None
    folder = tempfile.mkdtemp(prefix="kvmesh-")
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"ipc://{folder}/kv",
        "replay_endpoint": f"ipc://{folder}/replay",
    }
    return dataclasses.replace(config, kv_events_config=json.dumps(events)), folder


def kvmesh_command(args: argparse.Namespace, command: str) -> list[str]:
    level = getattr(args, "log_level", "INFO")
    return [sys.executable, "-m", "kvmesh.cli", "--log-level", level, command]


def engine_command(config: EngineConfig, emu, args: argparse.Namespace) -> list[str]:
    names = [n for n in ENGINE_HELP if n not in SECRET_FIELDS]
    cmd = [*kvmesh_command(args, "serve"), "--host", args.host, "--port", str(args.port + 1)]
    cmd += flags_for(config, names)
    if emu is not None:
        cmd += ["--emulate", str(args.emulate), *flags_for(emu, EMULATION_HELP)]
    return cmd


def router_command(rcfg, config: EngineConfig, args: argparse.Namespace) -> list[str]:
    from kvmesh.commands.router import ROUTER_HELP, ROUTER_RENAMED

    cmd = [*kvmesh_command(args, "router"), "--host", args.host, "--port", str(args.port)]
    for url in rcfg.endpoints:
        cmd += ["--endpoint", url]
    # the engines' block size among them: given, the router refuses an engine of another size
    cmd += flags_for(rcfg, [n for n in ROUTER_HELP if n not in ROUTER_OWN], ROUTER_RENAMED)
    if rcfg.kv_events is None:
        cmd += [flag_of("kv_events", ROUTER_RENAMED), "none"]
    if config.model:  # the router tokenizes as the engine does, with the model's tokenizer
        cmd += [flag_of("tokenizer", ROUTER_RENAMED), config.model]
    # on SIGTERM it drains its answers in progress, within the grace `up` gives it
    return cmd + ["--shutdown-timeout", str(up_supervisor.ROUTER_DRAIN_S)]


def _model_name(url: str, key: str | None) -> str:
    headers = {"Authorization": auth.bearer(key)} if key else {}
    try:
        req = urllib.request.Request(url + "/v1/models", headers=headers)
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.loads(resp.read())["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError):
        return "?"


def free_run(n: int, host: str = "127.0.0.1") -> int:
    """A port P with P .. P+n-1 all free (bound together to check), below the ephemeral range
    so no outgoing connection takes one meanwhile: `--port 0` puts the router on P and the
    engines, which one `kvmesh serve` puts on consecutive ports, after it."""
    for base in range(20_000 + os.getpid() % 5_000, 32_000 - n, 7):
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + n):
                    stack.enter_context(socket.socket()).bind((host, port))
            except OSError:
                continue
            return base
    raise OSError(f"no run of {n} free ports on {host}")


def cmd_up(args: argparse.Namespace) -> int:
    try:
        config, emu = engine_settings(args)
        up_router_config(config, args, [])  # its flags are checked before anything starts
        check_model(config, emu)
    except ValueError as exc:
        print(f"kvmesh {args.command}: {exc}", file=sys.stderr)
        return 2
    return run_up(config, emu, args)


def run_up(config: EngineConfig, emu, args: argparse.Namespace) -> int:
    """The engine(s) and the router as child processes until SIGINT/SIGTERM, a child's exit
    before the stack is ready, or a crash loop."""
    try:
        policy = config_from_args(RestartPolicy, args)
    except ValueError as exc:
        print(f"kvmesh up: {exc}", file=sys.stderr)
        return 2
    count = args.emulate if emu is not None else 1
    local = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    if args.port == 0:  # not port 0 + 1 .. for the engines: a run of free ports
        args.port = free_run(count + 1, local)
    roles = {args.port: "the router's"}
    for i in range(count):
        roles[args.port + 1 + i] = f"engine {i}'s" if count > 1 else "the engine's"
    taken = up_ports.taken(args.host, roles)
    if taken:
        for line in taken:
            print(f"kvmesh up: {line}", file=sys.stderr)
        print(
            "kvmesh up: nothing started; stop what holds them, or choose another --port "
            "(--port 0: free ones)",
            file=sys.stderr,
        )
        return 2
    config, folder = with_ipc_events(config)
    kind = plural(count, "emulated engine") if emu is not None else "the engine (loading its model)"
    print(
        f"kvmesh up: starting {kind} on port {args.port + 1}"
        + (f"-{args.port + count}" if count > 1 else "")
        + f", then the router on port {args.port} ...",
        flush=True,
    )
    engines = [f"http://{local}:{args.port + 1 + i}" for i in range(count)]
    rcfg = up_router_config(config, args, engines)
    stack = Stack(child_env(config), policy)
    # the children lead sessions of their own, so a terminal's Ctrl-C or hangup reaches only
    # this process, which passes it on as SIGTERM
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, stack.on_signal) for s in stops}
    code = 0
    try:
        what = f"{count} engines" if count > 1 else "engine"
        engine = stack.start("engine", what, engine_command(config, emu, args), engines)
        up = stack.wait_healthy(engine)
        if up:  # the router learns what the engines cache from their event replay at its start
            print(f"kvmesh up: starting the router on port {args.port} ...", flush=True)
            cmd = router_command(rcfg, config, args)
            urls = [f"http://{local}:{args.port}"]
            up = stack.wait_healthy(
                stack.start("router", "router", cmd, urls, drain=up_supervisor.ROUTER_DRAIN_S)
            )
        if not up:
            gone = stack.exited()
            if gone is not None and not stack.signalled:
                name, status = gone
                print(f"kvmesh up: the {name} exited with code {status}; stopping", file=sys.stderr)
                return status if status > 0 else 1
            if not stack.signalled:
                print(
                    f"kvmesh up: not healthy within {START_TIMEOUT_S:.0f} s; stopping",
                    file=sys.stderr,
                )
                return 1
            return 0
        served = (
            f"router, preset {rcfg.preset}"
            if emu is not None
            else f"router; model {_model_name(engines[0], config.api_key)}; engine {engines[0]}/v1"
        )
        print(f"kvmesh ready: http://{args.host}:{args.port}/v1 ({served})", flush=True)
        code = stack.supervise()
    finally:
        stack.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        restarts = stack.restarts()
        if any(restarts.values()):
            counts = ", ".join(f"{name} {n}" for name, n in restarts.items())
            print(f"kvmesh up: restarts while up: {counts}", file=sys.stderr)
    return code
