"""Drawing the samples of planned work items with one dual engine, and sorting each into an :class:`Outcome`: a
record (training data), a failure, or a left-out answer. :func:`sample_here` draws a whole run on this machine;
:mod:`dual_sampling.datagen.ray_stage` draws it on Ray replicas with the same :func:`sample_items`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dual_sampling.datagen.inputs import batched
from dual_sampling.datagen.plan import WorkItem
from dual_sampling.datagen.run_config import RunConfig
from dual_sampling.datagen.schema import Message, MessagesRecord, record_fields
from dual_sampling.roster import THETA

__all__ = ["Outcome", "sample_here", "sample_items"]


@dataclass
class Outcome:
    """What one drawn sample leaves: a record (training data), a failure, or a left-out answer; and its numbers."""

    id: str
    sample_index: int
    record: dict[str, Any] | None
    """A :class:`Record` or :class:`MessagesRecord` as a dict."""
    failure: dict[str, Any] | None
    left_out: dict[str, Any] | None
    """A complete answer that is not training data (cut off at max_tokens, format "messages", not keep_truncated):
    logged, so that --resume does not draw it again."""
    stats: dict[str, float]
    """What the run summary needs, whatever the format: tokens; for a record also alpha_sum and alpha_sq (of the
    total teacher weight Σα at each token), log_w_theta and truncated (1.0 if cut off at max_tokens); with several
    teachers each teacher's Σα too, under its sum column (``sum_alpha_<teacher>``)."""


def sample_items(sampler: Any, cfg: RunConfig, items: list[WorkItem], models: dict) -> list[Outcome]:
    """Draw the missing samples of ``items`` (seeds from (seed, id, sample_index)); one outcome per sample."""
    out = sampler.generate(
        [i.prompts[THETA] for i in items],
        teacher_prompts={name: [i.prompts[name] for i in items] for name in cfg.roster.teachers},
        prompt_keys=[i.id for i in items],
        sampling=cfg.sampling,
        use_tqdm=False,
    )
    outcomes = []
    for item, request in zip(items, out.requests):
        # A problem's beams are written all or none: --resume then draws a whole search again, never one rank from a
        # second search (which may order near-ties otherwise) beside the first search's others.
        broken = [j for j in item.missing if not request.samples[j].ok or _non_finite(request.samples[j])]
        whole = cfg.sampling.use_beam_search and bool(broken)
        for j in item.missing:
            sample = request.samples[j]
            tokens = {"tokens": len(sample.token_ids)}
            # Only complete, verified samples with finite numbers are training data; a failed one is logged and
            # drawn again on --resume.
            error = _non_finite(sample) if sample.ok else sample.error
            if whole and sample.ok and error is None:
                error = f"beam_search_partial at beam {broken[0]}: a beam of its search failed"
            if not sample.ok or error is not None:
                outcomes.append(Outcome(item.id, j, None, _failure(item, j, sample, error), None, tokens))
            elif cfg.format == "messages" and sample.finish_reason == "length" and not cfg.keep_truncated:
                outcomes.append(Outcome(item.id, j, None, None, _failure(item, j, sample, None), tokens))
            else:
                columns, total = sample.columns(), sample.total_alpha
                stats = {
                    **tokens,
                    "alpha_sum": math.fsum(total),
                    "alpha_sq": math.fsum(a * a for a in total),
                    "log_w_theta": sample.log_w_theta,
                    "truncated": float(sample.finish_reason == "length"),
                }
                if len(cfg.roster.alpha_columns) > 1:
                    stats.update({f"sum_{name}": math.fsum(columns[name]) for name in cfg.roster.alpha_columns})
                outcomes.append(Outcome(item.id, j, _record(cfg, item, j, sample, models), None, None, stats))
    return outcomes


def _non_finite(sample: Any) -> str | None:
    """The error of a sample with a non-finite α, log π or log q (JSON cannot hold one, and it is no data); None."""
    for name, column in sample.columns().items():
        for position, value in enumerate(column):
            if not math.isfinite(value):
                return f"non_finite_record at token {position}: {name} is {value}"
    return None


def _record(cfg: RunConfig, item: WorkItem, j: int, sample, models: dict) -> dict[str, Any]:
    """The sample's record: a :class:`MessagesRecord`, or the fields :func:`record_fields` gives the run's roster."""
    if cfg.format == "messages":
        messages = [Message(role="system", content=cfg.system_prompt_theta)] if cfg.system_prompt_theta else []
        messages += [Message(role="user", content=item.users[THETA]), Message(role="assistant", content=sample.text)]
        return dataclasses.asdict(MessagesRecord(item.id, j, messages, truncated=sample.finish_reason == "length"))
    roster, columns = cfg.roster, sample.columns()
    by_string = isinstance(sample.stop_reason, str)
    values = {
        "id": item.id,
        "sample_index": j,
        "seed": sample.seed,
        **{column: item.prompts[name] for column, name in zip(roster.prompt_columns, roster.names)},
        "response": sample.text,
        "token_ids": sample.token_ids,
        "finish_reason": sample.finish_reason,
        "stop_reason": sample.stop_reason if by_string else None,
        "stop_token_id": None if by_string or sample.stop_reason is None else int(sample.stop_reason),
        "error": sample.error,
        "num_tokens": len(sample.token_ids),
        **columns,
        **{total: math.fsum(columns[name]) for total, name in zip(roster.sum_columns, roster.token_columns)},
        **{
            weight: math.fsum(a - b for a, b in zip(columns[f"logp_{name}"], columns["logq"]))
            for weight, name in zip(roster.weight_columns, (THETA, *roster.teachers))
        },
        "teacher_version": sample.teacher_version,
        "theta_version": sample.theta_version,
        "score": sample.score,
        "score_name": sample.score_name,
        "models": models,
        "sampling": {
            **dataclasses.asdict(cfg.sampling),
            "logit_bias": [[t, b] for t, b in cfg.sampling.logit_bias.items()],
        },
        "alpha_config": {"method": cfg.engine.alpha_method, **cfg.engine.alpha_kwargs},
    }
    return {name: values[name] for name in record_fields(cfg.format, roster)}


def _failure(item: WorkItem, j: int, sample, error: str | None) -> dict[str, Any]:
    """What a failed (or left-out) sample leaves behind: enough to see why, nothing to train on."""
    return {
        "id": item.id,
        "sample_index": j,
        "seed": sample.seed,
        "finish_reason": sample.finish_reason,
        "error": error,
        "num_tokens": len(sample.token_ids),
    }


def sample_here(
    cfg: RunConfig, items: Iterable[WorkItem], models: dict, sampler: Any, commit, total: int | None = None
) -> dict:
    """Draw every sample on this machine, ``batch_size`` problems per generate() call, as the plan streams in; return
    the sync statistics. ``total`` (samples expected) only sizes the progress bar."""
    from tqdm.auto import tqdm

    from dual_sampling.api import OptimalSamplingDual

    own = sampler is None
    if own:
        sampler = OptimalSamplingDual(cfg.source.teacher, cfg.source.theta, engine=cfg.engine, use_tqdm=False)
    try:
        bar = tqdm(total=total, desc="samples", unit="sample", disable=not cfg.engine.use_tqdm)
        generating, tokens, failed = time.monotonic(), 0, 0
        for batch in batched(items, cfg.batch_size):
            outcomes = sample_items(sampler, cfg, batch, models)
            commit(outcomes)
            tokens += sum(int(o.stats["tokens"]) for o in outcomes)
            failed += sum(o.failure is not None for o in outcomes)
            bar.set_postfix(tok_s=f"{tokens / max(time.monotonic() - generating, 1e-9):.1f}", failed=failed)
            bar.update(len(outcomes))
        bar.close()
        return sampler.get_sync_statistics()
    finally:
        if own:
            sampler.close()
