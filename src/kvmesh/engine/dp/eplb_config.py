"""EPLBConfig: vLLM's --eplb-config JSON (expert-parallel load balancing), validated once."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EPLBConfig:
    window_size: int = 1000  # steps of expert load kept for the next rebalance
    step_interval: int = 3000  # steps between rebalances
    num_redundant_experts: int = 0  # extra physical expert slots for replicas of hot experts
    log_balancedness: bool = False
    use_async: bool = False
    policy: str = "default"
    communicator: str | None = None

    def __post_init__(self) -> None:
        for name in ("window_size", "step_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--eplb-config {name} must be a positive integer")
        n = self.num_redundant_experts
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError("--eplb-config num_redundant_experts must be a non-negative integer")
        if self.policy != "default":
            raise ValueError(f"--eplb-config policy {self.policy!r} is unknown; use 'default'")
        if self.use_async or self.communicator is not None:
            logger.warning(
                "--eplb-config use_async / communicator are ignored: kvmesh "
                "rebalances synchronously, over the ranks' own process group"
            )

    @classmethod
    def from_json(cls, text: str | None) -> EPLBConfig:
        if not text:
            return cls()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--eplb-config is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--eplb-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--eplb-config has unknown keys {unknown}; known: {sorted(known)}")
        return cls(**raw)
