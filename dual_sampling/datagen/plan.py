"""Planning a run: for each selected problem with samples still missing (a resumed run skips those done), both
rendered prompts, or a reject when a prompt does not fit the context; as a stream, so that no run holds its whole
plan in memory.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from dual_sampling.datagen.run_config import RunConfig
from dual_sampling.prompts import Renderer

__all__ = ["WorkItem", "iter_items", "plan_items"]


@dataclass
class WorkItem:
    """One problem to sample: both rendered prompts, and the sample indices still missing."""

    id: str
    teacher_user: str
    theta_user: str
    teacher_prompt: str
    theta_prompt: str
    missing: list[int]


def iter_items(
    cfg: RunConfig,
    selected: Iterable[tuple[int, dict, str]],
    done: Container,
    tokenizer: Any,
    max_model_len: int,
    rejects: list[dict],
) -> Iterator[WorkItem]:
    """The work items of ``selected`` rows as they come: both prompts rendered for every problem with samples not in
    ``done``; a problem too long for the context goes to ``rejects`` instead."""
    renderer = Renderer(tokenizer, cfg.teacher_template, cfg.theta_template, cfg.source.chat_template)
    for number, row, row_id in selected:
        missing = [j for j in range(cfg.sampling.n) if (row_id, j) not in done]
        if not missing:
            continue
        hint = None if cfg.source.hint_field is None else row[cfg.source.hint_field]
        t_user, th_user = renderer.user_messages(row[cfg.source.prompt_field], hint, row)
        item = WorkItem(
            row_id,
            t_user,
            th_user,
            renderer.prompt(t_user, cfg.system_prompt_teacher),
            renderer.prompt(th_user, cfg.system_prompt_theta),
            missing,
        )
        longest = max(
            len(tokenizer(p, add_special_tokens=True)["input_ids"]) for p in (item.teacher_prompt, item.theta_prompt)
        )
        if longest + 1 > max_model_len:
            reason = f"prompt has {longest} tokens; max_model_len is {max_model_len}"
            rejects.append({"id": row_id, "row": number, "reason": reason})
            continue
        yield item


def plan_items(
    cfg: RunConfig, selected: Iterable[tuple[int, dict, str]], done: Container, tokenizer: Any, max_model_len: int
) -> tuple[list[WorkItem], list[dict]]:
    """Render the prompts of every problem with samples still missing; reject those too long for the context."""
    rejects: list[dict] = []
    items = list(iter_items(cfg, selected, done, tokenizer, max_model_len, rejects))
    return items, rejects
