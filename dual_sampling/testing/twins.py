"""Tiny twins of real model families: random-weight pairs that keep each family's quirks that matter to an engine.

``twin_pair(name)`` gives a (teacher folder, theta folder) pair, built offline in seconds from transformers' config
classes on the SmolLM2 tokenizer (49,152 ids) and cached like every model of :mod:`dual_sampling.models`. Every twin
has two layers, hidden size 128 and head_dim 64 (the smallest head size vLLM's CPU attention accepts); the teacher
is sharper (output logits of std 4) than theta (std 2), so α varies from token to token. The quirks are what a real
checkpoint of the family has, with the tokenizer's ids standing in for the family's special tokens
(``<|endoftext|>`` = 0, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2, ``<file_sep>`` = 5):

=================  ===============================  ====================================================================
pair               stands for (teacher / theta)     quirks
=================  ===============================  ====================================================================
``qwen2.5``        Qwen2.5-7B / Qwen2.5-1.5B        Qwen2 with q/k/v biases; *unequal* padding past the tokenizer:
                                                    teacher untied with 320 extra rows (7B: 152,064 rows), theta tied
                                                    with 192 (1.5B: 151,936); generation_config eos [2, 0] (as
                                                    [<|im_end|>, <|endoftext|>]); rope_theta 1e6
``qwen2.5-alike``  Qwen2.5-3B / Qwen2.5-1.5B        the same family with *equal* padding (192 extra rows each), both
                                                    tied: the padded pair vLLM's speculative mode takes
``qwen3``          Qwen3-4B / Qwen3-0.6B            Qwen3 with q/k norms (weights not all ones), both tied, 192 extra
                                                    rows each (151,936 rows over 151,669 ids), eos [2, 0]
``llama3.2``       Llama-3.1-8B / Llama-3.2-1B      teacher untied, theta tied; the tokenizer adds a BOS (1) on encode;
                                                    three EOS ids [0, 5, 2] in config and generation_config (as
                                                    [<|end_of_text|>, <|eom_id|>, <|eot_id|>]: the tokenizer's own eos
                                                    last); llama3 rope scaling (factors 8 and 32), rope_theta 5e5
``gemma3``         Gemma-3-1B / Gemma-3-270M        Gemma3ForCausalLM, both tied; embeddings scaled by √hidden;
                                                    layer 0 sliding-window (16 tokens, local rope_theta 1e4), layer 1
                                                    global (1e6); q/k norms; query_pre_attn_scalar ≠ head_dim (as
                                                    Gemma 3 27B's 168 against 128); BOS added; eos [2, 0]; final logit
                                                    soft-capping at 30 (Gemma 2's value: Gemma 3 checkpoints set it to
                                                    null, but the config and vLLM's model still apply it)
``mixed``          a Qwen2-architecture teacher /   two architectures over one tokenizer, equal rows (no padding),
                   a Llama-architecture student     both untied (as Llama-3.1-8B learning from Qwen2.5-32B): the
                                                    untied student of the matrix; the student's generation_config has
                                                    one eos (2), the teacher's two
``mixed-dtype``    Qwen2.5-3B in bfloat16 /         ``qwen2.5-alike`` with the teacher's config dtype and weights
                   Qwen2.5-1.5B in float32          bfloat16 (as released); theta float32
=================  ===============================  ====================================================================

Random weights put about as much mass on each row past the tokenizer's ids as on the others (0.1–0.4 % of a row in
all), where a trained model puts almost none. The Qwen2.5-1.5B twin (theta of ``qwen2.5``, ``qwen2.5-alike`` and
``mixed-dtype``) goes further: its padding rows' output weights are scaled by :data:`_PADDING_LOGIT_SCALE`, so it
puts a large share of its mass there (:data:`PADDING_MASS_PROMPT`), and a normalisation over the wrong ids is off by
a large fraction of a nat, and a draw from a sub-normalised row visibly off q. Every quirk is set so
that an engine ignoring it is off visibly (transformers, same weights, 96 positions): q/k/v biases dropped, up to
13–30 nats; q/k norm weights dropped, 10–13; no sliding window, 22; head_dim in place of query_pre_attn_scalar, 4.6;
no soft-capping, 0.5–5.4; no llama3 rope scaling, 0.07–0.15.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dual_sampling.models import provision
from dual_sampling.testing.tiny_models import smollm2_tokenizer

__all__ = ["PADDING_MASS_PROMPT", "TWIN_PAIRS", "TWIN_TRIOS", "TwinModel", "twin_pair", "twin_trio"]

_ENDOFTEXT, _IM_END, _FILE_SEP = 0, 2, 5
"""SmolLM2 tokenizer ids standing in for each family's end-of-text, end-of-turn and other EOS tokens."""

_QWEN_EOS = (_IM_END, _ENDOFTEXT)
"""Qwen2.5's and Qwen3's generation_config eos_token_id [151645, 151643]: <|im_end|> (the tokenizer's eos), then
<|endoftext|>."""

_GEMMA_EOS = (_IM_END, _ENDOFTEXT)
"""Gemma 3's eos_token_id [1, 106] (config and generation_config): <eos> (the tokenizer's eos), <end_of_turn>."""

_LLAMA3_EOS = (_ENDOFTEXT, _FILE_SEP, _IM_END)
"""Llama 3.1/3.2's eos_token_id [128001, 128008, 128009]: <|end_of_text|>, <|eom_id|>, <|eot_id|> (the instruct
tokenizer's eos, last)."""

_ROPE_LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
"""Llama 3.1/3.2's rope scaling, less its factor (8 and 32) and original context (set per twin)."""

_LLAMA3_ROPE_CONTEXT = 256
"""The twins' original_max_position_embeddings (Llama 3's is 8,192): llama3 scaling slows the rotary frequencies
whose wavelength exceeds it, and at 8,192 those barely turn over the tests' few dozen positions."""

_TIED_RESIDUAL_BOOST = 100.0
"""Factor on the layers' contributions to the residual stream of tied twins (``tiny_models._tiny_model`` says why:
without it the stream is the last token's own embedding and the model repeats its input)."""

_QWEN2_BIAS_STD = 0.5
"""Std of the q/k/v biases of Qwen2 twins: large enough against q/k/v entries of about 0.2 that an engine dropping
them is off by far more than the suite's tolerances (transformers zero-initialises them)."""

_GEMMA_QUERY_PRE_ATTN_SCALAR = 96
"""Gemma 3 scales attention scores by query_pre_attn_scalar**-0.5, not head_dim**-0.5 (64 here)."""

_GEMMA_SLIDING_WINDOW = 16
"""Tokens a sliding-window layer of the Gemma twin attends to: short, so the tests' prompts reach past it."""

_PADDING_LOGIT_SCALE = 2.3
"""Scale on the Qwen2.5-1.5B twin's output rows past the tokenizer: logits of std 4.6 instead of 2 on 192 rows."""

PADDING_MASS_PROMPT = "1, 2, 3, 4,"
"""A prompt after which the Qwen2.5-1.5B twin puts a large share of its mass past the tokenizer's ids (the tests
check the share they rely on)."""

_GEMMA_SOFTCAP = 30.0
"""Gemma 2's final_logit_softcapping: logits become 30·tanh(logit/30), which moves the teacher's largest logits
(about 18) by about 2."""

Family = Literal["qwen2", "qwen3", "llama", "gemma3"]


@dataclass(frozen=True)
class TwinModel:
    """One tiny twin: a random-weight model of ``family`` on the SmolLM2 tokenizer.

    ``extra_rows``: embedding rows past the tokenizer's ids. ``eos_ids``: generation_config.eos_token_id (one id is
    written as an int); ``eos_in_config``: config.eos_token_id lists them all too (else it is the first).
    ``logit_std``: std of the output logits (nats); ``padding_scale``: a factor on the output rows past the
    tokenizer's ids. ``rope_factor``/``rope_context``: llama3 rope scaling's factor
    and original_max_position_embeddings (llama only). ``dtype``: the config's and the saved weights' dtype.
    """

    stands_for: str
    family: Family
    extra_rows: int
    tied: bool
    eos_ids: tuple[int, ...]
    seed: int
    logit_std: float
    eos_in_config: bool = False
    adds_bos: bool = False
    rope_factor: float | None = None
    rope_context: int | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    padding_scale: float = 1.0

    def folder(self) -> Path:
        """Build (once) and return this twin's folder, named by its spec so that a changed spec builds anew."""
        digest = hashlib.sha256(repr(self).encode()).hexdigest()[:10]
        tokenizer_dir = _bos_tokenizer() if self.adds_bos else smollm2_tokenizer()
        return provision(f"twin-{self.stands_for}-{digest}", lambda out: _build(self, tokenizer_dir, out))


_QWEN25_7B = TwinModel("qwen2.5-7b", "qwen2", extra_rows=320, tied=False, eos_ids=_QWEN_EOS, seed=1, logit_std=4.0)
_QWEN25_3B = TwinModel("qwen2.5-3b", "qwen2", extra_rows=192, tied=True, eos_ids=_QWEN_EOS, seed=1, logit_std=4.0)
_QWEN25_1_5B = TwinModel(
    "qwen2.5-1.5b",
    "qwen2",
    extra_rows=192,
    tied=True,
    eos_ids=_QWEN_EOS,
    seed=2,
    logit_std=2.0,
    padding_scale=_PADDING_LOGIT_SCALE,
)
_QWEN3_4B = TwinModel("qwen3-4b", "qwen3", extra_rows=192, tied=True, eos_ids=_QWEN_EOS, seed=1, logit_std=4.0)
_QWEN3_0_6B = TwinModel("qwen3-0.6b", "qwen3", extra_rows=192, tied=True, eos_ids=_QWEN_EOS, seed=2, logit_std=2.0)
_LLAMA31_8B = TwinModel(
    "llama3.1-8b",
    "llama",
    0,
    tied=False,
    eos_ids=_LLAMA3_EOS,
    seed=1,
    logit_std=4.0,
    eos_in_config=True,
    adds_bos=True,
    rope_factor=8.0,
    rope_context=_LLAMA3_ROPE_CONTEXT,
)
_LLAMA32_1B = dataclasses.replace(
    _LLAMA31_8B, stands_for="llama3.2-1b", tied=True, seed=2, logit_std=2.0, rope_factor=32.0
)
_GEMMA3_1B = TwinModel(
    "gemma3-1b", "gemma3", 0, tied=True, eos_ids=_GEMMA_EOS, seed=1, logit_std=4.0, eos_in_config=True, adds_bos=True
)
_GEMMA3_270M = dataclasses.replace(_GEMMA3_1B, stands_for="gemma3-270m", seed=2, logit_std=2.0)
_QWEN2_ARCH = TwinModel("qwen2-arch", "qwen2", 0, tied=False, eos_ids=_QWEN_EOS, seed=1, logit_std=4.0)
_LLAMA_ARCH = TwinModel("llama-arch", "llama", 0, tied=False, eos_ids=(_IM_END,), seed=2, logit_std=2.0)

TWIN_PAIRS: dict[str, tuple[TwinModel, TwinModel]] = {
    "qwen2.5": (_QWEN25_7B, _QWEN25_1_5B),
    "qwen2.5-alike": (_QWEN25_3B, _QWEN25_1_5B),
    "qwen3": (_QWEN3_4B, _QWEN3_0_6B),
    "llama3.2": (_LLAMA31_8B, _LLAMA32_1B),
    "gemma3": (_GEMMA3_1B, _GEMMA3_270M),
    "mixed": (_QWEN2_ARCH, _LLAMA_ARCH),
    "mixed-dtype": (dataclasses.replace(_QWEN25_3B, dtype="bfloat16"), _QWEN25_1_5B),
}
"""(teacher, theta) of every named twin pair; the module's table says which real models each stands for."""


TWIN_TRIOS: dict[str, tuple[dict[str, TwinModel], TwinModel]] = {
    "mixed-trio": (
        {
            "qwen": _QWEN2_ARCH,
            "llama": dataclasses.replace(_LLAMA_ARCH, stands_for="llama-arch-teacher", seed=3, logit_std=4.0),
        },
        _QWEN25_1_5B,
    ),
}
"""(teachers by name, theta) of every named twin trio: ``mixed-trio`` has a Qwen2-architecture and a
Llama-architecture teacher (both untied, no padding rows, one EOS id and two) and the Qwen2.5-1.5B twin as theta
(tied, 192 padding rows that take much of its mass), all on one tokenizer."""


def twin_trio(name: str) -> tuple[dict[str, Path], Path]:
    """({teacher name: folder}, theta folder) of the twin trio ``name`` (a key of :data:`TWIN_TRIOS`), built once."""
    if name not in TWIN_TRIOS:
        raise ValueError(f"twin_trio name must be one of {sorted(TWIN_TRIOS)}, got {name!r}")
    teachers, theta = TWIN_TRIOS[name]
    return {teacher: spec.folder() for teacher, spec in teachers.items()}, theta.folder()


def twin_pair(name: str) -> tuple[Path, Path]:
    """(teacher folder, theta folder) of the twin pair ``name`` (a key of :data:`TWIN_PAIRS`), built once."""
    if name not in TWIN_PAIRS:
        raise ValueError(f"twin_pair name must be one of {sorted(TWIN_PAIRS)}, got {name!r}")
    teacher, theta = TWIN_PAIRS[name]
    return teacher.folder(), theta.folder()


def _bos_tokenizer() -> Path:
    """The SmolLM2 tokenizer, saved so that it adds its BOS (``<|im_start|>``, id 1) on encode.

    transformers writes ``add_bos_token`` into tokenizer.json's post-processor (a TemplateProcessing), so every
    loader of the folder (transformers, vLLM) adds it, as Llama 3's and Gemma's tokenizers do.
    """

    def build(out: Path) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer())
        tokenizer.add_bos_token = True
        tokenizer.save_pretrained(out)

    return provision("smollm2-tokenizer-bos", build)


def _config(spec: TwinModel, tokenizer):
    """The transformers config of ``spec``: two layers, hidden 128, two query heads sharing one key/value head."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    common = {
        "vocab_size": len(tokenizer) + spec.extra_rows,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": spec.tied,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": list(spec.eos_ids) if spec.eos_in_config else spec.eos_ids[0],
        "pad_token_id": tokenizer.pad_token_id,
        "dtype": spec.dtype,
    }
    if spec.family == "qwen2":
        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if spec.family == "qwen3":
        return Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if spec.family == "llama":
        rope = {"rope_type": "default", "rope_theta": 500000.0}
        if spec.rope_factor is not None:
            rope = {**_ROPE_LLAMA3, "factor": spec.rope_factor, "original_max_position_embeddings": spec.rope_context}
        return LlamaConfig(**common, rope_parameters=rope)
    return Gemma3TextConfig(
        **common,
        query_pre_attn_scalar=_GEMMA_QUERY_PRE_ATTN_SCALAR,
        sliding_window=_GEMMA_SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=_GEMMA_SOFTCAP,
    )


def _build(spec: TwinModel, tokenizer_dir: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = _config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Logits of a few units' std (the default init gives near-uniform rows): see tiny_models._tiny_model.
        model.get_output_embeddings().weight.normal_(0.0, spec.logit_std / config.hidden_size**0.5)
        model.get_output_embeddings().weight[len(tokenizer) :].mul_(spec.padding_scale)
        for layer in model.model.layers:
            _set_family_quirks(spec, layer)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=list(spec.eos_ids) if len(spec.eos_ids) > 1 else spec.eos_ids[0],
        pad_token_id=config.pad_token_id,
    )
    model.to(getattr(torch, spec.dtype)).save_pretrained(out)
    tokenizer.save_pretrained(out)


def _set_family_quirks(spec: TwinModel, layer) -> None:
    """Give one decoder layer's family-specific weights values an engine cannot ignore, and boost a tied twin's
    residual contributions (in place, under no_grad)."""
    attn = layer.self_attn
    if spec.family == "qwen2":
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.bias.normal_(0.0, _QWEN2_BIAS_STD)
    if spec.family == "qwen3":
        # Qwen3's norms multiply by their weight (initialised to ones).
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
    if spec.family == "gemma3":
        # Gemma's norms multiply by 1 + weight (initialised to zeros), and normalise each layer's output before it
        # joins the residual stream: a tied twin's boost goes on those post-norms, not on the projections.
        attn.q_norm.weight.uniform_(-0.5, 0.5)
        attn.k_norm.weight.uniform_(-0.5, 0.5)
        if spec.tied:
            layer.post_attention_layernorm.weight.fill_(_TIED_RESIDUAL_BOOST - 1.0)
            layer.post_feedforward_layernorm.weight.fill_(_TIED_RESIDUAL_BOOST - 1.0)
    elif spec.tied:
        attn.o_proj.weight.mul_(_TIED_RESIDUAL_BOOST)
        layer.mlp.down_proj.weight.mul_(_TIED_RESIDUAL_BOOST)
