"""TargetRunner: what a drafter with its own paged KV (spec.mtp_proposer, spec.draft_model_proposer)
reads of the target's runner (engine.torch_runner.TorchRunner), so that spec needs no import of
the runner that builds its proposers."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.models.llama import LlamaForCausalLM
from kvmesh.engine.models.model_config import ModelConfig


class TargetRunner(Protocol):
    """The target model's runner as drafters see it: the model and its config, the device and
    dtype to allocate on, the number of KV blocks (slot numbering is shared), and after each
    step the hidden states it computed with their rows per request (last_rows)."""

    config: EngineConfig
    model: LlamaForCausalLM
    model_config: ModelConfig
    model_path: Path | None
    device: torch.device
    dtype: torch.dtype
    num_blocks: int
    last_hidden: torch.Tensor
