"""Where routed tokens go: the routing distribution over experts and the placement of experts
on expert-parallel ranks (vLLM's --expert-placement-strategy)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PLACEMENTS = ("linear", "round_robin")  # vLLM's --expert-placement-strategy


@dataclass(frozen=True, slots=True)
class ExpertRouting:
    """Which experts tokens pick: `uniform`, or `zipf` with exponent `zipf_s` (the i-th most
    popular expert of a layer gets mass proportional to 1 / i**s; the order is a seeded random
    permutation per layer, so hot experts are not where the placement puts low ids)."""

    distribution: str = "uniform"
    zipf_s: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.distribution not in ("uniform", "zipf"):
            raise ValueError("expert routing must be 'uniform' or 'zipf'")
        if self.zipf_s < 0:
            raise ValueError("the Zipf exponent must be >= 0")

    def probabilities(self, num_layers: int, num_experts: int) -> np.ndarray:
        """(layers, experts) probabilities that a token's pick is each expert; rows sum to 1."""
        if self.distribution == "uniform" or self.zipf_s == 0:
            return np.full((num_layers, num_experts), 1.0 / num_experts)
        mass = 1.0 / np.arange(1, num_experts + 1) ** self.zipf_s
        mass /= mass.sum()
        rng = np.random.default_rng(self.seed)
        return np.stack([mass[rng.permutation(num_experts)] for _ in range(num_layers)])


def expert_placement(num_experts: int, ep_size: int, strategy: str = "linear") -> np.ndarray:
    """The EP rank holding each expert: contiguous ranges (`linear`) or `round_robin`."""
    if strategy not in PLACEMENTS:
        raise ValueError(f"--expert-placement-strategy must be one of {PLACEMENTS}")
    if not 1 <= ep_size <= num_experts:
        raise ValueError(f"EP size {ep_size} must be between 1 and the {num_experts} experts")
    experts = np.arange(num_experts)
    if strategy == "round_robin":
        return experts % ep_size
    return np.concatenate(
        [np.full(len(c), r) for r, c in enumerate(np.array_split(experts, ep_size))]
    )
