"""The one vLLM engine of ``mode="speculative"``: the teacher, with theta as its draft model.

:class:`SpeculativeEngine` is an :class:`~dual_sampling.driver.pair.EnginePair` with one engine: the same start,
listing of shared-memory files, health reading and stop, but one ``AsyncLLM`` whose ``speculative_config`` runs
theta as a draft model (vLLM's ``draft_model`` method, probabilistic drafts). The mixture's sampling step is
installed on its model runner after start (``processors.speculative``, through the worker extension). It has no
lockstep scheduler and no logits processors: vLLM refuses custom logits processors while speculation is on, and
one engine needs no pairing.
"""

from __future__ import annotations

import os
from typing import Any

from dual_sampling.driver import engine_processes, engine_start, placement
from dual_sampling.driver.pair import EnginePair, worker_problems
from dual_sampling.options import default_kv_cache_bytes
from dual_sampling.roster import Role

__all__ = ["SpeculativeEngine", "check_draft_model"]


def check_draft_model(theta_config: dict) -> None:
    """Refuse, by name, a theta vLLM 0.32 cannot draft with: one whose attention layers are of more than one kind
    (``layer_types`` mixing sliding-window and full attention, as Gemma 2 and 3 do). Such layers get separate KV-cache
    groups, and vLLM's drafter requires one group (its engine fails to start, seconds in)."""
    kinds = sorted(set(theta_config.get("layer_types") or theta_config.get("text_config", {}).get("layer_types") or ()))
    if len(kinds) > 1:
        raise ValueError(
            f"mode='speculative': theta's attention layers are of {len(kinds)} kinds ({', '.join(kinds)}; layer_types "
            "in its config); vLLM's draft model needs them in one KV-cache group. mode='lockstep' serves this model"
        )


class SpeculativeEngine(EnginePair):
    """One teacher ``AsyncLLM`` drafting with theta; see the module docstring."""

    @property
    def theta(self) -> Any:
        return None  # theta runs inside the teacher's engine

    @property
    def gamma(self) -> int:
        return self.config.num_speculative_tokens

    @property
    def started(self) -> tuple[str, ...]:
        """One engine: the teacher's (theta drafts inside it)."""
        return (Role.TEACHER.value,)

    def kv_cache_bytes(self, role: Role = Role.TEACHER) -> int:
        """Both models' KV share the engine's cache (max_model_len already holds the drafts' room), in bytes; the
        draft runs at the engine's dtype."""
        cfg = self.config
        dtype = placement.engine_dtype(cfg, self.models[Role.TEACHER])
        return cfg.kv_cache_memory_bytes or sum(
            default_kv_cache_bytes(m, cfg.max_num_seqs, self.max_model_len, dtype)
            for m in (cfg.model_teacher, cfg.model_theta)
        )

    def engine_need_bytes(self, role: Role) -> int:
        """The one engine holds both models' weights and their one KV cache."""
        cfg = self.config
        models = [cfg.model_teacher, cfg.model_theta]
        dtype = placement.engine_dtype(cfg, self.models[Role.TEACHER])
        return placement.engine_need_bytes(models, dtype, self.kv_cache_bytes(role))

    def engine_kwargs(self, role: str = Role.TEACHER) -> dict[str, Any]:
        cfg = self.config
        kwargs = dict(
            self.base_kwargs(cfg.model_teacher, self.kv_cache_bytes()),
            speculative_config={
                "method": "draft_model",
                "model": cfg.model_theta,
                "num_speculative_tokens": self.gamma,
                "draft_sample_method": "probabilistic",
            },
            **self._placement_kwargs(Role.TEACHER),
        )
        kwargs.update(cfg.teacher_engine_kwargs)
        return kwargs

    def _start_engines_here(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**self.engine_kwargs())
        if not self.from_forkserver:
            with engine_processes.environment(self._engine_variables(Role.TEACHER)):
                self.engines[Role.TEACHER] = AsyncLLM.from_engine_args(args)
            return
        with engine_start.engine_start(self._engine_variables(Role.TEACHER), self._core_pids):
            self.engines[Role.TEACHER] = AsyncLLM.from_engine_args(args)

    def _engine_variables(self, role: Role) -> dict[str, str]:
        """One engine: its model threads may use every CPU (lockstep splits them between two)."""
        variables = super()._engine_variables(role)
        if self.binding:
            variables["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(os.sched_getaffinity(0))))
        return variables

    def verify(self) -> None:
        """Read the engine's effective settings and refuse any the speculative mixture cannot run with, naming it."""
        from processors.model_runner import runner_problem

        vc = self.teacher.vllm_config
        sc, pc, spec = vc.scheduler_config, vc.parallel_config, vc.speculative_config
        problems = []
        if spec is None or spec.method != "draft_model":
            problems.append("speculative_config: no draft model (the mode drafts with theta)")
        else:
            if spec.num_speculative_tokens != self.gamma:
                problems.append(f"num_speculative_tokens is {spec.num_speculative_tokens}, not {self.gamma}")
            if spec.draft_sample_method != "probabilistic" or spec.rejection_sample_method != "standard":
                problems.append(
                    f"draft_sample_method={spec.draft_sample_method!r} and rejection_sample_method="
                    f"{spec.rejection_sample_method!r}: theta's rows are kept only with 'probabilistic' and 'standard'"
                )
            if spec.num_speculative_tokens_per_batch_size:
                problems.append("num_speculative_tokens_per_batch_size: γ must not change with the batch")
        problems += worker_problems(vc)
        if sc.max_num_batched_tokens < sc.max_num_seqs * (self.gamma + 2):
            # A running request left out of a step (γ + 1 tokens and a drafting slot each) would miss its θ rows.
            problems.append(
                f"max_num_batched_tokens={sc.max_num_batched_tokens} is below max_num_seqs x (γ + 2) = "
                f"{sc.max_num_seqs * (self.gamma + 2)}"
            )
        if sc.async_scheduling:
            problems.append("async_scheduling is on (a step would be scheduled before its tokens exist)")
        if problem := runner_problem(vc):
            problems.append(problem)
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(pc, name) != 1:
                problems.append(f"{name}={getattr(pc, name)}; only 1 is supported")
        if problems:
            raise ValueError("the speculative engine's settings: " + "; ".join(problems))
