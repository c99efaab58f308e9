"""MtpProposer: MTP drafting on TorchRunner, from the target's hidden states, over paged KV.

Each MTP layer owns one KV cache shaped like one target layer's, indexed by the request's block
table and the target's slot numbering. Two passes per step:

- observe_step (every step): depth 1 over every scheduled request's verified rows, i.e. the
  rows at positions p < num_computed_tokens after the update (prefill chunk rows, and the
  verified token plus accepted drafts of a verify step). Row p reads the next verified token
  all_token_ids[p + 1] and the target's final hidden state at p, and writes the layer's KV at
  p's slot. Its output g at the request's last verified row L is kept for propose().
- propose: draft 1 = argmax of the head's logits at g; depth d > 1 is a decode row at position
  L + d - 1 reading (draft d - 1, g of depth d - 1) and writing its KV into the lookahead slots
  the scheduler reserved (num_lookahead_tokens = k - 1). All requests run batched per depth.

The head is any of mtp.MultiTokenPredictor (a head file, or the target's own MTP layers read
by spec.target_mtp) or spec.eagle.EagleDrafter (an EAGLE-1 head, one layer): both map (token,
hidden state) rows to the next hidden state with the same interface and chaining.

A head with n layers serves depth d with layer (d - 1) % n and that layer's cache: a layer
other than the first attends only to rows its own chains wrote (depth 1's are the first's).

No rollback: a chain writes only positions past L, and depth 1 overwrites each of them with
verified values before any row at a later position reads it.

Blocks reused from the prefix cache bring their MTP rows along; the row at a block's last
position read the token after the block, so a request that continues differently drafts from a
slightly different row there. Blocks loaded from a tier or a peer carry no MTP rows. Either way
only draft quality changes, never the output.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvmesh.engine.attention import AttentionMetadata, allocate_kv_cache
from kvmesh.engine.models.llama import LlamaForCausalLM
from kvmesh.engine.scheduler import SchedulerOutput
from kvmesh.engine.sequence import Request
from kvmesh.engine.spec.config import SpeculativeConfig
from kvmesh.engine.spec.eagle import EagleDrafter, load_eagle_head
from kvmesh.engine.spec.mtp import SMOLLM2_MTP_HEAD, MultiTokenPredictor, load_mtp_head
from kvmesh.engine.spec.speculator import Proposer
from kvmesh.engine.spec.target_mtp import check_supported, load_target_mtp
from kvmesh.engine.spec.target_runner import TargetRunner
from kvmesh.protocol.wording import plural

logger = logging.getLogger(__name__)


def load_head(
    config: SpeculativeConfig, target, model_config, model_path: str | Path | None = None
) -> MultiTokenPredictor | EagleDrafter:
    """The draft head `config` names for `target`. mtp: "smollm2" is the head shipped for the
    embedded model, another "model" a head file (mtp.save_mtp_head's format), none the target's
    own MTP layers from its HF directory `model_path`. eagle: an EAGLE-1 head directory."""
    if not isinstance(target, LlamaForCausalLM):
        raise ValueError(f"MTP drafting needs a Llama-shaped target, not {type(target).__name__}")
    from safetensors import SafetensorError

    errors = (ValueError, RuntimeError, KeyError, OSError, SafetensorError)
    if config.method == "eagle3":
        raise ValueError(
            "method 'eagle3' is not supported yet (EAGLE-3 heads read several target layers); "
            "use an EAGLE-1 head with method 'eagle', or 'mtp' / 'draft_model' / 'ngram'"
        )
    if config.method == "eagle":
        try:
            return load_eagle_head(target, str(config.model))
        except errors as e:
            raise ValueError(f"EAGLE head {config.model} does not fit the target: {e}") from e
    if config.model is None:
        check_supported(model_config)
        try:
            return load_target_mtp(target, model_config, model_path)
        except errors as e:
            raise ValueError(f"the target's own MTP layers do not load: {e}") from e
    path = SMOLLM2_MTP_HEAD if config.model == "smollm2" else Path(config.model)
    if not path.is_file():
        raise ValueError(f"MTP head {path}: no such file")
    try:
        return load_mtp_head(target, path)
    except errors as e:
        raise ValueError(f"MTP head {path} does not fit the target: {e}") from e


@dataclass(slots=True)
class _Tail:
    position: int  # L: the request's last verified position
    g: torch.Tensor  # [H] depth 1's output at L
    table: list[int]  # the request's block table when L was computed


class MtpProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, runner: TargetRunner) -> None:
        self.k = config.num_speculative_tokens or 1
        self.num_lookahead_tokens = self.k - 1  # depths 2..k write ahead of the target
        self.runner = runner
        model_path = getattr(runner, "model_path", None)
        self.mtp = load_head(config, runner.model, runner.model_config, model_path)
        self.block_size = runner.config.block_size
        layers = replace(self.mtp.config, num_hidden_layers=len(self.mtp.layers))
        self.kv_caches = allocate_kv_cache(
            layers, runner.num_blocks, self.block_size, runner.device, runner.dtype
        )
        self.tails: dict[str, _Tail] = {}
        size = sum(c.numel() * c.element_size() for c in self.kv_caches)
        logger.info(
            "%s drafter: %s, k=%d, KV %.1f MiB on top of the target's",
            config.method.upper(),
            plural(len(self.mtp.layers), "layer"),
            self.k,
            size / 2**20,
        )

    def _slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def _meta(self, slots, query_lens, context_lens, tables) -> AttentionMetadata:
        return AttentionMetadata.build(slots, query_lens, context_lens, tables, self.runner.device)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.runner.device)

    @torch.inference_mode()
    def observe_step(self, out: SchedulerOutput) -> None:
        rows = {r[0]: r for r in getattr(self.runner, "last_rows", ())}
        hidden_rows: list[int] = []
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        keep: list[tuple[str, int, int, list[int]]] = []  # (id, row, L, table)
        for item in out.scheduled:
            req = item.request
            row = rows.get(req.request_id)
            if row is None:
                continue
            _, first_row, start, n, table = row
            # a finished request's rows still go in: its blocks may be in the prefix cache
            end = min(start + n, req.num_computed_tokens, len(req.all_token_ids) - 1)
            if end <= start:
                continue
            hidden_rows.extend(range(first_row, first_row + end - start))
            ids.extend(req.all_token_ids[start + 1 : end + 1])
            positions.extend(range(start, end))
            slots.extend(self._slot(table, p) for p in range(start, end))
            query_lens.append(end - start)
            context_lens.append(end)
            tables.append(table)
            if end == req.num_computed_tokens and not req.is_finished:
                keep.append((req.request_id, len(ids) - 1, end - 1, table))
        if not ids:
            return
        hidden = self.runner.last_hidden.index_select(0, self._tensor(hidden_rows))
        meta = self._meta(slots, query_lens, context_lens, tables)
        cache = self.kv_caches[self.mtp.layer_for(1)]
        g = self.mtp(self._tensor(ids), self._tensor(positions), hidden, cache, meta, depth=1)
        if keep:
            last = g.index_select(0, self._tensor([r for _, r, _, _ in keep]))
            for j, (rid, _, position, table) in enumerate(keep):
                self.tails[rid] = _Tail(position, last[j], table)

    @torch.inference_mode()
    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        active = []  # requests that sampled, with a fresh depth-1 output at their last row
        for i, req in enumerate(requests):
            tail = self.tails.get(req.request_id)
            last = req.num_computed_tokens - 1
            if tail is not None and tail.position == last == len(req.all_token_ids) - 2:
                active.append(i)
        if not active:
            return drafts
        tails = [self.tails[requests[i].request_id] for i in active]
        g = torch.stack([t.g for t in tails])
        depth = 1
        while True:
            tokens = self.mtp.compute_logits(g, depth).argmax(-1)
            for i, token in zip(active, tokens.tolist(), strict=True):
                drafts[i].append(token)
            depth += 1
            # the next row sits at L + depth - 1: it needs a draft left and a reserved slot
            go_on = [
                j
                for j, i in enumerate(active)
                if depth <= min(limits[i], self.k)
                and (tails[j].position + depth - 1) // self.block_size < len(tails[j].table)
            ]
            if not go_on:
                return drafts
            if len(go_on) < len(active):
                sel = self._tensor(go_on)
                active = [active[j] for j in go_on]
                tails = [tails[j] for j in go_on]
                g, tokens = g.index_select(0, sel), tokens.index_select(0, sel)
            pos = [t.position + depth - 1 for t in tails]
            meta = self._meta(
                [self._slot(t.table, p) for t, p in zip(tails, pos, strict=True)],
                [1] * len(pos),
                [p + 1 for p in pos],
                [t.table for t in tails],
            )
            cache = self.kv_caches[self.mtp.layer_for(depth)]
            g = self.mtp(tokens, self._tensor(pos), g, cache, meta, depth=depth)

    def forget(self, request_id: str) -> None:
        self.tails.pop(request_id, None)
