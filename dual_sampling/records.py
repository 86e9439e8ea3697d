"""What generate() returns: per-request and per-sample records (whole, or as deltas while they stream), plus the
original API's fields."""

from __future__ import annotations

import importlib
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field, fields, replace
from typing import Any

import numpy as np

from dual_sampling.roster import PAIR, TOKEN_COLUMNS

__all__ = [
    "BEST_OF_SCORES",
    "USER_SCORE",
    "DualGenerationOutput",
    "RequestRecord",
    "SampleDelta",
    "SampleRecord",
    "TokenRecords",
    "best_of",
    "best_of_score",
    "effective_sample_size",
    "own_and_other",
    "score_function",
    "scored",
]


def effective_sample_size(log_weights: list[float]) -> float:
    """Kish ESS (Σw)² / Σw² of importance weights given as logs; nan for none."""
    if not log_weights:
        return math.nan
    top = max(log_weights)
    w = [math.exp(x - top) for x in log_weights]
    return math.fsum(w) ** 2 / math.fsum(x * x for x in w)


DENSE_ROLES = PAIR.names
"""The order of the role axis of :attr:`SampleRecord.dense_ids` and :attr:`SampleRecord.dense_logp`."""

DENSE_FIELDS: dict[str, tuple[int, int]] = {
    name: (role, part)
    for role, (own, other) in enumerate(zip(DENSE_ROLES, DENSE_ROLES[::-1]))
    for part, name in enumerate((f"{own}_top_ids", f"{own}_top_logprobs", f"{own}_top_{other}_logprobs"))
}
"""The name of each dense array on the wire (the server's ``dual_sampling`` field): (role index, part), part 0 the
role's top-k ids, 1 its own log-probabilities at them, 2 the other model's at the same ids."""


def own_and_other(dense_logp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A pair's dense values, ``[n, 2, 2, k]`` (whose tokens, whose log π: the session's and the decision's form), as
    a sample's two ``[n, 2, k]`` arrays: each model's log π at its own tokens (:attr:`SampleRecord.dense_logp`) and
    the other model's at them (:attr:`SampleRecord.dense_other_logp`)."""
    roles = np.arange(len(DENSE_ROLES))
    if dense_logp.shape[1:3] != (len(roles), len(roles)):
        raise ValueError(f"dense_logp of shape {dense_logp.shape}: a pair's own and other values need [n, 2, 2, k]")
    return dense_logp[:, roles, roles], dense_logp[:, roles, roles[::-1]]


@dataclass(kw_only=True)
class TokenRecords:
    """A sequence's records in the roster's token columns (:data:`~dual_sampling.roster.TOKEN_COLUMNS`), one entry
    per generated token; a sample's and a beam's. Keyword fields: each record class keeps its own fields' order."""

    alpha: list[float] = field(default_factory=list)
    """Teacher weight α used at each token."""
    logp_teacher: list[float] = field(default_factory=list)
    """log π_t(token): log-softmax of the teacher's untempered logits at the sampled token."""
    logp_theta: list[float] = field(default_factory=list)
    """log π_θ(token), likewise for theta."""
    logq: list[float] = field(default_factory=list)
    """log-probability of the token under the distribution actually sampled from."""


@dataclass
class SampleRecord(TokenRecords):
    """One generated sequence. Per-token lists have one entry per generated token."""

    text: str
    token_ids: list[int]
    """The tokens the teacher processor decided (from shared memory)."""
    finish_reason: str | None
    """"stop", "length", "abort" (ended by an abort), or "error" (then ``error`` names the failure)."""
    seed: int
    _: KW_ONLY  # the rest by name: a positional value can never land in another field
    teacher_token_ids: list[int] = field(default_factory=list)
    """The token ids as the teacher engine emitted them (with several teachers, the first teacher's engine)."""
    theta_token_ids: list[int] = field(default_factory=list)
    """The token ids as the theta engine emitted them (equal to both others unless the sample failed)."""
    error: str | None = None
    """Why the sample failed, as "<code> at step <n>" (sync_timeout, bad_logits, preempted, diverged, ...);
    None if it did not."""
    stop_reason: str | int | None = None
    """The stop string, or the stop token id, that ended the sample; "weight_update" for a sample aborted
    because its engines took new weights."""
    teacher_version: str = "0"
    """The teacher's weight version that drew every token ("0": the weights it started with). With several teachers,
    the first teacher's (teachers of such a roster keep the weights they started with)."""
    theta_version: str = "0"
    """Theta's weight version that drew every token: the policy whose π_θ the importance weights refer to. Where the
    tokens span θ updates taken while ``pause(mode="keep")`` held the sample, its first token's (and
    :attr:`theta_versions` names each token's)."""
    theta_versions: list[str] | None = None
    """Only for a sample whose tokens span θ updates taken while ``pause(mode="keep")`` held it: the θ version that
    drew each token (its ``logp_theta`` is that version's, and ``logq`` the law it was drawn from). None otherwise."""
    dense_ids: np.ndarray | None = None
    """``[n, 2, k]`` int32 for a sample asked with dense_logprobs k (None otherwise): before each generated token,
    the teacher's k most likely tokens (``[:, 0]``) and theta's (``[:, 1]``), most likely first. With several
    teachers, ``[n, M, k]``: each model's, in roster order."""
    dense_logp: np.ndarray | None = None
    """``[n, 2, k]`` float32: log π_t of the teacher's top tokens and log π_θ of theta's, untempered and unfiltered.
    With several teachers, ``[n, M, M, k]``: ``[:, i, j]`` is model j's log π at model i's top tokens."""
    dense_other_logp: np.ndarray | None = None
    """``[n, 2, k]`` float32: the other model's at the same ids: log π_θ of the teacher's top tokens (``[:, 0]``) and
    log π_t of theta's (``[:, 1]``). With :attr:`dense_logp`, both models' log-probabilities at every recorded id.
    None with several teachers (:attr:`dense_logp` holds every model's)."""
    roster_columns: dict[str, list[float]] = field(default_factory=dict)
    """With several teachers: the per-token records by the roster's token column
    (:attr:`~dual_sampling.roster.Roster.token_columns`: ``alpha_<teacher>`` per teacher, ``logp_<model>`` per model,
    ``logq``); :attr:`logp_theta` and :attr:`logq` hold theirs too, and :attr:`alpha` and :attr:`logp_teacher` are
    empty. Empty for one teacher, whose columns are the fields above."""
    teachers: tuple[str, ...] | None = None
    """The teachers the sample's mixture took, in roster order (``generate(..., teachers=...)``); None: every teacher. A
    teacher left out weighs 0 at every token, and its ``logp_<teacher>`` column is absent from :attr:`roster_columns`
    (its engine never saw the request)."""
    score: float | None = None
    """The user score of the sample (``SamplingOptions.score``), None without one or for a sample not complete."""
    score_name: str | None = None
    """Which function gave :attr:`score` ("module:qualified name")."""

    def first(self, n: int) -> SampleRecord:
        """The sample's first ``n`` tokens with their records (every per-token field cut alike), ended by ``length``;
        ``text`` is kept whole. A prefix of a sample of q is a sample of q's prefixes: its states train as the whole
        sample's do."""
        whole = len(self.token_ids)
        if not 0 <= n <= whole:
            raise ValueError(f"n must be in [0, {whole}], got {n!r}")
        cut = {
            f.name: value[:n]
            for f in fields(self)
            if isinstance(value := getattr(self, f.name), (list, np.ndarray)) and len(value) == whole
        }
        columns = {name: values[:n] for name, values in self.roster_columns.items()}
        if self.theta_versions is not None and len(set(self.theta_versions[:n])) <= 1:
            cut["theta_versions"] = None  # the prefix was drawn by one θ: its theta_version (the first token's) says so
        return replace(self, **cut, roster_columns=columns, finish_reason="length" if n < whole else self.finish_reason)

    def columns(self) -> dict[str, list[float]]:
        """Every per-token record column of the sample's roster, by its name (a pair's :data:`TOKEN_COLUMNS`, or
        :attr:`roster_columns`), in roster order."""
        return dict(self.roster_columns) or {name: getattr(self, name) for name in TOKEN_COLUMNS}

    def dense_pair(self, teacher: int, theta: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The dense records of two models of the sample's roster (positions ``teacher`` and ``theta``) in a pair's
        form, ``[n, 2, k]`` each: their top ids (the teacher's first), each one's log π at its own ids, and the other
        one's at them, as :attr:`dense_ids`, :attr:`dense_logp` and :attr:`dense_other_logp` hold a pair's (which a
        sample of one teacher returns as they are)."""
        if self.dense_ids is None:
            raise ValueError("dense_pair: the sample was drawn without dense_logprobs")
        if self.dense_logp.ndim == 3:  # a pair's
            return self.dense_ids, self.dense_logp, self.dense_other_logp
        both = np.array([teacher, theta])
        return (
            self.dense_ids[:, both],
            self.dense_logp[:, both, both],
            self.dense_logp[:, both, both[::-1]],
        )

    @property
    def total_alpha(self) -> list[float]:
        """The total teacher weight Σα at each token: :attr:`alpha` for one teacher; with several, the sum of their
        ``alpha_<teacher>`` columns (:attr:`~dual_sampling.roster.Roster.alpha_columns`)."""
        if not self.roster_columns:
            return list(self.alpha)
        alphas = [column for name, column in self.roster_columns.items() if name.startswith("alpha_")]
        return [math.fsum(at_token) for at_token in zip(*alphas)]

    @property
    def ok(self) -> bool:
        """Complete and verified: usable as training data (not failed, not aborted)."""
        return self.error is None and self.finish_reason in ("stop", "length")

    @property
    def log_w_theta(self) -> float:
        """Σ (log π_θ − log q): the sequence's log importance weight towards theta."""
        return math.fsum(a - b for a, b in zip(self.logp_theta, self.logq))

    @property
    def log_w_teacher(self) -> float:
        """Σ (log π_t − log q): the sequence's log importance weight towards the teacher (one teacher; with several,
        each teacher's is Σ (logp_<teacher> − logq) of :attr:`roster_columns`)."""
        if self.roster_columns:
            raise ValueError("log_w_teacher: a sample of several teachers has one weight per teacher (roster_columns)")
        return math.fsum(a - b for a, b in zip(self.logp_teacher, self.logq))


@dataclass
class SampleDelta:
    """New tokens of one sample as the engines produce them; the last delta of a sample carries the verified sample."""

    token_ids: list[int]
    records: np.ndarray
    """``[r, columns]`` float32, the roster's token columns (a pair: α, log π_t, log π_θ, log q) of the first r of
    these tokens (r = len(token_ids) unless the row failed: a forced token has no record). Provisional until
    ``sample``."""
    sample: SampleRecord | None = None
    """Set on the last delta only: the whole sample, checked against both engines."""
    top: tuple[np.ndarray, ...] | None = None
    """For requests with top_logprobs k: (token ids, log q, then each model's log π in roster order, of the models the
    request ran: a pair's log π_t, log π_θ) ``[r, k]`` of q's k most likely tokens at each of the r recorded tokens
    (the candidates a beam search extends by)."""
    dense: tuple[np.ndarray, ...] | None = None
    """For requests with dense_logprobs k: a pair's (token ids, own log-probabilities, the other model's) ``[r, 2, k]``,
    the teacher's top k at ``[:, 0]`` and theta's at ``[:, 1]``; with several teachers (ids ``[r, M, k]``,
    log-probabilities ``[r, M, M, k]``) (see :attr:`SampleRecord.dense_ids`)."""
    columns: tuple[str, ...] | None = None
    """The names of :attr:`records`' columns where they are not all the roster's token columns: a request that left
    teachers out has no ``logp_<teacher>`` column for them. None: the roster's."""


_SCORED_RECORDS = ("logq", "logp_theta", "logp_teacher")
BEST_OF_SCORES = (*_SCORED_RECORDS, *(f"{name}_mean" for name in _SCORED_RECORDS))
"""The scores best_of ranks by: a per-token record summed over the sample, or with ``_mean`` averaged per token."""


USER_SCORE = "score"
"""The best_of score that ranks by :attr:`SampleRecord.score`, the user's function (set where one is given)."""


def best_of_score(sample: SampleRecord, name: str) -> float:
    """A sample's best_of score ``name`` (one of :data:`BEST_OF_SCORES`, or :data:`USER_SCORE`): logq, logp_theta or
    logp_teacher summed over its tokens, or with ``_mean`` their mean per token (length-normalised: a sum favours
    short samples, since every token adds a negative log-probability); or the user score.

    -inf for a sample that failed or was aborted, so it ranks below every complete one.
    """
    if sample.error is not None or sample.finish_reason == "abort":
        return -math.inf
    if name == USER_SCORE:
        return -math.inf if sample.score is None else sample.score
    values = getattr(sample, name.removesuffix("_mean"))
    total = math.fsum(values)
    return total / max(len(values), 1) if name.endswith("_mean") else total


def best_of(samples: Sequence[SampleRecord], n: int, score: str) -> list[int]:
    """Indices of the ``n`` samples with the highest :func:`best_of_score` (best first; equal scores keep their draw
    order, so a ranking is the same every run), ranked within one version.

    Scores of samples drawn by different weights do not compare (an update can land between the draws of one
    request when it has more draws than free slots), so samples are ranked only among those of one (teacher, theta)
    version pair: the pair that drew the most samples (ties: the pair whose first sample comes later in ``samples``).
    A sample whose tokens span θ updates (``theta_versions``) counts as drawn by its θ versions in order ("1 then 2").
    ValueError naming ``best_of`` if that pair drew fewer than ``n``.
    """
    groups: dict[tuple[str, str], list[int]] = {}
    for i, sample in enumerate(samples):
        # A sample spanning θ updates (``theta_versions``) ranks only with samples that spanned the same ones.
        versions = (
            sample.teacher_version,
            " then ".join(dict.fromkeys(sample.theta_versions or [sample.theta_version])),
        )
        groups.setdefault(versions, []).append(i)
    order = list(groups)
    chosen = max(order, key=lambda pair: (len(groups[pair]), order.index(pair)))
    if len(groups[chosen]) < n:
        drawn = ", ".join(f"{len(groups[p])} by teacher {p[0]!r} and theta {p[1]!r}" for p in order)
        raise ValueError(
            f"best_of: the samples were drawn by different weights ({drawn}: an update landed between them), too few "
            f"by one version to rank n={n}; draw again"
        )
    return sorted(groups[chosen], key=lambda i: -best_of_score(samples[i], score))[:n]


ScoreFunction = Callable[[Any, SampleRecord], float]
"""A user score: f(prompt, sample) -> a finite number, higher is better (``prompt``: the caller's, text or ids)."""


def score_function(spec: str | ScoreFunction) -> tuple[str, ScoreFunction]:
    """(name, function) of a user score given as a callable or as "module:function" (a dotted path after the colon
    reaches a class's method). ValueError naming ``score`` if it is neither, or cannot be imported."""
    if callable(spec):
        module, name = getattr(spec, "__module__", None) or "?", getattr(spec, "__qualname__", type(spec).__name__)
        return f"{module}:{name}", spec
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"score must be a callable or 'module:function', got {spec!r}")
    module_name, path = spec.split(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in path.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"score {spec!r} cannot be imported: {exc}") from None
    if not callable(target):
        raise ValueError(f"score {spec!r} is not callable")
    return spec, target


def scored(sample: SampleRecord, prompt: Any, spec: str | ScoreFunction) -> SampleRecord:
    """``sample`` with its user score and the score's name; a sample that is not complete is left unscored. A
    function that raises, or returns anything but a finite number, fails the sample by name (``score_error``): its
    value is never used as a score."""
    if not sample.ok:
        return sample
    name, function = score_function(spec)
    try:
        value = function(prompt, sample)
    except Exception as exc:
        return replace(sample, error=f"score_error: {name} raised {type(exc).__name__}: {exc}", finish_reason="error")
    try:  # a number of any kind (numpy's and torch's scalars too), but no bool, string or container
        number = None if isinstance(value, (bool, str, bytes)) else float(value)
    except (TypeError, ValueError, OverflowError):
        number = None
    if number is None or not math.isfinite(number):
        return replace(
            sample, error=f"score_error: {name} returned {value!r}, not a finite number", finish_reason="error"
        )
    return replace(sample, score=number, score_name=name)


@dataclass
class RequestRecord:
    """One prompt pair and its samples."""

    index: int
    teacher_prompt_token_ids: list[int]
    theta_prompt_token_ids: list[int]
    samples: list[SampleRecord]


@dataclass
class DualGenerationOutput:
    """Result of :meth:`OptimalSamplingDual.generate`, in prompt order."""

    requests: list[RequestRecord]

    @property
    def generated_texts(self) -> list[str]:
        """Texts of every sample, prompt-major (n per prompt)."""
        return [s.text for r in self.requests for s in r.samples]

    @property
    def generated_ids(self) -> list[list[int]]:
        return [s.token_ids for r in self.requests for s in r.samples]

    @property
    def num_tokens(self) -> list[int]:
        return [len(s.token_ids) for r in self.requests for s in r.samples]

    @property
    def alpha_stats(self) -> dict[str, float]:
        """mean, std, min, max and median of α over every generated token, and the token count (one teacher; with
        several, each teacher's α is in its samples' ``roster_columns``)."""
        if any(s.roster_columns for r in self.requests for s in r.samples):
            raise ValueError("alpha_stats: samples of several teachers have one α per teacher (roster_columns)")
        values = [a for r in self.requests for s in r.samples for a in s.alpha]
        if not values:
            return {"count": 0}
        return {
            "count": len(values),
            "mean": statistics.fmean(values),
            "std": statistics.pstdev(values),
            "min": min(values),
            "max": max(values),
            "median": statistics.median(values),
        }
