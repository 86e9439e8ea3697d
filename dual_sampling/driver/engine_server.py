"""What the fork server does once, after its imports, for every engine it forks (imported by it alone, the last of
:data:`~dual_sampling.driver.engine_start.PRELOAD`).

Two steps of an engine's start are the same in every engine and leave only process-wide state behind; done here,
each EngineCore and worker forked from the server inherits the result instead of doing the work again:

1. **vLLM's CPU kernel overrides.** A worker's start (``WorkerWrapperBase.init_worker``) registers vLLM's C++
   stand-ins for its Triton kernels (``CpuPlatform.register_triton_kernel_overrides``): it rebinds module attributes,
   scanning every loaded module for references to the originals. Registered here, the platform's method then does
   nothing in the forked processes: a second registration would wrap the wrappers. The scan must run before numba is
   loaded: it reads ``vars(value)`` of every module attribute, and llvmlite's ``ffi.lib`` answers any attribute,
   ``__dict__`` included, with a function, which the scan fails on.
2. **The decision kernel** (``dual_sampling.decision.kernel``) loaded from numba's cache, about 0.8 s in each leading
   engine's worker otherwise (``LeaderLogitsProcessor.attach`` still calls ``warm_up``: milliseconds here, the load
   in a spawned worker). Every fork server pays it, also one whose engines never run the kernel (the speculative
   mode, several teachers), beside the driver's own imports (``start_early``). It runs torch only on a few thousand
   elements, below the size at which torch starts its OpenMP threads (a process forked after them can hang in
   libgomp); a test checks the server holds one thread.

A step that fails here is logged, and each engine's process then tries it itself, as a spawned one does. Imported
anywhere but in the fork server (see ``SERVER_VARIABLE``), the module does nothing.
"""

from __future__ import annotations

import logging
import os

from dual_sampling.driver.engine_start import SERVER_VARIABLE

logger = logging.getLogger(__name__)


def _already_registered() -> None:
    """``register_triton_kernel_overrides`` in a process forked from the fork server: done there, inherited."""


def prepare() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    try:
        current_platform.register_triton_kernel_overrides()
    except Exception:
        logger.exception("the fork server could not register vLLM's CPU kernel overrides; each worker will")
        return
    current_platform.register_triton_kernel_overrides = _already_registered
    try:
        from dual_sampling.decision import kernel

        kernel.warm_up()
    except Exception:
        logger.exception("the fork server could not load the decision kernel; each leading engine will")


if os.environ.get(SERVER_VARIABLE) == "1":
    prepare()
