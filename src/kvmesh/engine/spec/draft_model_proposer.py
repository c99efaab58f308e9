"""DraftModelProposer: a smaller model sharing the target's tokenizer drafts k tokens greedily,
over its own paged KV on TorchRunner.

The draft owns KV caches for all of its layers, indexed by the request's block table and the
target's slot numbering (the runner's num_blocks of them). Two passes per step:

- observe_step (every step): the draft over every scheduled request's verified rows, i.e.
  positions start .. num_computed_tokens - 1 of the step (prefill chunk rows, and the verified
  token plus accepted drafts of a verify step), reading all_token_ids[p] and writing its KV at
  p's slot. A request whose last verified row L = num_computed_tokens - 1 went through is kept
  for propose().
- propose: depth 1 feeds the newest token (position L + 1, which the target has not computed
  yet either), draft d is the argmax at position L + d, and depth d > 1 feeds draft d - 1. The
  rows at L + 1 .. L + k sit in the slots of the next step's token and drafts, which the
  scheduler reserves as lookahead (num_lookahead_tokens = k). All requests run batched per
  depth; a chain stops early at its limit, at the draft's max_model_len, or where the block
  table has no slot.

No rollback: a chain writes only positions past L, and observe_step overwrites each of them with
verified values before any row at a later position reads it.

Blocks reused from the prefix cache bring their draft rows along; blocks loaded from a tier or
a peer carry none. Either way only draft quality changes, never the output.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvmesh.engine.attention import AttentionMetadata, allocate_kv_cache
from kvmesh.engine.models.loader import DEFAULT_ALIASES, LoadedModel, load_model
from kvmesh.engine.scheduler import SchedulerOutput
from kvmesh.engine.sequence import Request
from kvmesh.engine.spec.config import SpeculativeConfig
from kvmesh.engine.spec.speculator import Proposer
from kvmesh.engine.spec.target_runner import TargetRunner
from kvmesh.protocol.tokenizer import DEFAULT_MODEL_NAME
from kvmesh.protocol.wording import plural

logger = logging.getLogger(__name__)


def load_draft(config: SpeculativeConfig, runner: TargetRunner) -> LoadedModel:
    """The draft model `config` names, on the runner's device and dtype: "smollm2" (or the
    embedded model's name) is the embedded SmolLM2, anything else a path load_model reads."""
    name = config.model
    if name in DEFAULT_ALIASES or name == DEFAULT_MODEL_NAME:
        name = None
    from safetensors import SafetensorError

    try:
        draft = load_model(name, device=runner.device, dtype=runner.dtype)
    except (ValueError, RuntimeError, KeyError, OSError, TypeError, SafetensorError) as e:
        raise ValueError(f"draft model {config.model!r} does not load: {e}") from e
    want, got = runner.model_config.vocab_size, draft.config.vocab_size
    if got != want:
        raise ValueError(
            f"draft model {config.model!r} has vocab_size {got}, the target {want}: "
            "a draft must share the target's tokenizer"
        )
    return draft


@dataclass(slots=True)
class _Tail:
    position: int  # L: the request's last verified position
    table: list[int]  # the request's block table when L was computed


class DraftModelProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, runner: TargetRunner) -> None:
        self.k = config.num_speculative_tokens or 1
        self.num_lookahead_tokens = self.k  # rows L + 1 .. L + k
        self.runner = runner
        loaded = load_draft(config, runner)
        self.model = loaded.model
        self.model_config = loaded.config
        # positions the draft computes: below its own limit (the config's) and its model's
        model_len = loaded.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        self.block_size = runner.config.block_size
        self.kv_caches = allocate_kv_cache(
            loaded.config, runner.num_blocks, self.block_size, runner.device, runner.dtype
        )
        self.tails: dict[str, _Tail] = {}
        size = sum(c.numel() * c.element_size() for c in self.kv_caches)
        logger.info(
            "draft model %s: %s, k=%d, max_model_len %d, KV %.1f MiB "
            "(%d blocks) on top of the target's",
            loaded.path,
            plural(loaded.config.num_hidden_layers, "layer"),
            self.k,
            self.max_model_len,
            size / 2**20,
            runner.num_blocks,
        )

    def _slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.runner.device)

    def _forward(self, ids, positions, slots, query_lens, context_lens, tables) -> torch.Tensor:
        meta = AttentionMetadata.build(slots, query_lens, context_lens, tables, self.runner.device)
        return self.model(self._tensor(ids), self._tensor(positions), self.kv_caches, meta)

    @torch.inference_mode()
    def observe_step(self, out: SchedulerOutput) -> None:
        rows = {r[0]: r for r in getattr(self.runner, "last_rows", ())}
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        for item in out.scheduled:
            req = item.request
            self.tails.pop(req.request_id, None)
            row = rows.get(req.request_id)
            if row is None:
                continue
            _, _, start, n, table = row
            # a finished request's rows still go in: its blocks may be in the prefix cache
            end = min(start + n, req.num_computed_tokens, self.max_model_len)
            if end <= start:
                continue
            ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self._slot(table, p) for p in range(start, end))
            query_lens.append(end - start)
            context_lens.append(end)
            tables.append(table)
            if end == req.num_computed_tokens and not req.is_finished:
                self.tails[req.request_id] = _Tail(end - 1, table)
        if ids:
            self._forward(ids, positions, slots, query_lens, context_lens, tables)

    @torch.inference_mode()
    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        active: list[int] = []  # requests whose draft KV holds every verified row
        tails: list[_Tail] = []
        for i, req in enumerate(requests):
            tail = self.tails.get(req.request_id)
            last = req.num_computed_tokens - 1
            if tail is not None and tail.position == last == len(req.all_token_ids) - 2:
                active.append(i)
                tails.append(tail)
        tokens = [requests[i].all_token_ids[-1] for i in active]
        depth = 1
        while True:
            # depth d's row sits at L + d: it needs a draft left, the draft's room, a slot
            go_on = [
                j
                for j, i in enumerate(active)
                if depth <= min(limits[i], self.k)
                and tails[j].position + depth < self.max_model_len
                and (tails[j].position + depth) // self.block_size < len(tails[j].table)
            ]
            if not go_on:
                return drafts
            active = [active[j] for j in go_on]
            tails = [tails[j] for j in go_on]
            tokens = [tokens[j] for j in go_on]
            pos = [t.position + depth for t in tails]
            hidden = self._forward(
                tokens,
                pos,
                [self._slot(t.table, p) for t, p in zip(tails, pos, strict=True)],
                [1] * len(pos),
                [p + 1 for p in pos],
                [t.table for t in tails],
            )
            tokens = self.model.compute_logits(hidden).argmax(-1).tolist()
            for i, token in zip(active, tokens, strict=True):
                drafts[i].append(token)
            depth += 1

    def forget(self, request_id: str) -> None:
        self.tails.pop(request_id, None)
