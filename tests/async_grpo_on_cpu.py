"""What TRL's ``AsyncGRPOTrainer`` needs to train on a CPU: two GPU-only lookups replaced, nothing else.

1. **Its attention.** The trainer packs each step's samples into a prefix tree and runs attention through FA3's
   ``flash_attn_varlen_func`` (``trl/experimental/async_grpo/packing.py``), fetched from the kernels hub at run time
   and built for GPUs only. :func:`varlen_attention` computes the same function in plain torch: for each segment s,
   queries ``q[cu_q[s]:cu_q[s+1]]`` attend to keys and values ``k[cu_k[s]:cu_k[s+1]]``, causal with FA3's
   convention for unequal lengths (query i of Lq sees key j of Lk iff j ≤ i + Lk − Lq, the bottom-right corner),
   key/value heads shared by ``Hq / Hk`` query heads each.
2. **Its throughput metric.** ``get_peak_flops_per_device`` asks CUDA for the device's name; None (no MFU logged) is
   what the trainer already does for an unknown device.

Nothing here is trusted: the tests that train through it compare the trainer's own log π_θ with a plain transformers
re-scoring of every trained token, so an attention that differs from the model's own fails them.
"""

from __future__ import annotations

import torch

__all__ = ["train_async_grpo_on_cpu", "varlen_attention"]


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
) -> torch.Tensor:
    """FA3's variable-length attention in torch. ``q`` [total_q, Hq, D], ``k``/``v`` [total_k, Hk, D]; returns
    [total_q, Hq, D] in ``q``'s dtype (computed in float32)."""
    if window_size != (-1, -1) or softcap:
        raise NotImplementedError("sliding windows and soft caps: the tiny test models use neither")
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    share = q.shape[1] // k.shape[1]
    for s in range(len(cu_seqlens_q) - 1):
        (qa, qb), (ka, kb) = cu_seqlens_q[s : s + 2].tolist(), cu_seqlens_k[s : s + 2].tolist()
        queries = q[qa:qb].transpose(0, 1).float()  # [Hq, Lq, D]
        keys = k[ka:kb].transpose(0, 1).float().repeat_interleave(share, 0)
        values = v[ka:kb].transpose(0, 1).float().repeat_interleave(share, 0)
        scores = queries @ keys.transpose(-1, -2) * scale
        if causal:
            lq, lk = qb - qa, kb - ka
            hidden = torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + (lk - lq)
            scores = scores.masked_fill(hidden, float("-inf"))
        out[qa:qb] = (scores.softmax(-1) @ values).transpose(0, 1).to(q.dtype)
    return out


class _Kernel:
    flash_attn_varlen_func = staticmethod(varlen_attention)


def train_async_grpo_on_cpu(monkeypatch) -> None:
    """Install both replacements for the test (``monkeypatch`` undoes them)."""
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    monkeypatch.setattr(packing, "_flash_attn", lambda: _Kernel)
    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda *args, **kwargs: None)
