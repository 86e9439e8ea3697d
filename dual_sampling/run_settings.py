"""What the run configs share: the part naming the models and the prompts' fields (:class:`ModelsAndPrompts`), and
the flat keys through which a composed config is set (CLI flags, YAML keys) and compared (a run's identity).

A run config (``RunConfig``, ``DistillConfig``) has fields of its own and composes parts: fields
typed as dataclasses (``source``, ``sampling``, ``engine``). Every field of every part is one flat
key; a name two parts share is refused. A run's own defaults for a part's fields (distillation
samples 128 tokens of a "question" field) live in its ``PART_DEFAULTS``, which its default
factories and :func:`compose_settings` both read.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from typing import Any

from dual_sampling.roster import PAIR, THETA, Roster

__all__ = [
    "ModelsAndPrompts",
    "PerTeacher",
    "changed_settings",
    "compose_settings",
    "composed_parts",
    "flat_keys",
    "flat_settings",
    "identity_settings",
    "per_teacher",
    "runtime_only",
]

RUN = "run"
"""The part name of a config's own fields."""


PerTeacher = str | dict[str, str]
"""A setting of the teachers: one value every teacher takes, or ``{teacher name: value}`` (several teachers only; a
teacher the mapping does not name takes None)."""


@dataclass
class ModelsAndPrompts:
    """The models, and which fields of a problem's row hold what each is shown: the part every run shares."""

    teacher: PerTeacher | None = None
    """Teacher model folder; or ``{name: folder}`` for several teachers (at least two, each name a Python identifier
    other than "theta": they name the records' columns; θ's engine leads them). None: the local SmolLM2-135M-Instruct.
    On the command line, ``--teacher NAME=PATH`` once per teacher."""
    theta: str | None = None
    """Theta (student) model folder, same tokenizer as the teacher; None: the 24-layer pruned SmolLM2."""
    prompt_field: str = "problem"
    """Field of a problem's row holding its text."""
    hint_field: PerTeacher | None = None
    """Field holding a reference solution shown to the teacher only, while sampling (e.g. "solution"). With several
    teachers, one field every teacher sees, or ``{teacher: field}`` (``--hint-field NAME=FIELD``): a teacher not
    named sees no hint."""
    chat_template: bool = True
    """Wrap prompts in each model's chat template; False for base models."""

    def __post_init__(self) -> None:
        if isinstance(self.teacher, dict):
            if len(self.teacher) < 2:
                raise ValueError(
                    f"teacher: a mapping names several teachers (at least two), got {self.teacher!r}; give one "
                    "teacher's folder as a string"
                )
            try:
                Roster((*self.teacher, THETA))  # names: identifiers, unique, none "theta"
            except ValueError as exc:
                raise ValueError(f"teacher: {exc}") from None
        for name in ("teacher", "theta"):
            value = getattr(self, name)
            if name == "teacher" and isinstance(value, dict):
                bad = not all(isinstance(v, str) and v for v in value.values())  # each teacher's folder named
            else:
                bad = value is not None and not isinstance(value, str)
            if bad:
                raise ValueError(f"{name} must be a model folder (or, for teacher, {{name: folder}}), got {value!r}")
        if self.teacher is None or self.theta is None:
            from dual_sampling import models

            self.teacher, self.theta = models.default_pair(self.teacher, self.theta)
        self.hint_fields  # noqa: B018 (checked now, named by its field)

    @property
    def roster(self) -> Roster:
        """The run's models by name: :data:`~dual_sampling.roster.PAIR` for one teacher, else θ, then the teachers in
        the order given (:meth:`~dual_sampling.roster.Roster.of_teachers`)."""
        return Roster.of_teachers(tuple(self.teacher) if isinstance(self.teacher, dict) else None)

    @property
    def folders(self) -> dict[str, str]:
        """Every model's folder by roster name, in roster order."""
        teachers = self.teacher if isinstance(self.teacher, dict) else {PAIR.teachers[0]: self.teacher}
        every = {**teachers, THETA: self.theta}
        return {name: every[name] for name in self.roster.names}

    @property
    def hint_fields(self) -> dict[str, str | None]:
        """Each teacher's hint field (:attr:`hint_field`), in roster order."""
        return per_teacher("hint_field", self.hint_field, self.roster)

    @property
    def model_hint_fields(self) -> dict[str, str | None]:
        """Each model's hint field by roster name, the one rule of who sees a hint: each teacher its own
        (:attr:`hint_fields`); θ's template the field every teacher shares (as in a pair), else none."""
        fields = self.hint_fields
        shared = set(fields.values())
        return {**fields, THETA: shared.pop() if len(shared) == 1 else None}


def per_teacher(name: str, value: PerTeacher | None, roster: Roster) -> dict[str, str | None]:
    """The setting ``name`` of each teacher of ``roster`` (a :data:`PerTeacher` value): ``{teacher: value}`` in roster
    order, by the roster's rules (:meth:`~dual_sampling.roster.Roster.per_teacher`); each value a string or None."""
    own = roster.per_teacher(name, value)
    if isinstance(value, dict) and not all(isinstance(v, str) for v in value.values()):
        raise ValueError(f"{name}: each teacher's value must be a string, got {value!r}")
    return own


def composed_parts(cls: type) -> dict[str, type]:
    """The fields of the config class ``cls`` that are configs of their own: field name → its class."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}


def flat_keys(cls: type) -> dict[str, str]:
    """Which part of the config class ``cls`` each flat key belongs to (``"run"`` for its own fields); a name two
    parts share is refused (a flag, a YAML key and a manifest could not tell them apart)."""
    parts = composed_parts(cls)
    owner: dict[str, str] = {}
    for part, part_cls in {RUN: cls, **parts}.items():
        for f in dataclasses.fields(part_cls):
            if part == RUN and f.name in parts:  # a composed part: its own fields are the keys
                continue
            if f.name in owner:
                raise TypeError(
                    f"setting {f.name!r} is a field of both the {owner[f.name]} and the {part} options; "
                    "a flat key must name one setting"
                )
            owner[f.name] = part
    return owner


def compose_settings(cls: type, settings: dict[str, Any]) -> Any:
    """The config ``cls`` from flat keys (CLI flags, a YAML file): each key goes to the part that owns it, over the
    run's own defaults for that part (``cls.PART_DEFAULTS``). An unknown key is refused by name."""
    owner = flat_keys(cls)
    parts = composed_parts(cls)
    defaults = getattr(cls, "PART_DEFAULTS", {})
    values: dict[str, dict[str, Any]] = {RUN: {}, **{part: dict(defaults.get(part, {})) for part in parts}}
    for key, value in settings.items():
        part = owner.get(key)
        if part is None:
            raise ValueError(f"unknown setting {key!r}; known: {sorted(owner)}")
        values[part][key] = value
    return cls(**values[RUN], **{part: part_cls(**values[part]) for part, part_cls in parts.items()})


def flat_settings(config: Any) -> dict[str, Any]:
    """Every setting of a composed config as one flat mapping (the inverse of :func:`compose_settings`)."""
    parts = composed_parts(type(config))
    out = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in parts}
    for part in parts:
        out.update(dataclasses.asdict(getattr(config, part)))
    return out


def identity_settings(config: Any, excluded: frozenset[str]) -> dict[str, Any]:
    """The flat settings of ``config`` but ``excluded``, as a run's identity holds them: several teachers as
    ``[name, folder]`` pairs in order (their order names whose weight each α is, which a
    mapping's comparison would not see)."""
    out = {k: v for k, v in flat_settings(config).items() if k not in excluded}
    if isinstance(out.get("teacher"), dict):
        out["teacher"] = [[name, folder] for name, folder in out["teacher"].items()]
    return out


def runtime_only(cls: type) -> frozenset[str]:
    """The flat keys of the config class ``cls`` marked RUNTIME_ONLY (``dual_sampling.options``): they change how a
    run draws its samples, never which."""
    return frozenset(
        f.name
        for part_cls in (cls, *composed_parts(cls).values())
        for f in dataclasses.fields(part_cls)
        if not f.metadata.get("changes_records", True)
    )


def changed_settings(cls: type, saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The flat keys whose values differ between a run's saved identity and ``now`` (both as JSON would hold them).

    A key the saved identity lacks is a setting added since that run started; at the default of its field in
    ``cls`` (or a part of it) it draws as the run did, since a new setting's default keeps the old behaviour, so
    it is no change: a run resumes across an upgrade that added settings.
    """
    defaults: dict[str, Any] = {}
    for part_cls in (cls, *composed_parts(cls).values()):
        for f in dataclasses.fields(part_cls):
            if f.default is not dataclasses.MISSING:
                defaults[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                defaults[f.name] = f.default_factory()
    defaults = json.loads(json.dumps(defaults, default=str))  # as the identities hold them: tuples are lists
    return sorted(
        k for k in set(saved) | set(now) if (saved[k] if k in saved else defaults.get(k, saved)) != now.get(k)
    )
