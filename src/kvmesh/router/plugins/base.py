"""What every scheduling plugin shares: the request it schedules, what it may read from the
router, and the capabilities it declares, from which the router knows what a pipeline needs
(tokenizing, index lookups, KV-event subscriptions) without knowing the plugins."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from kvmesh.protocol.hashing import DEFAULT_BLOCK_SIZE

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint
    from kvmesh.router.plugins.state import SchedulingState

ROLE_LABEL = "llm-d.ai/role"


@dataclass(slots=True)
class SchedulingRequest:
    request_id: str
    model: str | None
    token_ids: Sequence[int]  # a list, or the router's compact array('I'): read, never changed
    block_keys: list[int]  # the engines' block hashes (event ints) of the full blocks
    headers: dict[str, str]
    block_size: int = DEFAULT_BLOCK_SIZE
    # set by Pipeline.schedule before any filter runs; read by every plugin of every profile
    # and by the forward's bookkeeping (router.forward_load)
    state: SchedulingState | None = None


class Plugin:
    """Capabilities a plugin declares (class attributes). A pipeline tokenizes prompts only if
    one of its plugins reads tokens, and looks each index up (before any filter, once per
    request, into the SchedulingState) only if one reads that index. Reading an index implies
    reading tokens: its keys are the prompt's blocks."""

    __slots__ = ()
    reads_tokens: ClassVar[bool] = False  # token ids or block keys, directly or through state
    reads_precise_index: ClassVar[bool] = False  # state.precise (the engines' KV events)
    reads_approximate_index: ClassVar[bool] = False  # state.approximate (the router's decisions)


class PrefixReader(Plugin):
    """A plugin that reads what both indexes say the endpoints cache (state.blocks_cached)."""

    __slots__ = ()
    reads_tokens = True
    reads_precise_index = True
    reads_approximate_index = True


class Filter(Protocol):
    name: str

    def filter(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> list[Endpoint]: ...


class Scorer(Protocol):
    """Maps each endpoint to a score in [0, 1]: a list, one score per endpoint in the order
    given (the pipeline runs it over hundreds of endpoints per request: no dict per scorer;
    ProfileResult.scores keys them by name when read)."""

    name: str

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]: ...


class Picker(Protocol):
    """Chooses one of `endpoints` from `totals`, their weighted totals in the same order."""

    name: str

    def pick(self, totals: list[float], endpoints: list[Endpoint]) -> Endpoint: ...


class PluginContext(Protocol):
    """What plugin factories and the pipeline may read: the indexes (router.app.Router)."""

    precise_index: Any
    approximate_index: Any
