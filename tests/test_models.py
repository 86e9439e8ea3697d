"""Local model provisioning: no download, idempotent, and the pairs the other tests rely on."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from dual_sampling import models
from dual_sampling.testing import tiny_models


def test_tiny_pairs_have_the_promised_shapes():
    teacher, theta = tiny_models.tiny_pair("same")
    t_cfg, th_cfg = AutoConfig.from_pretrained(teacher), AutoConfig.from_pretrained(theta)
    tok = AutoTokenizer.from_pretrained(teacher)
    assert t_cfg.vocab_size == th_cfg.vocab_size == len(tok)
    assert t_cfg.num_hidden_layers == 2 and t_cfg.head_dim == 64
    padded_teacher, padded_theta = tiny_models.tiny_pair("padded")
    assert AutoConfig.from_pretrained(padded_teacher).vocab_size == len(tok) + tiny_models.TINY_PADDED_EXTRA_ROWS
    assert padded_theta == theta
    _, foreign = tiny_models.tiny_pair("foreign")
    assert AutoTokenizer.from_pretrained(foreign).get_vocab() != tok.get_vocab()


def test_tiny_teacher_and_theta_disagree():
    teacher, theta = tiny_models.tiny_pair("same")
    ids = torch.tensor([[1, 300, 400, 500]])
    with torch.no_grad():
        lt = torch.log_softmax(AutoModelForCausalLM.from_pretrained(teacher)(ids).logits[0, -1], -1)
        lth = torch.log_softmax(AutoModelForCausalLM.from_pretrained(theta)(ids).logits[0, -1], -1)
    kl = torch.sum(lt.exp() * (lt - lth)).item()
    assert kl > 0.5  # far enough apart for α to vary from token to token


def test_provisioning_is_idempotent(tmp_path, monkeypatch):
    monkeypatch.setenv("DUAL_SAMPLING_CACHE", str(tmp_path))
    first = tiny_models.tiny_pair("same")
    stamp = (first[0] / "config.json").stat().st_mtime_ns
    assert tiny_models.tiny_pair("same") == first
    assert (first[0] / "config.json").stat().st_mtime_ns == stamp
    assert not list(tmp_path.glob("*.partial"))


def test_parallel_builders_do_not_race(tmp_path):
    code = "from dual_sampling.testing import tiny_models; print(tiny_models.tiny_pair('same')[0])"
    env = {"DUAL_SAMPLING_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1].decode()[-2000:] for o in outs]
    assert len({o[0] for o in outs}) == 1
    assert AutoConfig.from_pretrained(outs[0][0].decode().strip()).num_hidden_layers == 2


@pytest.mark.models
def test_smollm2_is_dequantised_and_answers():
    path = models.smollm2()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert getattr(model.config, "quantization_config", None) is None
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert tok.decode(out[0, ids.shape[1] :]).startswith(" Paris")


@pytest.mark.models
def test_pruned_theta_keeps_evenly_spaced_layers_and_tokenizer():
    path = models.smollm2_pruned(24)
    info = json.loads((path / "pruning.json").read_text())
    kept = info["kept_layers"]
    assert len(kept) == 24 and kept[0] == 0 and kept[-1] == 29
    assert max(b - a for a, b in itertools.pairwise(kept)) <= 2
    assert AutoConfig.from_pretrained(path).num_hidden_layers == 24
    assert (
        AutoTokenizer.from_pretrained(path).get_vocab() == AutoTokenizer.from_pretrained(models.smollm2()).get_vocab()
    )
    for bad in (31, 0, True, 24.0, "24"):  # out of range, a bool (an int to Python), a float, a string
        with pytest.raises(ValueError, match="keep_layers"):
            models.smollm2_pruned(bad)


@pytest.mark.models
@pytest.mark.budget(
    150, reason="loads and runs Gemma 3 270M in float32, 262,144-token vocabulary: 72 s in a fresh-clone CI run"
)
def test_gemma3_is_assembled_with_bos_and_answers():
    path = models.gemma3_270m()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.vocab_size == 262144 and model.config.num_hidden_layers == 18
    assert getattr(model.config, "quantization_config", None) is None
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    assert ids[0, 0].item() == tok.bos_token_id  # without <bos> the model degenerates
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert tok.decode(out[0, ids.shape[1] :]).startswith(" the capital of the country of France")


@pytest.mark.models
def test_gemma3_theta_keeps_the_full_attention_layers():
    path = models.gemma3_270m_pruned(14)
    kept = json.loads((path / "pruning.json").read_text())["kept_layers"]
    assert len(kept) == 14 and set(models.GEMMA3_FULL_ATTENTION_LAYERS) <= set(kept)
    source_types = AutoConfig.from_pretrained(models.gemma3_270m()).layer_types
    assert AutoConfig.from_pretrained(path).layer_types == [source_types[i] for i in kept]
    for bad in (2, 19, True, 14.0):  # fewer than the full-attention layers, more than 18, a bool, a float
        with pytest.raises(ValueError, match="keep_layers"):
            models.gemma3_270m_pruned(bad)
