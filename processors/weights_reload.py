"""Reloading weights in place, tied output projections included (the worker extension's reload calls it).

Why it exists (vLLM 0.32, CPU build). ``reload_weights`` loads layer by layer
(``vllm/model_executor/model_loader/reload/layerwise.py``): once a layer has all its
tensors it runs its ``quant_method.process_weights_after_loading``. On the CPU that step
(``dispatch_cpu_unquantized_gemm`` in ``vllm/model_executor/layers/utils.py``) builds the
layer's ``cpu_linear``, which for large weights is a oneDNN matmul over a *packed copy* of
the weight; the ``weight`` argument it is later called with is ignored.

A model with tied word embeddings (``tie_word_embeddings``) shares one Parameter between
the input embedding and the output projection (``ParallelLMHead.tie_weights``), and its
checkpoint stores only the embedding. On a reload the embedding layer receives the new
tensor and is processed again; the output projection receives nothing, so
``finalize_layerwise_processing`` only puts its old Parameter back (now holding the new
values, since the storage is shared) and never runs its processing. Its ``cpu_linear``
keeps multiplying by the packed copy of the *old* embedding: every logit after the update
comes from the new body and the old output projection.

The fix, until vLLM handles it: after the reload, each output projection (``ParallelLMHead``) of the
embedding-style kind (``UnquantizedEmbeddingMethod``) whose weight storage is shared with another layer is
processed again, which repacks it from the current values. That is idempotent for this
method (it only rebuilds ``cpu_linear``, and does nothing off the CPU); quantized methods
are left alone, since re-running their processing would quantize twice. The input embedding it shares with is not
processed again: the reload processed it when it received its tensor, and a lookup never reads ``cpu_linear``
(a repack of SmolLM2's 28M-entry embedding costs about 70 ms).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

__all__ = ["refresh_tied_layers"]


def refresh_tied_layers(model: Any) -> list[str]:
    """Process again every unquantized output projection of ``model`` that shares its weight with another layer.

    Returns the names of the layers processed, in module order.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

    by_storage: dict[int, list[tuple[str, Any]]] = defaultdict(list)
    for name, module in model.named_modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is not None and weight.numel():
            by_storage[weight.untyped_storage().data_ptr()].append((name, module))
    refreshed = []
    for sharing in by_storage.values():
        if len(sharing) < 2:
            continue
        for name, module in sharing:
            method = getattr(module, "quant_method", None)
            if isinstance(module, ParallelLMHead) and isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)
                refreshed.append(name)
    return refreshed
