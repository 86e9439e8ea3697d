"""Prompt rendering shared by data-generation runs and the server: the user-message templates (Jinja, with the
problem, its hint and its row) and the prompts built from them, in each model's chat template or not.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dual_sampling.roster import THETA

__all__ = ["DEFAULT_TEACHER_TEMPLATE", "DEFAULT_THETA_TEMPLATE", "Renderer", "user_template"]

DEFAULT_TEACHER_TEMPLATE = (
    "{{ problem }}{% if hint %}\n\nA reference solution follows. Use it as a hint, and write your own complete "
    "answer.\n\n{{ hint }}{% endif %}"
)
DEFAULT_THETA_TEMPLATE = "{{ problem }}"


def user_template(text: str | None, default: str):
    """A compiled Jinja template of a user message (``text``: a template string, a file, or None for ``default``)."""
    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.from_string(_template_text(text) or default)


class Renderer:
    """Each model's user message of a problem (its template), and each message as that model's prompt."""

    def __init__(self, tokenizer: Any, templates: Mapping[str, str | None], chat_template: bool) -> None:
        """``templates``: each model's user-message template by roster name (None: θ's default for
        :data:`~dual_sampling.roster.THETA`, the teachers' otherwise), in roster order."""
        self.templates = {
            name: user_template(text, DEFAULT_THETA_TEMPLATE if name == THETA else DEFAULT_TEACHER_TEMPLATE)
            for name, text in templates.items()
        }
        self.tokenizer, self.chat_template = tokenizer, chat_template

    def user_messages(self, problem: str, hints: Mapping[str, str | None], row: dict) -> dict[str, str]:
        """Each model's user message, by name: its template given the problem, its hint (None for a model
        ``hints`` does not name) and the row."""
        return {
            name: template.render(problem=problem, hint=hints.get(name), row=row)
            for name, template in self.templates.items()
        }

    def prompt(self, user: str, system: str | None) -> str:
        if not self.chat_template:
            return user if system is None else f"{system}\n\n{user}"
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _template_text(value: str | None) -> str | None:
    """The template itself: ``value``, or the file it names (a short string without ``{`` that is a file)."""
    if value is None:
        return None
    p = Path(value)
    if len(value) < 4096 and "{" not in value and p.is_file():
        return p.read_text(encoding="utf-8")
    return value
