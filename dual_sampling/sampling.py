"""From two models' logits to one token: the decision made once per token.

Order of operations (per row; α is the teacher weight):

1. log π_θ and log π_t: log-softmax of each model's untempered logits over the shared
   tokenizer's vocabulary (embedding rows beyond it are never sampled).
2. α from the alpha computer, on those untempered distributions, clamped to
   [alpha_min, alpha_max]; α = 1 at step 0 when ``force_first_token`` is set.
3. log q = geometric_mix(log π_θ, log π_t, α).
4. Teacher-support constraint: tokens outside the teacher's top-k / top-p set are removed.
5. min_tokens: the stop tokens are removed while fewer than min_tokens were generated.
6. logit_bias is added.
7. Temperature divides log q (0 means greedy).
8. top_k, top_p and min_p filter the tempered distribution.
9. Renormalise and draw with a counter-based uniform of (seed, step): the same seed gives
   the same token whatever the batch composition or timing. The recorded log q is the
   log-probability of the drawn token under this final distribution (0 for greedy).

vLLM's own stages (min_tokens, logit_bias, penalties, bad words) are never handed to the
engines: a token forced after them could be masked to -inf. The supported ones run here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

__all__ = ["RowSampling", "counter_uniform", "keep_top_k_top_p", "draw_tokens"]

_MASK64 = (1 << 64) - 1


def counter_uniform(seed: int, step: int) -> float:
    """A uniform in [0, 1) from (seed, step) alone (SplitMix64), reproducible across runs and batches."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * (1.0 / (1 << 53))


@dataclass
class RowSampling:
    """Per-request sampling settings as the teacher processor receives them (plain data, picklable)."""

    seed: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    """Tokens masked while fewer than min_tokens were generated (EOS ids and the user's stop ids)."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    force_first_token: bool = False
    support_top_k: int = -1
    support_top_p: float = 1.0

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["logit_bias"] = {int(k): float(v) for k, v in self.logit_bias.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RowSampling":
        d = dict(d)
        d["stop_token_ids"] = tuple(d.get("stop_token_ids", ()))
        d["logit_bias"] = {int(k): float(v) for k, v in (d.get("logit_bias") or {}).items()}
        return cls(**d)


def keep_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor | None = None) -> Tensor:
    """Bool mask ``[b, V]`` of the tokens each row keeps.

    ``top_k`` ``[b]`` (≤ 0: off), ``top_p`` ``[b]`` in (0, 1] (1: off), ``min_p`` ``[b]`` in [0, 1]
    (0: off). The most likely token is always kept.
    """
    keep = torch.isfinite(logits)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        rank = torch.arange(logits.shape[-1], device=logits.device).expand_as(sorted_logits)
        keep_sorted = torch.ones_like(sorted_logits, dtype=torch.bool)
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, logits.shape[-1]))
        keep_sorted &= rank < k.unsqueeze(-1)
        probs = torch.softmax(sorted_logits.double(), dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
        keep_sorted &= before < top_p.double().unsqueeze(-1)
        keep_sorted[:, 0] = True
        keep &= torch.zeros_like(keep).scatter(-1, order, keep_sorted)
    if min_p is not None and bool((min_p > 0).any()):
        logp = torch.log_softmax(logits, dim=-1)
        top = logp.max(dim=-1, keepdim=True).values
        keep &= logp >= top + torch.log(min_p.clamp_min(1e-30)).unsqueeze(-1)
    return keep


def draw_tokens(logq: Tensor, logp_teacher: Tensor, steps: Sequence[int], rows: Sequence[RowSampling]) -> tuple[Tensor, Tensor, Tensor]:
    """Apply steps 4–9 above to ``logq`` ``[b, V]`` and draw one token per row.

    Returns (tokens ``[b]`` int64, log q of each drawn token ``[b]``, ok ``[b]`` bool). A row
    whose every token was removed is not ok (its token is 0 and must not be used).
    """
    b, vocab = logq.shape
    x = logq.clone()
    dev = x.device
    sup_k = torch.tensor([r.support_top_k for r in rows], device=dev)
    sup_p = torch.tensor([r.support_top_p for r in rows], device=dev, dtype=x.dtype)
    if bool((sup_k > 0).any()) or bool((sup_p < 1).any()):
        x = x.masked_fill(~keep_top_k_top_p(logp_teacher, sup_k, sup_p), -math.inf)
    for i, (r, s) in enumerate(zip(rows, steps)):
        if s < r.min_tokens and r.stop_token_ids:
            x[i, [t for t in r.stop_token_ids if t < vocab]] = -math.inf
        if r.logit_bias:
            ids = torch.tensor(list(r.logit_bias), device=dev)
            x[i, ids] += torch.tensor(list(r.logit_bias.values()), device=dev, dtype=x.dtype)
    temps = torch.tensor([r.temperature for r in rows], device=dev, dtype=x.dtype)
    greedy = temps == 0
    x = x / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(-1)
    top_k = torch.tensor([r.top_k for r in rows], device=dev)
    top_p = torch.tensor([r.top_p for r in rows], device=dev, dtype=x.dtype)
    min_p = torch.tensor([r.min_p for r in rows], device=dev, dtype=x.dtype)
    x = x.masked_fill(~keep_top_k_top_p(x, top_k, top_p, min_p), -math.inf)
    ok = torch.isfinite(x).any(dim=-1)
    x = torch.where(ok.unsqueeze(-1), x, torch.zeros_like(x))
    logp_final = torch.log_softmax(x.double(), dim=-1)
    cdf = torch.cumsum(logp_final.exp(), dim=-1)
    u = torch.tensor([counter_uniform(r.seed, s) for r, s in zip(rows, steps)], dtype=torch.float64, device=dev)
    sampled = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1).clamp_max(vocab - 1)
    # Rounding can land on a zero-probability token at the edge of the CDF: step back to a kept one.
    dead = ~torch.isfinite(logp_final.gather(-1, sampled.unsqueeze(-1)).squeeze(-1))
    if bool(dead.any()):
        sampled = torch.where(dead, logp_final.argmax(-1), sampled)
    tokens = torch.where(greedy, x.argmax(dim=-1), sampled)
    logq_token = torch.where(greedy, torch.zeros_like(u), logp_final.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
    return tokens, logq_token.to(logq.dtype), ok
