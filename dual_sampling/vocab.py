"""Checks that two models can be mixed token by token: identical tokenizers, known vocab sizes."""

from __future__ import annotations

__all__ = ["check_tokenizers_match"]


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
