"""Progress of an engine's start, as log lines: which step is running (reading the weights file,
building the model, dequantizing, the tokenizer, the KV cache) and how far a long step has got,
so a start of tens of seconds is never silent. Lines go through logging (``kvmesh.engine.load``,
INFO), so ``--log-level WARNING`` quiets them with the rest."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

logger = logging.getLogger("kvmesh.engine.load")
T = TypeVar("T")
EVERY_S = 2.0  # a long step reports how far it has got at most this often


def step(text: str, *args: object) -> None:
    """One line as a step starts."""
    logger.info(text, *args)


def counted(
    items: Iterable[T],
    total: int,
    what: str,
    *,
    every_s: float = EVERY_S,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[T]:
    """Yields ``items`` unchanged. Invariant: a line "what: k/total (p%)" is logged at most every
    ``every_s`` seconds while they come, and one "what: total/total in S s" once the last of
    ``total`` has come (none when fewer came)."""
    start = last = clock()
    for done, item in enumerate(items, 1):
        yield item
        now = clock()
        if done == total:
            logger.info("%s: %d/%d in %.1f s", what, done, total, now - start)
        elif now - last >= every_s:
            last = now
            logger.info("%s: %d/%d (%d%%)", what, done, total, 100 * done // max(1, total))
