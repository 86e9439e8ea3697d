"""Checks that two models can be mixed token by token: identical tokenizers, known vocab sizes."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dual_sampling.modes import mode_of, modes_with

__all__ = ["check_embedding_rows", "check_tokenizers_match", "embedding_rows", "eos_token_ids"]


def check_tokenizers_match(teacher, theta) -> None:
    """Raise ValueError naming the first difference between two Hugging Face tokenizers.

    Compared: the vocabulary (token → id), and the special tokens (bos, eos, pad, unk and
    the additional ones) with their ids. Embedding rows beyond the vocabulary are allowed to
    differ; they are masked at sampling time.
    """
    v_t, v_th = teacher.get_vocab(), theta.get_vocab()
    if len(v_t) != len(v_th):
        raise ValueError(f"tokenizers differ: the teacher's vocabulary has {len(v_t)} tokens, theta's {len(v_th)}")
    if v_t != v_th:
        for token, idx in sorted(v_t.items(), key=lambda kv: kv[1]):
            if v_th.get(token) != idx:
                raise ValueError(
                    f"tokenizers differ: token {token!r} has id {idx} in the teacher and {v_th.get(token)} in theta"
                )
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        a, b = getattr(teacher, name, None), getattr(theta, name, None)
        if a != b:
            raise ValueError(f"tokenizers differ: {name} is {a!r} in the teacher and {b!r} in theta")
    a, b = sorted(map(str, teacher.all_special_tokens)), sorted(map(str, theta.all_special_tokens))
    if a != b:
        raise ValueError(
            f"tokenizers differ in special tokens: teacher only {sorted(set(a) - set(b))}, "
            f"theta only {sorted(set(b) - set(a))}"
        )


def embedding_rows(config: dict) -> int | None:
    """A model's embedding rows from its config.json: ``vocab_size``, at the top or, for models that wrap a text
    model (Gemma 3's multimodal checkpoints), in ``text_config``, where vLLM reads it; None where neither says."""
    return config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")


def check_embedding_rows(teacher_rows: int | None, theta_rows: int | None, vocab: int, mode: str) -> None:
    """Raise ValueError unless both models' embeddings (``vocab_size`` in their configs; None: not stated) cover the
    tokenizer's ``vocab`` ids, and, in a ``mode`` where theta is the teacher engine's draft model, have equally many
    rows."""
    for role, rows in (("teacher", teacher_rows), ("theta", theta_rows)):
        if rows is not None and rows < vocab:
            raise ValueError(f"the {role} model has {rows} embedding rows, fewer than the tokenizer's {vocab} tokens")
    if not mode_of(mode).theta_engine and teacher_rows != theta_rows:
        # vLLM's draft-model speculation needs equal embedding sizes (its SpeculativeConfig refuses the pair seconds
        # into the engine's start); refused here first, by name.
        raise ValueError(
            f"mode={mode!r}: the teacher has {teacher_rows} embedding rows (config vocab_size) and theta "
            f"{theta_rows}; vLLM's draft model must have as many rows as its target. {modes_with('theta_engine')} "
            "serves models with unequal padding"
        )


def eos_token_ids(model_folders: Iterable[str | Path], tokenizer) -> list[int]:
    """Every id that ends a generation, sorted: the ``eos_token_id`` (one id or a list) of each model's config.json
    and generation_config.json, and the tokenizer's. vLLM stops on the generation config's ids too: Qwen2.5's
    config.json names one of its two (``<|im_end|>``; the generation config adds ``<|endoftext|>``)."""
    ids = set(_ids(tokenizer.eos_token_id))
    for folder in model_folders:
        for name in ("config.json", "generation_config.json"):
            path = Path(folder) / name
            if path.is_file():
                config = json.loads(path.read_text())
                for section in (config, config.get("text_config", {})):
                    ids |= set(_ids(section.get("eos_token_id")))
    if not ids:
        raise ValueError("neither model nor the tokenizer defines an EOS token id")
    return sorted(ids)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
