"""Planning a run: for each selected problem with samples still missing (a resumed run skips those done), every
model's rendered prompt, or a reject when a prompt does not fit the context; as a stream, so that no run holds its whole
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
    """One problem to sample: each model's rendered prompt, and the sample indices still missing."""

    id: str
    users: dict[str, str]
    """Each model's user message, by roster name."""
    prompts: dict[str, str]
    """Each model's prompt (its user message in its chat template, after its system message), by roster name."""
    missing: list[int]


def iter_items(
    cfg: RunConfig,
    selected: Iterable[tuple[int, dict, str]],
    done: Container,
    tokenizer: Any,
    max_model_len: int,
    rejects: list[dict],
) -> Iterator[WorkItem]:
    """The work items of ``selected`` rows as they come: every model's prompt rendered for every problem with samples
    not in ``done``; a problem too long for the context goes to ``rejects`` instead.

    Each model sees its hint field's value (:attr:`~dual_sampling.run_settings.ModelsAndPrompts.model_hint_fields`)."""
    renderer = Renderer(tokenizer, cfg.templates(), cfg.source.chat_template)
    system = cfg.system_prompts()
    fields = cfg.source.model_hint_fields
    for number, row, row_id in selected:
        missing = [j for j in range(cfg.sampling.n) if (row_id, j) not in done]
        if not missing:
            continue
        hints = {name: None if field is None else row[field] for name, field in fields.items()}
        users = renderer.user_messages(row[cfg.source.prompt_field], hints, row)
        item = WorkItem(row_id, users, {name: renderer.prompt(users[name], system[name]) for name in users}, missing)
        longest = max(len(tokenizer(p, add_special_tokens=True)["input_ids"]) for p in item.prompts.values())
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
