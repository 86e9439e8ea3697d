"""The worker extension of both engines (vLLM's ``worker_extension_cls``): what the driver asks a running engine's
worker to do, through ``collective_rpc``, while no request runs on it.

- ``dual_sampling_reload_weights``: new weights in place (:mod:`processors.weights_reload` says why vLLM's own
  reload is not enough for tied models on the CPU).
- ``dual_sampling_set_alpha``: a new alpha computer for the leader's processor (a trust_region budget annealed
  between distillation rounds, say), built in the worker from its registry name and configuration.
- ``dual_sampling_install_speculative``: in ``mode="speculative"``, the mixture's sampling step and theta's seeded
  drafts on the teacher engine's model runner (:mod:`processors.speculative`).
"""

from __future__ import annotations

from typing import Any

from processors.model_runner import installed_speculative, logits_processors, runner_model, speculative_runner
from processors.weight_transfer import register as register_weight_transfer
from processors.weights_reload import refresh_tied_layers

__all__ = ["DualSamplingWorkerExtension"]

# vLLM imports the worker extension into each worker before it builds the model and its weight-transfer engine, so
# the shared-memory engine is registered in exactly the processes that build one, whatever VLLM_PLUGINS allows.
register_weight_transfer()


class DualSamplingWorkerExtension:
    """Mixed into each engine's worker class; its methods run in the worker process."""

    def dual_sampling_reload_weights(self, weights_path: str) -> list[str]:
        """vLLM's ``reload_weights`` from ``weights_path``, then :func:`refresh_tied_layers`.

        Returns the names of the layers processed again (empty for an untied model).
        """
        worker: Any = self
        worker.reload_weights(weights_path=weights_path)
        return refresh_tied_layers(runner_model(worker))

    def dual_sampling_set_alpha(self, method: str, config: dict[str, Any]) -> int:
        """Give this worker's teacher processor the alpha computer ``get_alpha_computer(method, **config)``.

        Returns how many processors took it: 1 on the teacher's worker, 0 on theta's (which decides nothing).
        """
        from alpha import get_alpha_computer
        from processors.leader import LeaderLogitsProcessor

        worker: Any = self
        computer = get_alpha_computer(method, **config)
        taken = 0
        speculative = installed_speculative(worker)
        if speculative is not None:
            speculative.alpha_computer = computer
            taken += 1
        for processor in logits_processors(worker):
            if isinstance(processor, LeaderLogitsProcessor):
                processor.alpha_computer = computer
                taken += 1
        return taken

    def dual_sampling_install_speculative(self, session: str, method: str, config: dict[str, Any], vocab: int) -> int:
        """Install :class:`processors.speculative.SpeculativeSampler` on this worker's model runner, deciding with
        ``get_alpha_computer(method, **config)`` over the first ``vocab`` ids. Returns γ, the runner's draft length."""
        from processors.speculative import SpeculativeSampler

        runner = speculative_runner(self)
        SpeculativeSampler(runner, session, method, config, vocab).install()
        return runner.gamma
