"""A run's manifest (``OUT.manifest.json``): its configuration, the hash of that, and the SHA-256 of every input
file. A new run writes it; ``--resume`` refuses a run of another configuration or input, or one without it.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from dual_sampling.datagen.durable import write_text_durably
from dual_sampling.datagen.run_config import RunConfig
from dual_sampling.run_output import own_dir
from dual_sampling.run_settings import changed_settings

__all__ = ["check_manifest"]


def check_manifest(cfg: RunConfig, paths: dict[str, Path], models: dict, inputs: dict[str, str]) -> None:
    """Refuse to resume a run of another configuration or input, or one without a manifest; write a new run's."""
    identity = {**cfg.identity(), "models": models}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, allow_nan=False).encode()).hexdigest()
    manifest = paths["manifest"]
    existing = [paths[k] for k in ("output", "journal", "manifest") if k in paths and paths[k].exists()]
    if paths.get("parts") and not (paths["parts"].exists() and any(paths["parts"].iterdir())):
        existing = []  # an empty directory holds no run
    if cfg.resume and manifest.exists():
        old = json.loads(manifest.read_text())
        now = json.loads(json.dumps(identity))
        changed = changed_settings(RunConfig, old["config"], now)
        if changed:
            details = "; ".join(f"{k}: {old['config'].get(k)!r} -> {identity.get(k)!r}" for k in changed)
            raise ValueError(f"refusing to resume {cfg.output}: the configuration differs ({details})")
        _check_input(cfg, old["input_sha256"], inputs)
        return
    if cfg.resume and existing:
        # Without the manifest nothing shows which configuration and input wrote what is there.
        raise FileNotFoundError(
            f"refusing to resume {cfg.output}: its manifest {manifest} is missing, so its configuration and input "
            "cannot be checked; remove the output to start over"
        )
    if not cfg.resume and existing:
        raise FileExistsError(
            f"{cfg.output} (or its journal or manifest) already exists; pass --resume to continue it, "
            "or remove it to start over"
        )
    if "parts" in paths:
        own_dir(paths["parts"])  # the manifest goes into the run's own folder of parts: never through a link
    else:
        manifest.parent.mkdir(parents=True, exist_ok=True)  # the folder the output file is in: the user's
    created = time.strftime("%Y-%m-%dT%H:%M:%S")
    text = {"config_hash": digest, "config": identity, "input_sha256": inputs, "created": created}
    write_text_durably(manifest, json.dumps(text, indent=1, allow_nan=False) + "\n")


def _check_input(cfg: RunConfig, old: dict[str, str], now: dict[str, str]) -> None:
    """Refuse to resume on an input whose contents differ from the run's, naming each file that changed."""
    if old == now:
        return
    folder = Path(cfg.input).is_dir()
    changes = []
    for name in sorted(set(old) | set(now)):
        shown = Path(cfg.input) / name if folder else cfg.input
        if name not in now:
            changes.append(f"{shown} is gone")
        elif name not in old:
            changes.append(f"{shown} is new")
        elif old[name] != now[name]:
            changes.append(f"{shown} changed (sha256 {old[name][:12]}… -> {now[name][:12]}…)")
    raise ValueError(f"refusing to resume {cfg.output}: its input changed since the run started: {'; '.join(changes)}")
