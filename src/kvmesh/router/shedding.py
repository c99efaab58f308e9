"""Load shedding at the endpoint picker, as the Gateway API Inference Extension defines it: a
request names its InferenceObjective in the ``x-gateway-inference-objective`` header; the
objective's ``spec.priority`` (higher first, 0 when unnamed or unknown) makes a request with a
negative priority sheddable; while the pool is saturated (no endpoint in rotation has capacity:
fewer than ``queue_depth_threshold`` requests waiting and KV cache usage under
``kv_cache_util_threshold``) a sheddable request is answered 429 instead of queued.

The objectives come from a YAML file of InferenceObjective manifests (``kubectl get
inferenceobjectives -o yaml`` writes one), read at start.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint

OBJECTIVE_HEADER = "x-gateway-inference-objective"
SATURATED = "The inference pool is saturated and this request's objective is sheddable."


def load_objectives(path: str) -> dict[str, int]:
    """InferenceObjective name -> priority, from a YAML file of manifests (several documents,
    or a List's items). Raises ValueError on anything else."""
    try:
        with open(path) as f:
            documents = [d for d in yaml.safe_load_all(f) if d]
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--inference-objectives {path}: {exc}") from exc
    objects: list = []
    for document in documents:
        is_list = isinstance(document, dict) and document.get("kind") == "List"
        objects.extend(document.get("items") or [] if is_list else [document])
    priorities: dict[str, int] = {}
    for obj in objects:
        if not isinstance(obj, dict) or obj.get("kind") != "InferenceObjective":
            raise ValueError(f"--inference-objectives {path}: not an InferenceObjective: {obj!r}")
        name = (obj.get("metadata") or {}).get("name")
        priority = (obj.get("spec") or {}).get("priority", 0)
        if not isinstance(name, str) or not name:
            raise ValueError(f"--inference-objectives {path}: an objective without a name")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"--inference-objectives {path}: {name}: priority must be an integer")
        priorities[name] = priority
    return priorities


@dataclass(slots=True)
class Shedding:
    priorities: dict[str, int] = field(default_factory=dict)
    queue_depth_threshold: float = 5.0
    kv_cache_util_threshold: float = 0.8

    def priority(self, headers: Mapping[str, str]) -> int:
        return self.priorities.get(headers.get(OBJECTIVE_HEADER, ""), 0)

    def has_capacity(self, e: Endpoint) -> bool:
        return e.waiting < self.queue_depth_threshold and e.kv_usage < self.kv_cache_util_threshold

    def sheds(self, headers: Mapping[str, str], candidates: Iterable[Endpoint]) -> bool:
        """Whether the request is sheddable and no candidate has capacity (with no candidate
        at all the answer is 503, not 429: not saturated, down)."""
        if self.priority(headers) >= 0:
            return False
        candidates = list(candidates)
        return bool(candidates) and not any(self.has_capacity(e) for e in candidates)
