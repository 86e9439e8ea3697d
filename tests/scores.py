"""Score functions the tests name as ``module:function`` (``dual-sampling generate --score tests.scores:...``)."""

from __future__ import annotations


def response_length(prompt, sample) -> float:
    """The sample's text length in characters."""
    return float(len(sample.text))


def odd_first_token_raises(prompt, sample) -> float:
    """Raises for a sample whose first token id is odd; else returns that id."""
    if sample.token_ids[0] % 2:
        raise RuntimeError("an odd sample")
    return float(sample.token_ids[0])


NOT_CALLABLE = 3
