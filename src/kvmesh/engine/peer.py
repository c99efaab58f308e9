"""Peer sharing: before computing a request, pull the prefix blocks it lacks from a peer engine.

The router (or any client) names the source as llm-d's P2P flow does, in the header
`x-kv-cache-source-host-port: host:port`, or in the body as `kv_transfer_params.kvmesh_peer`.
The engine first takes what it holds itself (device, then its lower tiers), then asks the peer
for the rest by block hash (`POST /kv_transfer/blocks`); the peer answers with the longest run
it holds, from any of its tiers: as the HTTP body, or, when both engines share a host
(`--kv-peer-transport`), in a shared-memory segment (shm_transfer). Blocks are imported only
when their hashes equal those of the request's own tokens and the payload's checksum holds; a
refused, failed or partial pull leaves the rest to be computed, so a pull can make a request
faster but never change its output.
Only allow-listed peers (`--kv-peer-allowlist`) are contacted: the name comes from a request;
they alone get this engine's KV-transfer key (engine.auth), which their blocks route requires."""

from __future__ import annotations

import asyncio
import logging
import uuid
from urllib.parse import urlsplit

import aiohttp
import msgspec

from kvmesh.engine import shm_transfer
from kvmesh.engine.sequence import Request, SamplingParams
from kvmesh.protocol.auth import bearer
from kvmesh.protocol.openai import CompletionRequest, completion_prompts

logger = logging.getLogger(__name__)
PEER_HEADER = "x-kv-cache-source-host-port"
PEER_PARAM = "kvmesh_peer"
BLOCKS_ROUTE = "/kv_transfer/blocks"


def normalize_peer(peer: str) -> str | None:
    """'host:port' from 'host:port' or 'http://host:port[/...]'; None if it is neither."""
    peer = peer.strip()
    if not peer:
        return None
    parts = urlsplit(peer if "//" in peer else f"//{peer}")
    try:
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname or port is None:
        return None
    return f"{parts.hostname}:{port}"


def parse_allowlist(text: str | None) -> frozenset[str]:
    if not text:
        return frozenset()
    peers = {normalize_peer(p) for p in text.split(",")}
    if None in peers:
        raise ValueError(f"--kv-peer-allowlist entries must be host:port, got {text!r}")
    return frozenset(p for p in peers if p)


def named_peer(headers, raw_body: bytes) -> str | None:
    """The peer a request names, from the header or from kv_transfer_params.kvmesh_peer."""
    if PEER_HEADER in headers:
        return headers[PEER_HEADER]
    if PEER_PARAM.encode() not in raw_body:
        return None
    try:
        body = msgspec.json.decode(raw_body)
        peer = (body.get("kv_transfer_params") or {}).get(PEER_PARAM)
    except (msgspec.DecodeError, AttributeError):
        return None
    return peer if isinstance(peer, str) else None


async def prompt_token_ids(
    serving, path: str, raw_body: bytes
) -> tuple[list[list[int]], str | None]:
    """The prompts of a completion or chat request as token ids, and its cache_salt; long ones
    rendered and tokenized off the event loop, as the handler does."""
    if path.endswith("/chat/completions"):
        chat = await serving.parse_chat(raw_body)
        return [await serving.chat_ids(chat, None)], chat.cache_salt
    req = msgspec.json.decode(raw_body, type=CompletionRequest)
    ids = [
        await serving.tokenize(p, req.add_special_tokens, req.max_tokens, "prompt")
        if isinstance(p, str)
        else list(p)
        for p in completion_prompts(req.prompt)
    ]
    return ids, req.cache_salt


def device_room(core) -> int:
    """Tokens the device's free blocks can take now (engine thread)."""
    return core.kv.pool.num_free_blocks * core.kv.block_size


class PeerPuller:
    """Pulls for one engine; `allowlist` holds the host:port peers it may contact."""

    def __init__(
        self,
        bundle,
        allowlist: frozenset[str],
        timeout: float = 30.0,
        transport: str = "auto",
        key: str | None = None,
    ) -> None:
        self.bundle = bundle
        self.allowlist = allowlist
        self.timeout = timeout
        self.transport = transport  # config.PEER_TRANSPORTS: auto, tcp or shm
        # sent to allow-listed peers only (never to a host a request merely names)
        self.headers = {"Authorization": bearer(key)} if key else {}

    async def before_request(self, headers, path: str, raw_body: bytes) -> int:
        """Pull what the named peer holds for this request's prompts; tokens imported."""
        named = named_peer(headers, raw_body)
        if named is None:
            return 0
        peer = normalize_peer(named)
        metrics = self.bundle.metrics
        if peer is None or peer not in self.allowlist:
            logger.warning("KV peer %r is not allow-listed; computing instead", named)
            metrics.peer_pulls.labels(**metrics.labels, outcome="refused").inc()
            return 0
        try:
            prompts, salt = await prompt_token_ids(self.bundle.serving, path, raw_body)
        except Exception:  # noqa: BLE001 - the handler reports a bad request properly
            return 0
        total = 0
        for ids in prompts[:4]:
            total += await self.pull(peer, ids, salt)
        return total

    def wants_shm(self, peer: str) -> bool:
        """shm: always try shared memory; auto: when the peer is on this host; tcp: never."""
        if self.transport == "tcp" or not shm_transfer.available():
            return False
        own_host = self.bundle.engine.core.advertise[0]
        return self.transport == "shm" or shm_transfer.is_local_host(
            peer.rpartition(":")[0], own_host
        )

    async def pull(self, peer: str, token_ids: list[int], cache_salt: str | None = None) -> int:
        engine, metrics = self.bundle.engine, self.bundle.metrics
        rid = f"peer-{uuid.uuid4().hex}"
        probe = Request(rid, token_ids, SamplingParams(), cache_salt=cache_salt)
        first, hashes, room = await engine.call(
            lambda core: (*core.local_prefix(probe), device_room(core))
        )
        if first >= len(hashes):
            return 0  # this engine holds the whole prefix already
        if room < len(token_ids):
            # the device cannot hold this prompt now: imported blocks would only push out
            # cached ones (or be pushed out) before the request runs, so move nothing
            metrics.peer_pulls.labels(**metrics.labels, outcome="no_room").inc()
            return 0
        body: dict = {"block_hashes": [h.hex() for h in hashes], "first_block": first}
        if self.wants_shm(peer):
            body["transport"] = "shm"
        outcome, answer = await self._ask(peer, body)
        got: tuple[int, float] | None = None
        if isinstance(answer, dict):  # a shared-memory segment the peer wrote on this host
            got = await engine.call(lambda core: shm_transfer.import_segment(core, probe, answer))
            self._count("shm", "unreadable" if got is None else "ok" if got[0] else "failed")
            if got is None:  # gone, resized or refused: the same blocks over TCP instead
                del body["transport"]
                outcome, answer = await self._ask(peer, body)
        if isinstance(answer, bytes):

            def load(core) -> tuple[int, float]:  # the delay read with its own import
                return core.import_payload(probe, answer), core.last_import_seconds

            got = await engine.call(load)
            self._count("tcp", "ok" if got[0] else "failed")
        saved = 0
        if got is not None:
            saved, delay = got
            outcome = "ok" if saved else "failed"
            if saved and delay > 0:  # an emulated link: the blocks take this long to arrive
                await asyncio.sleep(delay * engine.time_scale)
        metrics.peer_pulls.labels(**metrics.labels, outcome=outcome).inc()
        if saved:
            metrics.peer_tokens.inc(saved)
        return saved

    async def _ask(self, peer: str, body: dict) -> tuple[str, bytes | dict | None]:
        """(outcome if nothing came, the payload's bytes or a segment's {shm_name, size})."""
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    f"http://{peer}{BLOCKS_ROUTE}",
                    json=body,
                    headers=self.headers,
                    timeout=aiohttp.ClientTimeout(total=self.timeout),
                ) as resp,
            ):
                if resp.status in (401, 403):
                    logger.warning(
                        "KV pull from peer %s refused (HTTP %d): give both engines the same "
                        "--kv-transfer-api-key",
                        peer,
                        resp.status,
                    )
                if resp.status != 200:
                    return ("miss" if resp.status == 404 else "failed"), None
                if resp.content_type == "application/json":
                    answer = await resp.json()
                    return "failed", answer if isinstance(answer, dict) else None
                return "failed", await resp.read()
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            logger.warning("KV pull from peer %s failed (%s); computing instead", peer, exc)
            return "failed", None

    def _count(self, transport: str, outcome: str) -> None:
        m = self.bundle.metrics
        m.peer_transfers.labels(**m.labels, transport=transport, outcome=outcome).inc()
