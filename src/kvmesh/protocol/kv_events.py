"""vLLM KV cache events (``vllm/distributed/kv_events.py``) and their msgpack codec.

Events are msgspec structs tagged by class name with ``omit_defaults``. Two wire encodings:

- "map" (vLLM >= 0.24): each event is ``{"type": "BlockStored", field: value, ...}``; fields
  with defaults are omitted when equal to them, required fields appear even when null.
- "array" (vLLM <= 0.23): each event is ``["BlockStored", f1, f2, ...]`` in field order. We drop
  trailing default-valued fields; msgspec itself ignores omit_defaults for array_like structs
  (msgspec issue #720), so real vLLM arrays carry every field, trailing nulls included.

The batch is always the array ``[ts, [events...], data_parallel_rank]`` (rank null if unset).
``decode_batch`` accepts both encodings, older short arrays and unknown newer fields.
"""

from __future__ import annotations

import typing
from typing import Any, Literal

import msgspec


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True):
    """Base of all KV events; the wire tag is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # deprecated upstream, still on the wire
    medium: str | None  # "GPU", "CPU", "STORAGE"
    lora_name: str | None
    extra_keys: list[Any] | None = None  # one entry (tuple or None) per block
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_TYPES: tuple[type[KVCacheEvent], ...] = (BlockStored, BlockRemoved, AllBlocksCleared)
Encoding = Literal["map", "array"]
ENCODINGS = ("map", "array")


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


# Leading fields every version of an event has carried; later ones may be absent on the wire.
_ALWAYS_PRESENT = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}


def _lenient_twin(cls: type[KVCacheEvent], array_like: bool) -> type[msgspec.Struct]:
    """A decode-only copy of ``cls`` whose later fields are optional (default None)."""
    hints = typing.get_type_hints(cls)
    n_always = _ALWAYS_PRESENT[cls.__name__]
    fields: list[Any] = []
    for i, name in enumerate(cls.__struct_fields__):
        if i < n_always:
            fields.append((name, hints[name]))
        else:
            fields.append((name, hints[name] | None, None))
    prefix = "_Array" if array_like else "_Map"
    return msgspec.defstruct(prefix + cls.__name__, fields, tag=cls.__name__, array_like=array_like)


_MAP_TWINS = {cls: _lenient_twin(cls, array_like=False) for cls in EVENT_TYPES}
_ARRAY_TWINS = {cls: _lenient_twin(cls, array_like=True) for cls in EVENT_TYPES}
_TWIN_TO_PUBLIC = {twin: cls for d in (_MAP_TWINS, _ARRAY_TWINS) for cls, twin in d.items()}
_FIELDS = {cls: cls.__struct_fields__ for cls in EVENT_TYPES}


class _WireBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_map_event_decoder = msgspec.msgpack.Decoder(
    _MAP_TWINS[BlockStored] | _MAP_TWINS[BlockRemoved] | _MAP_TWINS[AllBlocksCleared]
)
_array_event_decoder = msgspec.msgpack.Decoder(
    _ARRAY_TWINS[BlockStored] | _ARRAY_TWINS[BlockRemoved] | _ARRAY_TWINS[AllBlocksCleared]
)
_batch_decoder = msgspec.msgpack.Decoder(_WireBatch)
_encoder = msgspec.msgpack.Encoder()


def _to_array(event: KVCacheEvent) -> list[Any]:
    """``[tag, f1, f2, ...]`` with trailing default-valued fields dropped (vLLM <= 0.23)."""
    cls = type(event)
    names = _FIELDS[cls]
    defaults = cls.__struct_defaults__  # aligned with the last len(defaults) fields
    n_required = len(names) - len(defaults)
    values = [getattr(event, name) for name in names]
    n = len(values)
    while n > n_required and values[n - 1] == defaults[n - 1 - n_required]:
        n -= 1
    return [cls.__name__, *values[:n]]


def encode_batch(batch: KVEventBatch, encoding: Encoding = "map") -> bytes:
    """msgpack payload of one batch in the given event encoding."""
    if encoding == "map":
        return _encoder.encode(batch)
    if encoding == "array":
        events = [_to_array(e) for e in batch.events]
        return _encoder.encode([batch.ts, events, batch.data_parallel_rank])
    raise ValueError(f"unknown KV event encoding {encoding!r}; expected one of {ENCODINGS}")


# msgpack first-byte ranges: fixmap 0x80-0x8f, map16 0xde, map32 0xdf.
def _is_map(raw: memoryview) -> bool:
    first = raw[0]
    return 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)


def _decode_event(raw: msgspec.Raw) -> Event:
    buf = memoryview(raw)
    if not buf:
        raise msgspec.DecodeError("empty KV event")
    decoder = _map_event_decoder if _is_map(buf) else _array_event_decoder
    twin = decoder.decode(buf)
    cls = _TWIN_TO_PUBLIC[type(twin)]
    return cls(**{name: getattr(twin, name) for name in _FIELDS[cls]})


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a batch in either encoding; raises msgspec.DecodeError (a ValueError) if bad."""
    wire = _batch_decoder.decode(payload)
    events = [_decode_event(raw) for raw in wire.events]
    return KVEventBatch(ts=wire.ts, events=events, data_parallel_rank=wire.data_parallel_rank)
