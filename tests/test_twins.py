"""The tiny twins of real model families (``dual_sampling.testing.twins``): each builds, keeps its family's quirks,
and gives finite logits spread enough for α to vary. No engines: plain transformers on the saved folders."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from dual_sampling.testing.twins import TWIN_PAIRS, twin_pair
from dual_sampling.vocab import check_tokenizers_match

TOKENIZER_IDS = 49152
"""The SmolLM2 tokenizer's ids, which every twin shares."""

EXPECTED = {
    # pair: per model (architecture, rows past the tokenizer, tied, generation_config EOS ids, dtype)
    "qwen2.5": (
        ("Qwen2ForCausalLM", 320, False, [2, 0], "float32"),
        ("Qwen2ForCausalLM", 192, True, [2, 0], "float32"),
    ),
    "qwen2.5-alike": (
        ("Qwen2ForCausalLM", 192, True, [2, 0], "float32"),
        ("Qwen2ForCausalLM", 192, True, [2, 0], "float32"),
    ),
    "qwen3": (("Qwen3ForCausalLM", 192, True, [2, 0], "float32"), ("Qwen3ForCausalLM", 192, True, [2, 0], "float32")),
    "llama3.2": (
        ("LlamaForCausalLM", 0, False, [0, 5, 2], "float32"),
        ("LlamaForCausalLM", 0, True, [0, 5, 2], "float32"),
    ),
    "gemma3": (("Gemma3ForCausalLM", 0, True, [2, 0], "float32"), ("Gemma3ForCausalLM", 0, True, [2, 0], "float32")),
    "mixed": (("Qwen2ForCausalLM", 0, False, [2, 0], "float32"), ("LlamaForCausalLM", 0, False, 2, "float32")),
    "mixed-dtype": (
        ("Qwen2ForCausalLM", 192, True, [2, 0], "bfloat16"),
        ("Qwen2ForCausalLM", 192, True, [2, 0], "float32"),
    ),
}

ADDS_BOS = {"llama3.2", "gemma3"}

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs back home to sleep. " * 2
"""About 40 tokens: past the Gemma twin's 16-token sliding window."""


def _json(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text())


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def test_the_registry_names_exactly_the_pairs_checked_here():
    assert set(TWIN_PAIRS) == set(EXPECTED)
    with pytest.raises(ValueError, match="twin_pair name must be one of"):
        twin_pair("qwen2")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_twin_pair_has_its_familys_config_quirks(name):
    tokenizer = AutoTokenizer.from_pretrained(twin_pair(name)[0])
    assert len(tokenizer) == TOKENIZER_IDS
    for folder, (arch, extra, tied, eos, dtype) in zip(twin_pair(name), EXPECTED[name]):
        config = _json(folder, "config.json")
        assert config["architectures"] == [arch]
        assert (config["num_hidden_layers"], config["hidden_size"], config.get("head_dim", 64)) == (2, 128, 64)
        assert config["vocab_size"] == TOKENIZER_IDS + extra
        assert config["tie_word_embeddings"] is tied
        assert ("lm_head.weight" in _weights(folder)) is not tied
        assert _json(folder, "generation_config.json")["eos_token_id"] == eos
        assert config["dtype"] == dtype
        assert {w.dtype for w in _weights(folder).values()} == {getattr(torch, dtype)}
        encoded = AutoTokenizer.from_pretrained(folder)("hello world").input_ids
        assert (encoded[0] == tokenizer.bos_token_id) is (name in ADDS_BOS), encoded
    check_tokenizers_match(*(AutoTokenizer.from_pretrained(f) for f in twin_pair(name)))


def test_qwen2_twins_have_nonzero_qkv_biases_and_qwen3_twins_trained_looking_qk_norms():
    for folder in (*twin_pair("qwen2.5"), twin_pair("mixed")[0]):
        weights = _weights(folder)
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert weights[f"model.layers.0.self_attn.{proj}.bias"].abs().mean() > 0.1, (folder, proj)
        assert "model.layers.0.self_attn.o_proj.bias" not in weights  # Qwen2 has none on o_proj
    for folder in (*twin_pair("qwen3"), *twin_pair("gemma3")):
        weights = _weights(folder)
        for norm in ("q_norm", "k_norm"):
            w = weights[f"model.layers.1.self_attn.{norm}.weight"]
            assert w.shape == (64,) and w.std() > 0.1, (folder, norm)


def test_the_gemma3_twin_mixes_sliding_and_global_layers_and_caps_its_logits():
    for folder in twin_pair("gemma3"):
        config = AutoConfig.from_pretrained(folder)
        assert sorted(config.layer_types) == ["full_attention", "sliding_attention"]
        assert config.sliding_window == 16 < len(AutoTokenizer.from_pretrained(folder)(PROMPT).input_ids)
        assert config.final_logit_softcapping == 30.0
        assert config.query_pre_attn_scalar != config.head_dim
        assert set(config.rope_parameters) == {"full_attention", "sliding_attention"}


def test_the_llama_twins_list_three_eos_ids_in_their_config_and_scale_rope():
    for folder, factor in zip(twin_pair("llama3.2"), (8.0, 32.0)):
        config = _json(folder, "config.json")
        assert config["eos_token_id"] == [0, 5, 2]
        assert config["rope_parameters"]["rope_type"] == "llama3"
        assert config["rope_parameters"]["factor"] == factor


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_twin_pairs_logits_are_finite_spread_and_disagree(name):
    tokenizer = AutoTokenizer.from_pretrained(twin_pair(name)[0])
    ids = torch.tensor([tokenizer(PROMPT).input_ids])
    log_probs = []
    for folder in twin_pair(name):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(ids).logits[0].double()
        assert torch.isfinite(logits).all()
        row = torch.log_softmax(logits[:, :TOKENIZER_IDS], -1)
        entropy = -(row.exp() * row).sum(-1)
        # Entropies of a few nats: neither one token (a tied model repeating its input) nor near-uniform.
        assert 1.0 < entropy.mean() < math.log(TOKENIZER_IDS) - 1.0, (folder, entropy)
        assert (row.argmax(-1) != ids[0]).float().mean() > 0.9
        log_probs.append(row)
    teacher, theta = log_probs
    kl = (teacher.exp() * (teacher - theta)).sum(-1).mean()
    assert kl > 0.5  # far enough apart for α to vary from token to token
