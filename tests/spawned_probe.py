"""What tests/test_placement.py's stand-in for vLLM's engine runs in the process it spawns.

A spawned process imports its target's module afresh. This one imports nothing heavy, where tests/test_placement.py
imports the driver and with it vLLM (about 9 s a process, most of that test's time).
"""

from __future__ import annotations

import os
from pathlib import Path


def write_visible_devices(path: str) -> None:
    """Write the CUDA_VISIBLE_DEVICES and VLLM_WORKER_MULTIPROC_METHOD this process sees ("unset" for either
    missing) to ``path``, space-separated."""
    seen = (os.environ.get(name, "unset") for name in ("CUDA_VISIBLE_DEVICES", "VLLM_WORKER_MULTIPROC_METHOD"))
    Path(path).write_text(" ".join(seen))
