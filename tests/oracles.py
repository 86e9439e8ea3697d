"""Independent oracles for the engine tests: teacher-forced re-scoring in plain transformers."""

from __future__ import annotations

import torch

from alpha import geometric_mix, get_alpha_computer


def rescore(model, prompt_ids: list[int], token_ids: list[int], vocab: int) -> torch.Tensor:
    """Teacher-forced log-softmax rows [T, vocab] predicting each generated token, in plain transformers."""
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(token_ids), :vocab]
    return torch.log_softmax(logits.float(), -1)


def assert_records_match_rescoring(request, hf_teacher, hf_theta, vocab: int, alpha_method: str, atol: float = 1e-4) -> int:
    """Check every sample of ``request`` (untempered, unfiltered sampling) against the oracle; return tokens checked."""
    checked = 0
    for sample in request.samples:
        lt = rescore(hf_teacher, request.teacher_prompt_token_ids, sample.token_ids, vocab)
        lth = rescore(hf_theta, request.theta_prompt_token_ids, sample.token_ids, vocab)
        tok = torch.tensor(sample.token_ids).unsqueeze(-1)
        alpha = get_alpha_computer(alpha_method)(lth, lt)
        logq = geometric_mix(lth, lt, alpha).gather(-1, tok).squeeze(-1)
        torch.testing.assert_close(torch.tensor(sample.alpha), alpha.float(), atol=atol, rtol=0)
        torch.testing.assert_close(torch.tensor(sample.logp_teacher), lt.gather(-1, tok).squeeze(-1), atol=atol, rtol=0)
        torch.testing.assert_close(torch.tensor(sample.logp_theta), lth.gather(-1, tok).squeeze(-1), atol=atol, rtol=0)
        torch.testing.assert_close(torch.tensor(sample.logq), logq.float(), atol=atol, rtol=0)
        checked += len(sample.token_ids)
    return checked
