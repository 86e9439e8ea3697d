"""Beam search over q: the beams, and one step of extending them (``OptimalSamplingDual.beam_search`` drives it).

The shape is vLLM's ``LLM.beam_search`` (itself transformers'): at each step every live beam asks the decision for
q's 2·beam_width most likely next tokens; each candidate extends its beam by one token, adding its log q to the
beam's cumulative log q; a candidate that is an EOS id ends its beam (unless ``ignore_eos``); the beam_width best
of the rest live on. At the end the finished and the live beams are ranked by cum log q / length^length_penalty,
the length counting generated tokens without a final EOS (vLLM's counts the prompt's tokens too, so its ranking
depends on the prompt and this one does not). Every token of a beam keeps its α, log π_t, log π_θ and
log q: q here is the mixture at temperature 1 with no filter, the law the beam's score sums.

:func:`beam_samples` runs one prompt's search as the samples a request returns (``SamplingOptions.use_beam_search``
in ``generate()``, the server and data runs): each beam a :class:`~dual_sampling.records.SampleRecord`, and a search
that fails or spans two weight versions fails its beams by name, never its neighbours'.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from dual_sampling.checks import is_count, is_number, need_int, require
from dual_sampling.records import SampleRecord, TokenRecords
from dual_sampling.roster import TOKEN_COLUMNS
from dual_sampling.text import sample_text

__all__ = [
    "MAX_BEAM_WIDTH",
    "BeamSearchOptions",
    "BeamSequence",
    "BeamStepFailed",
    "Candidates",
    "beam_samples",
    "beam_score",
    "beam_steps",
    "decision_candidates",
    "extend_beams",
    "run_beam_search",
    "run_beam_search_async",
]

MAX_BEAM_WIDTH = 10
"""2 × this candidates per beam and step: the decision records at most 20 of q's most likely tokens."""


class BeamStepFailed(RuntimeError):
    """One step's request of a beam search failed (the sample's own error; a dead engine raises its own error)."""


@dataclass(kw_only=True)
class BeamSearchOptions:
    """The settings of a beam search over q, as vLLM's ``BeamSearchParams`` names them."""

    beam_width: int
    """Beams kept at each step, in [1, 10]."""
    max_tokens: int
    """Generated tokens per beam at most."""
    length_penalty: float = 1.0
    """Final ranking by cum log q / length^this, the length counting generated tokens without a final EOS (1:
    per-token mean; 0: the plain sum). vLLM's ``BeamSearchParams.length_penalty`` also counts the prompt's tokens."""
    ignore_eos: bool = False
    """Keep extending past EOS ids (no beam ends before max_tokens)."""

    def __post_init__(self) -> None:
        need_int("beam_width", self.beam_width, 1, most=MAX_BEAM_WIDTH)
        require(is_count(self.max_tokens, 1), f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        require(is_number(self.length_penalty), f"length_penalty must be a finite number, got {self.length_penalty!r}")
        require(isinstance(self.ignore_eos, bool), f"ignore_eos must be true or false, got {self.ignore_eos!r}")


@dataclass
class BeamSequence(TokenRecords):
    """One beam: its generated tokens and each token's records (its score sums :attr:`logq`)."""

    tokens: list[int] = field(default_factory=list)
    _: KW_ONLY  # the rest by name: a positional value can never land in another field
    finish_reason: str | None = None
    """"stop" (it ended with an EOS id), "length" (max_tokens), or None while it lives."""
    text: str = ""
    """The generated text, without the text of an ending EOS id (as a sample's)."""

    @property
    def cum_logq(self) -> float:
        return math.fsum(self.logq)

    def sample(self, seed: int, versions: tuple[str, str], eos_ids: Sequence[int]) -> SampleRecord:
        """This finished beam as a sample's record: its tokens (as both engines took them) with their records;
        ``versions`` (teacher's, theta's) drew every token; a beam ended by an EOS id names it as its stop reason."""
        stop = self.tokens[-1] if self.finish_reason == "stop" and self.tokens[-1] in eos_ids else None
        return SampleRecord(
            self.text,
            list(self.tokens),
            self.finish_reason,
            seed,
            **{name: list(getattr(self, name)) for name in TOKEN_COLUMNS},
            teacher_token_ids=list(self.tokens),
            theta_token_ids=list(self.tokens),
            stop_reason=stop,
            teacher_version=versions[0],
            theta_version=versions[1],
        )


@dataclass
class Candidates:
    """q's most likely next tokens after one beam, from one decision: ids, log q, log π_t and log π_θ (each ``[k]``),
    and the step's α."""

    ids: Sequence[int]
    logq: Sequence[float]
    logp_teacher: Sequence[float]
    logp_theta: Sequence[float]
    alpha: float
    versions: tuple[str, str] = ("0", "0")
    """The (teacher's, theta's) weight versions that made this decision."""


def beam_score(beam: BeamSequence, eos_ids: Sequence[int], length_penalty: float) -> float:
    """cum log q / length^length_penalty, the length without a final EOS (at least 1)."""
    length = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in eos_ids else 0)
    return beam.cum_logq / (max(length, 1) ** length_penalty)


def extend_beams(
    beams: Sequence[BeamSequence], candidates: Sequence[Candidates], options: BeamSearchOptions, eos_ids: Sequence[int]
) -> tuple[list[BeamSequence], list[BeamSequence]]:
    """One step: (the beams that live on, best first; the beams that ended at this step with an EOS id).

    ``candidates[i]`` are beam i's, most likely first (the first 2·beam_width count); a candidate with log q = −inf
    (q gives it nothing) is no extension."""
    live, ended = [], []
    k = 2 * options.beam_width  # the candidates are q's most likely first
    for beam, cand in zip(beams, candidates):
        for token, lq, lt, lth in zip(cand.ids[:k], cand.logq[:k], cand.logp_teacher[:k], cand.logp_theta[:k]):
            if not math.isfinite(lq):
                continue
            new = BeamSequence(
                [*beam.tokens, int(token)],
                alpha=[*beam.alpha, float(cand.alpha)],
                logp_teacher=[*beam.logp_teacher, float(lt)],
                logp_theta=[*beam.logp_theta, float(lth)],
                logq=[*beam.logq, float(lq)],
            )
            if int(token) in eos_ids and not options.ignore_eos:
                new.finish_reason = "stop"
                ended.append(new)
            else:
                live.append(new)
    # vLLM ranks the live beams by the same length-penalised score it ranks the finished ones by.
    live.sort(key=lambda b: beam_score(b, eos_ids, options.length_penalty), reverse=True)
    return live[: options.beam_width], ended


def beam_steps(
    prompts: Sequence[tuple[list[int], list[int]]], options: BeamSearchOptions, eos_ids: Sequence[int]
) -> Generator[list[tuple[list[int], list[int]]], list[Candidates], list[list[BeamSequence]]]:
    """The search as a generator: it yields every live beam's prompts (each prompt, (teacher's ids, theta's ids),
    with the beam's tokens appended), is sent each one's :class:`Candidates`, and returns, per prompt, its
    beam_width best beams, best first. :func:`run_beam_search` and :func:`run_beam_search_async` drive it."""
    live: list[list[BeamSequence]] = [[BeamSequence()] for _ in prompts]
    ended: list[list[BeamSequence]] = [[] for _ in prompts]
    for _ in range(options.max_tokens):
        work = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not work:
            break
        candidates = yield [(prompts[i][0] + beam.tokens, prompts[i][1] + beam.tokens) for i, beam in work]
        for i in range(len(prompts)):
            mine = [k for k, (j, _) in enumerate(work) if j == i]
            live[i], done = extend_beams([work[k][1] for k in mine], [candidates[k] for k in mine], options, eos_ids)
            ended[i] += done
    out = []
    for i in range(len(prompts)):
        for beam in live[i]:
            beam.finish_reason = "length"
        ranked = sorted(ended[i] + live[i], key=lambda b: beam_score(b, eos_ids, options.length_penalty), reverse=True)
        out.append(ranked[: options.beam_width])
    return out


def run_beam_search(
    prompts: Sequence[tuple[list[int], list[int]]],
    options: BeamSearchOptions,
    eos_ids: Sequence[int],
    step: Callable[[list[tuple[list[int], list[int]]]], list[Candidates]],
) -> list[list[BeamSequence]]:
    """:func:`beam_steps` with ``step`` giving each step's candidates."""
    search = beam_steps(prompts, options, eos_ids)
    try:
        prefixes = next(search)
        while True:
            prefixes = search.send(step(prefixes))
    except StopIteration as end:
        return end.value


async def run_beam_search_async(
    prompts: Sequence[tuple[list[int], list[int]]],
    options: BeamSearchOptions,
    eos_ids: Sequence[int],
    step: Callable[[list[tuple[list[int], list[int]]]], Awaitable[list[Candidates]]],
) -> list[list[BeamSequence]]:
    """:func:`beam_steps` with the coroutine ``step`` giving each step's candidates (from a server's loop)."""
    search = beam_steps(prompts, options, eos_ids)
    try:
        prefixes = next(search)
        while True:
            prefixes = search.send(await step(prefixes))
    except StopIteration as end:
        return end.value


async def decision_candidates(stream: Callable[[Any], AsyncIterator[Any]], requests: Sequence[Any]) -> list[Candidates]:
    """Each one-token request's decision (``stream``: the driver's, yielding ``SampleDelta``): q's recorded top tokens
    with their log π_t and log π_θ, and α. BeamStepFailed, with the sample's error, for a request that failed."""

    async def one(request: Any) -> Candidates:
        top, alpha, sample = None, None, None
        async for delta in stream(request):
            if delta.top is not None and len(delta.top[0]):
                top, alpha = delta.top, float(delta.records[0, 0])
            sample = delta.sample or sample
        if sample is None or sample.error is not None or top is None:
            raise BeamStepFailed(f"a step's request failed ({sample.error if sample else 'no sample'})")
        ids, logq, logp_teacher, logp_theta = (part[0].tolist() for part in top)
        return Candidates(ids, logq, logp_teacher, logp_theta, alpha, (sample.teacher_version, sample.theta_version))

    return list(await asyncio.gather(*(one(r) for r in requests)))


async def beam_samples(
    stream: Callable[[Any], AsyncIterator[Any]],
    make_request: Callable[[list[int], list[int]], Any],
    prompt: tuple[list[int], list[int]],
    options: BeamSearchOptions,
    eos_ids: Sequence[int],
    tokenizer: Any,
    seeds: Sequence[int],
) -> list[SampleRecord]:
    """One prompt's (teacher's ids, theta's ids) beam search as ``options.beam_width`` samples, best first.

    ``make_request`` builds a step's one-token request from a beam's (teacher's, theta's) ids and ``stream`` runs it
    (:func:`decision_candidates`); ``seeds`` label the samples (a search draws nothing at random). A step that fails,
    or decisions made by more than one weight version (a score summed over two policies ranks nothing), fail every
    beam of this search alone: ``finish_reason="error"`` with the ``error`` named, no tokens, never training data.
    Fewer than beam_width beams (q gave the search fewer distinct continuations) pad with such failures too.
    """
    seen: set[tuple[str, str]] = set()

    async def step(prefixes: list[tuple[list[int], list[int]]]) -> list[Candidates]:
        found = await decision_candidates(stream, [make_request(teacher, theta) for teacher, theta in prefixes])
        seen.update(c.versions for c in found)
        return found

    def failed(seed: int, error: str) -> SampleRecord:
        return SampleRecord("", [], "error", seed, error=error)

    try:
        (beams,) = await run_beam_search_async([prompt], options, eos_ids, step)
    except BeamStepFailed as exc:  # this search's own failure; an engine's death is everyone's, and raises
        return [failed(seed, f"beam_search_failed: {exc}") for seed in seeds]
    if len(seen) > 1:
        error = f"weight_update during the beam search: its decisions came from versions {sorted(seen)}"
        return [failed(seed, error) for seed in seeds]
    versions = seen.pop() if seen else ("0", "0")
    out = []
    for k, seed in enumerate(seeds):
        if k >= len(beams):
            out.append(failed(seed, f"beam_search_short: q gave {len(beams)} beams of {options.beam_width}"))
            continue
        # A beam ended by an EOS id leaves that token's text out, as a sample does (an EOS id need not be special).
        beams[k].text = sample_text(tokenizer, beams[k].tokens, stop_token=beams[k].finish_reason == "stop")
        out.append(beams[k].sample(seed, versions, eos_ids))
    return out
