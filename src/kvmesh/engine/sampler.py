"""Sampler: turns the logits of a batch into next tokens under each request's SamplingParams."""

from __future__ import annotations

import torch

from kvmesh.engine.sequence import SamplingParams
from kvmesh.engine.spec.rejection import greedy_verify, rejection_sample

_NEG_INF = float("-inf")


def _apply_top_k_top_p_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask filtered-out tokens to -inf, row by row where a filter is set."""
    for i, p in enumerate(params):
        row = logits[i]
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row.masked_fill_(row < kth, _NEG_INF)
        if p.min_p > 0.0:
            probs = torch.softmax(row, dim=-1)
            row.masked_fill_(probs < p.min_p * probs.max(), _NEG_INF)
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            drop = (
                cum - torch.softmax(sorted_logits, dim=-1) >= p.top_p
            )  # keep the token crossing p
            row[order[drop]] = _NEG_INF
    return logits


class Sampler:
    """Greedy rows take argmax; others race exponentials; per-request seeds are honoured."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def generator(self, request_id: str, seed: int | None, device: torch.device):
        if seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed)
            self._generators[request_id] = gen
        return gen

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def __call__(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        blocked: list[list[int]],
    ) -> tuple[list[int], list[list[tuple[int, float]] | None]]:
        """logits: [N, V] float32. blocked: per row, token ids to forbid (eos under min_tokens)."""
        logits = logits.float()
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1)
            if any(p.logprobs is not None for p in params)
            else None
        )
        for i, ids in enumerate(blocked):
            if ids:
                logits[i, ids] = _NEG_INF
        greedy = [p.greedy for p in params]
        tokens = torch.argmax(logits, dim=-1)
        if not all(greedy):
            idx = [i for i, g in enumerate(greedy) if not g]
            sub_params = [params[i] for i in idx]
            temps = torch.tensor([p.temperature for p in sub_params], device=logits.device)
            sub = logits[idx] / temps.unsqueeze(1)
            sub = _apply_top_k_top_p_min_p(sub, sub_params)
            probs = torch.softmax(sub, dim=-1)
            for j, i in enumerate(idx):
                gen = self.generator(request_ids[i], params[i].seed, logits.device)
                q = torch.empty_like(probs[j]).exponential_(generator=gen)
                tokens[i] = torch.argmax(probs[j] / q)
        token_list = tokens.tolist()
        logprobs_out: list[list[tuple[int, float]] | None] = [None] * len(params)
        if raw_logprobs is not None:
            for i, p in enumerate(params):
                if p.logprobs is not None:
                    logprobs_out[i] = _logprob_entries(raw_logprobs[i], token_list[i], p.logprobs)
        return token_list, logprobs_out

    def verify(
        self, logits: torch.Tensor, drafts: list[int], request_id: str, params: SamplingParams
    ) -> tuple[list[int], list[list[tuple[int, float]]] | None]:
        """One request's drafts against the target's logits at its 1 + len(drafts) rows: the
        accepted drafts and the target's next token, each distributed as without drafts
        (greedy: the argmax chain; sampled: rejection sampling with the filtered p)."""
        logits = logits.float()
        draft_ids = torch.tensor([drafts], dtype=torch.long, device=logits.device)
        num_drafts = torch.tensor([len(drafts)], dtype=torch.long, device=logits.device)
        if params.greedy:
            result = greedy_verify(draft_ids, num_drafts, logits.argmax(dim=-1)[None])
        else:
            rows = logits / params.temperature
            rows = _apply_top_k_top_p_min_p(rows, [params] * rows.shape[0])
            probs = torch.softmax(rows, dim=-1)
            gen = self.generator(request_id, params.seed, logits.device)
            result = rejection_sample(draft_ids, num_drafts, probs[None], None, gen)
        n = int(result.num_accepted[0]) + 1
        tokens = result.output_token_ids[0, :n].tolist()
        if params.logprobs is None:
            return tokens, None
        raw = torch.log_softmax(logits[:n], dim=-1)
        return tokens, [_logprob_entries(raw[i], t, params.logprobs) for i, t in enumerate(tokens)]


def _logprob_entries(raw: torch.Tensor, chosen: int, top: int) -> list[tuple[int, float]]:
    """The chosen token's logprob, then the top `top` (vLLM's logprobs=N)."""
    entries = [(chosen, float(raw[chosen]))]
    if top > 0:
        best = torch.topk(raw, top)
        entries += list(zip(best.indices.tolist(), best.values.tolist(), strict=True))
    return entries
