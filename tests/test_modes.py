"""Modes as data (``dual_sampling.modes``): a mode is checked by name once, and everything that serves a feature in some
modes only asks the mode for the capability, so a new mode is one module plus its registration."""

from __future__ import annotations

import math
import random

import pytest

from dual_sampling import OptimalSamplingDual
from dual_sampling.distill.config import DistillConfig
from dual_sampling.modes import MODES, Mode, mode_of, modes_with, register_mode
from dual_sampling.options import EngineOptions
from dual_sampling.run_settings import ModelsAndPrompts
from dual_sampling.testing import tiny_models
from dual_sampling.testing.sim_engines import VOCAB, Adversity, sim_driver
from dual_sampling.vocab import check_embedding_rows

BUILT: list = []
"""The drivers :func:`start_simulated` built."""


def start_simulated(config, tokenizer, engine_len, **settings):
    """A mode's driver in a module of its own: the lockstep driver over the simulated engines (no vLLM process)."""
    driver = sim_driver(random.Random(0), Adversity(), settings["max_num_seqs"], engine_len)
    BUILT.append(driver)
    return driver


def distill_config(tmp_path, mode: str, loss: str = "reverse_full") -> DistillConfig:
    """A distillation's settings in ``mode`` (the model folders are never opened: the checks run first)."""
    source = ModelsAndPrompts("t", "s")
    engine = EngineOptions(mode=mode)
    return DistillConfig(prompts="p.jsonl", output=str(tmp_path), source=source, engine=engine, loss=loss)


SIMULATED = Mode("simulated", f"{__name__}:start_simulated", theta_engine=True, takes_new_theta=True, beam_search=False)


def test_a_mode_is_checked_by_its_field_and_registered_once():
    assert tuple(MODES) == ("lockstep", "speculative")
    for bad in ("fast", None, ["lockstep"]):
        with pytest.raises(ValueError, match=r"^mode must be one of \('lockstep', 'speculative'\), got "):
            mode_of(bad)
        with pytest.raises(ValueError, match=r"^mode must be one of"):
            EngineOptions(mode=bad)
    with pytest.raises(ValueError, match="'lockstep' is registered already"):
        register_mode(Mode("lockstep", "x:y", theta_engine=True, takes_new_theta=True, beam_search=True))
    assert tuple(MODES) == ("lockstep", "speculative")


def test_refusals_ask_for_the_capability_and_name_the_modes_that_have_it(monkeypatch, tmp_path):
    assert modes_with("takes_new_theta") == "mode='lockstep' or mode='speculative'"
    distill_config(tmp_path, "speculative")  # θ's draft model takes new weights through vLLM's draft update
    assert distill_config(tmp_path, "speculative").sampling.dense_logprobs == 0  # reverse_full reads no top k
    assert distill_config(tmp_path, "lockstep", "forward").sampling.dense_logprobs == 64
    with pytest.raises(ValueError, match="loss='forward' reads each model's top k .* only mode='lockstep' records"):
        distill_config(tmp_path, "speculative", "forward")
    frozen = Mode("frozen", SIMULATED.start, theta_engine=True, takes_new_theta=False, beam_search=False)
    monkeypatch.setitem(MODES, frozen.name, frozen)
    with pytest.raises(ValueError, match="only mode='lockstep' or mode='speculative' takes them"):
        distill_config(tmp_path, "frozen")
    monkeypatch.delitem(MODES, frozen.name)
    with pytest.raises(ValueError, match="theta_engine_kwargs: in mode='speculative'"):
        EngineOptions(mode="speculative", theta_engine_kwargs={"dtype": "bfloat16"})
    with pytest.raises(ValueError, match="mode='lockstep' serves models with unequal padding"):
        check_embedding_rows(152_064, 151_936, 151_665, "speculative")

    monkeypatch.setitem(MODES, SIMULATED.name, SIMULATED)
    assert modes_with("takes_new_theta") == "mode='lockstep' or mode='speculative' or mode='simulated'"
    assert modes_with("beam_search") == "mode='lockstep'"
    # Its capabilities, not its name, decide: it has an engine for theta and takes new θ.
    check_embedding_rows(152_064, 151_936, 151_665, "simulated")
    EngineOptions(mode="simulated", theta_engine_kwargs={"dtype": "bfloat16"})
    distill_config(tmp_path, "simulated")


def test_a_new_mode_is_one_module_plus_its_registration(monkeypatch):
    """Registered from this test module alone, a mode serves the front door: its driver draws, and what it lacks is
    refused by capability."""
    monkeypatch.setitem(MODES, SIMULATED.name, SIMULATED)
    teacher, theta = tiny_models.tiny_pair("same")
    BUILT.clear()
    with OptimalSamplingDual(teacher, theta, mode="simulated", max_num_seqs=4, max_model_len=96, use_tqdm=False) as s:
        assert [s.driver] == BUILT
        prompts = [[17 + i, 18 + i, 19 + i] for i in range(3)]
        out = s.generate(prompts, max_tokens=6, seed=5)
        samples = [sample for request in out.requests for sample in request.samples]
        assert len(samples) == 3
        for sample in samples:
            assert sample.ok and 1 <= len(sample.token_ids) <= 6
            assert all(0 <= t < VOCAB for t in sample.token_ids)
            columns = (sample.alpha, sample.logp_teacher, sample.logp_theta, sample.logq)
            assert all(len(c) == len(sample.token_ids) for c in columns)
            assert all(math.isfinite(x) and x <= 0 for c in columns[1:] for x in c)
            assert all(0 <= a <= 1 for a in sample.alpha)
        with pytest.raises(ValueError, match="beam_search is served in mode='lockstep' only"):
            s.beam_search([[17, 18]], beam_width=2, max_tokens=2)


def test_every_modes_driver_replaces_only_the_lockstep_drivers_public_hooks():
    """A mode's driver may replace the documented hooks (public methods), never a private method of the lockstep
    driver: its slots, queueing and failure handling are shared, not re-implemented per mode."""
    import importlib
    import inspect
    import typing

    from dual_sampling.driver.lockstep_driver import LockstepDriver

    private = {name for name in vars(LockstepDriver) if name.startswith("_") and not name.startswith("__")}
    assert {"_fly", "_abort", "_launch"} <= private  # the walk sees the driver's private methods
    for mode in MODES.values():
        module, function = mode.start.split(":")
        driver = typing.get_type_hints(getattr(importlib.import_module(module), function))["return"]
        assert issubclass(driver, LockstepDriver), mode.name
        for cls in inspect.getmro(driver):
            if cls is LockstepDriver or not issubclass(cls, LockstepDriver):
                continue
            overridden = sorted(private & set(vars(cls)))
            assert overridden == [], f"mode {mode.name!r}: {cls.__name__} overrides {overridden}"


def test_the_options_reach_the_engines_checked_once_and_as_one_object(monkeypatch):
    """``alpha_method``'s path: checked once, where the user's EngineOptions is built; the front ends hand that object
    on (no dict in between), and the one dict that crosses into vLLM's processes is LockstepConfig's."""
    import dataclasses

    import dual_sampling.options as options_module
    from dual_sampling.lockstep import LockstepConfig
    from dual_sampling.options import DualEngineConfig

    monkeypatch.setitem(MODES, SIMULATED.name, SIMULATED)
    teacher, theta = (str(p) for p in tiny_models.tiny_pair("same"))
    options = EngineOptions(
        mode="simulated", alpha_method="fixed", alpha_config={"alpha": 0.3}, max_num_seqs=4, max_model_len=96
    )
    checks: list = []
    real = options_module.get_alpha_computer
    monkeypatch.setattr(options_module, "get_alpha_computer", lambda *a, **k: checks.append(a) or real(*a, **k))
    config = DualEngineConfig.of(teacher, theta, options, use_tqdm=False)
    assert checks == [], "the options were checked again"
    names = [f.name for f in dataclasses.fields(EngineOptions)]
    assert [getattr(config, n) for n in names] == [False if n == "use_tqdm" else getattr(options, n) for n in names]
    assert config.alpha_config is not options.alpha_config, "a later change to the user's options would reach it"
    DualEngineConfig(teacher, theta, alpha_method="fixed", alpha_config={"alpha": 0.3})
    assert len(checks) == 1, "the field-by-field path checks once too"
    with pytest.raises(FileNotFoundError, match="model_theta="):
        DualEngineConfig.of(teacher, "/nonexistent", options)
    with pytest.raises(TypeError, match="engine= or the options' fields, not both"):
        OptimalSamplingDual(teacher, theta, engine=options, max_num_seqs=2)
    # The crossing into an engine, as pair.py builds it: one dict out, read back whole.
    crossing = LockstepConfig("teacher", "s", 1.0, config.alpha_method, config.alpha_kwargs).to_engine()
    back = LockstepConfig.from_vllm(type("Engine", (), {"additional_config": crossing}), True, "P")
    assert (back.alpha_method, dict(back.alpha_config)) == ("fixed", config.alpha_kwargs)
    BUILT.clear()
    with OptimalSamplingDual(teacher, theta, engine=options, use_tqdm=False) as s:
        assert [s.driver] == BUILT and len(checks) == 1
        (request,) = s.generate([[17, 18, 19]], max_tokens=4, seed=5).requests
        assert all(sample.ok for sample in request.samples)
