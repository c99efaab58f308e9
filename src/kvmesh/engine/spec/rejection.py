"""Verification of draft tokens against the target: lossless under greedy and under sampling.

One target pass scores each request's last verified token plus its drafts, giving K + 1
distributions per row: position j is the target's distribution for the token after draft j - 1
(position 0: after the last verified token). Rows are padded to K drafts; `num_draft_tokens`
says how many are real (0 is allowed: the row then emits just the target's token).

Greedy: accept drafts while each equals the target's argmax at its position; then emit the
argmax at the first mismatch, or the bonus token at position n when all n drafts pass. The
output is therefore exactly the argmax at positions 0..a, a = accepted count: token-for-token
what decoding without speculation produces.

Sampling: accept draft x at position j with probability min(1, p_j(x) / q_j(x)); at the first
rejection emit a token from norm(max(0, p_j - q_j)); if all pass, sample the bonus from p_n.
Every emitted token is then distributed as p (Leviathan et al., Chen et al.). A deterministic
drafter (n-gram) has q one-hot on its draft: acceptance is p(x), and the recovery distribution
is p with x removed, renormalised.

Output rows hold a + 1 tokens followed by PLACEHOLDER_TOKEN_ID; `num_accepted` is a.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

PLACEHOLDER_TOKEN_ID = -1


class VerifyOutput(NamedTuple):
    output_token_ids: torch.Tensor  # [B, K + 1] int64; row b: num_accepted[b] + 1 tokens, then -1
    num_accepted: torch.Tensor  # [B] int64 accepted draft tokens (0..num_draft_tokens[b])


def _check(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor, width: int) -> int:
    if draft_token_ids.dim() != 2:
        raise ValueError(f"draft_token_ids must be [B, K], got {tuple(draft_token_ids.shape)}")
    b, k = draft_token_ids.shape
    if num_draft_tokens.shape != (b,):
        raise ValueError(f"num_draft_tokens must be [{b}], got {tuple(num_draft_tokens.shape)}")
    if num_draft_tokens.numel() and int(num_draft_tokens.min()) < 0:
        raise ValueError("num_draft_tokens must be >= 0")
    if num_draft_tokens.numel() and int(num_draft_tokens.max()) > k:
        raise ValueError(f"num_draft_tokens must be <= K = {k}")
    if width != k + 1:
        raise ValueError(f"the target scores K + 1 = {k + 1} positions per row, got {width}")
    return k


def _emit(
    draft_token_ids: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor
) -> VerifyOutput:
    """Rows of accepted drafts, then `last` at position num_accepted, then placeholders."""
    b, k = draft_token_ids.shape
    pos = torch.arange(k + 1, device=draft_token_ids.device).expand(b, k + 1)
    padded = torch.cat((draft_token_ids, draft_token_ids.new_zeros(b, 1)), dim=1)
    out = torch.where(pos < num_accepted[:, None], padded, PLACEHOLDER_TOKEN_ID)
    out = torch.where(pos == num_accepted[:, None], last[:, None], out)
    return VerifyOutput(out, num_accepted)


def _accepted_prefix(accept: torch.Tensor, num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True among each row's first num_draft_tokens entries."""
    k = accept.shape[1]
    valid = torch.arange(k, device=accept.device)[None, :] < num_draft_tokens[:, None]
    return (accept & valid).long().cumprod(dim=1).sum(dim=1)


def greedy_verify(
    draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor, target_argmax: torch.Tensor
) -> VerifyOutput:
    """target_argmax: [B, K + 1] the target's argmax at each scored position."""
    k = _check(draft_token_ids, num_draft_tokens, target_argmax.shape[1])
    accepted = _accepted_prefix(draft_token_ids == target_argmax[:, :k], num_draft_tokens)
    last = target_argmax.gather(1, accepted[:, None]).squeeze(1)
    return _emit(draft_token_ids, accepted, last)


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> VerifyOutput:
    """target_probs: [B, K + 1, V] after temperature / top-k / top-p; draft_probs: [B, K, V]
    the drafter's distributions the drafts were sampled from, or None for a deterministic
    drafter (q one-hot on each draft)."""
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [B, K + 1, V], got {tuple(target_probs.shape)}")
    k = _check(draft_token_ids, num_draft_tokens, target_probs.shape[1])
    b, _, v = target_probs.shape
    p = target_probs[:, :k].float()
    idx = draft_token_ids[:, :, None]
    p_draft = p.gather(2, idx).squeeze(2)  # [B, K] p_j(x_j)
    if draft_probs is None:
        q = torch.zeros_like(p).scatter_(2, idx, 1.0)
    else:
        if draft_probs.shape != (b, k, v):
            raise ValueError(f"draft_probs must be [{b}, {k}, {v}], got {draft_probs.shape}")
        q = draft_probs.float()
    q_draft = q.gather(2, idx).squeeze(2)
    u = torch.rand(b, k, generator=generator, device=p.device)
    # u < p/q without dividing; q(x) > 0 for a draft sampled from q, and p >= q accepts surely
    accept = u * q_draft < p_draft
    accepted = _accepted_prefix(accept, num_draft_tokens)

    rows = torch.arange(b, device=p.device)
    bonus = accepted == num_draft_tokens  # no rejection: sample the bonus from p_n
    at = accepted.clamp(max=max(k - 1, 0))
    if k:
        residual = (p[rows, at] - q[rows, at]).clamp_min(0.0)
        # p == q at the rejected position cannot reject; guard the all-zero row anyway
        empty = residual.sum(dim=1, keepdim=True) <= 0
        residual = torch.where(empty, p[rows, at], residual)
        dist = torch.where(bonus[:, None], target_probs[rows, accepted].float(), residual)
    else:
        dist = target_probs[:, 0].float()
    last = _sample(dist, generator)
    return _emit(draft_token_ids, accepted, last)


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from unnormalised non-negative weights (exponential race)."""
    e = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / e).argmax(dim=1)
