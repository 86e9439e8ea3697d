"""The per-token decision: pure torch (the pipeline, the reference) and numba (the CPU kernel); no vLLM."""
