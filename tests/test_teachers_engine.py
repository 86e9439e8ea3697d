"""Several teachers at decode time, each in its own vLLM engine: q ∝ π_θ^(1−α₁−α₂)·π₁^α₁·π₂^α₂, exact and recorded.

One trio of tiny twins (``mixed-trio``): a Qwen2-architecture teacher ("qwen"), a Llama-architecture teacher
("llama") and the padded, tied Qwen2.5-1.5B twin as θ, three engines in lockstep through the front door. Every
recorded α, log π and log q is checked against a teacher-forced re-scoring of each model in plain transformers,
normalised in float64, with each teacher given its own prompt (a hint only it sees); the K-teacher kl_symmetry α
against SciPy's optimiser of the log-partition over the simplex. One engine trio serves every test (a module fixture);
the α computer a test changes is put back.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dual_sampling import OptimalSamplingDual
from dual_sampling.cli import _run_settings, build_parser
from dual_sampling.datagen.run import run_generation
from dual_sampling.datagen.run_config import RunConfig
from dual_sampling.datagen.sinks import read_records
from dual_sampling.decision.pipeline import RowSampling
from dual_sampling.driver.requests import DualRequest
from dual_sampling.lockstep import Slot
from dual_sampling.options import DualEngineConfig
from dual_sampling.roster import THETA
from dual_sampling.testing.twins import PADDING_MASS_PROMPT, twin_trio
from tests.draws import LEVEL, rows_after, two_token_p_values_under
from tests.oracles import rescore
from tests.test_alpha_teachers import scipy_optimum
from tests.test_datagen import problems
from tests.tolerances import RESCORE_ATOL

pytestmark = pytest.mark.engine

ALPHA = (0.35, 0.25)
"""The teachers' fixed weights, qwen's then llama's: θ's is 0.4."""
LONG_HINT = "Hint: the answer is a number, and every step of the working is written out in full. " * 6
"""A hint of about 100 tokens that only the qwen teacher sees: its prompt is much longer than the others'."""
PROMPTS = ["Once upon a time", PADDING_MASS_PROMPT]
DENSE_K = 4
SEEDS = 1500
"""Samples of the draw test (the twin matrix's count)."""
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


@pytest.fixture(scope="module")
def trio():
    from transformers import AutoModelForCausalLM

    teachers, theta = twin_trio("mixed-trio")
    engine = OptimalSamplingDual(
        {name: str(folder) for name, folder in teachers.items()},
        str(theta),
        alpha_method="fixed",
        alpha_config={"alpha": list(ALPHA)},
        max_num_seqs=16,
        max_model_len=256,
        max_dense_logprobs=DENSE_K,
        sync_timeout=30,
        use_tqdm=False,
    )
    hf = {
        name: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        for name, folder in {**teachers, THETA: theta}.items()
    }
    try:
        yield engine, hf
    finally:
        engine.close()


def _rows(hf, prompts: dict[str, list[int]], tokens: list[int], vocab: int) -> dict[str, np.ndarray]:
    """Each model's float64 log-probability rows [T, vocab] before each of ``tokens``, given its own prompt."""
    return {name: rescore(hf[name], prompts[name], tokens, vocab).numpy() for name in hf}


def _mixture(rows: dict[str, np.ndarray], alpha: np.ndarray) -> np.ndarray:
    """log q [T, vocab] of the geometric mixture at per-token weights ``alpha`` [T, 2] (qwen, llama)."""
    x = (1 - alpha.sum(1))[:, None] * rows[THETA] + alpha[:, :1] * rows["qwen"] + alpha[:, 1:] * rows["llama"]
    return x - np.logaddexp.reduce(x, axis=1, keepdims=True)


def _check_sample(sample, rows: dict[str, np.ndarray], alpha: np.ndarray) -> float:
    """Every record of one sample against the re-scored rows at weights ``alpha``; returns the largest miss."""
    tokens = np.array(sample.token_ids)
    steps = np.arange(len(tokens))
    columns = sample.roster_columns
    worst = 0.0
    for name in rows:
        if f"logp_{name}" not in columns:  # a teacher the sample's request left out
            continue
        worst = max(worst, float(np.abs(np.array(columns[f"logp_{name}"]) - rows[name][steps, tokens]).max()))
    logq = _mixture(rows, alpha)[steps, tokens]
    worst = max(worst, float(np.abs(np.array(columns["logq"]) - logq).max()) / 2)  # log q's bound is twice log π's
    return worst


def _counting(generate, counts: dict[str, int], name: str):
    """``generate`` of one engine, counting the requests it is handed under ``name``."""

    def counted(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return generate(*args, **kwargs)

    return counted


def test_a_request_that_names_its_teachers_runs_on_their_engines_alone(trio):
    """Per-request teacher sets: a call that names one teacher mixes θ with it alone. The other teacher's engine does
    no work for it (its rows do not move), each sample names its teachers and has no log π column for the one left
    out, whose α is exactly 0; the rest re-score in float64 on each model's own prompt. The qwen teacher's hint
    reaches it when it is the one named. Bad sets are refused by field before anything starts."""
    engine, hf = trio
    hinted = {"qwen": [LONG_HINT + p for p in PROMPTS]}
    submitted: dict[str, int] = {}
    engines = engine.driver.engines.engines
    for name, vllm_engine in engines.items():  # count what each engine is handed
        vllm_engine.generate = _counting(vllm_engine.generate, submitted, name)
    try:
        runs = []
        for chosen, idle in ((("llama",), "qwen"), (("qwen",), "llama")):
            submitted.clear()
            before = engine.get_sync_statistics()
            out = engine.generate(PROMPTS, teacher_prompts=hinted, n=2, max_tokens=10, seed=9, teachers=list(chosen))
            runs.append((chosen, idle, out, before, engine.get_sync_statistics(), dict(submitted)))
    finally:
        for vllm_engine in engines.values():
            del vllm_engine.generate  # the class's own again
    for chosen, idle, out, before, after, handed in runs:
        tokens = sum(len(s.token_ids) for r in out.requests for s in r.samples)
        assert handed == {THETA: 4, chosen[0]: 4}, f"the {idle} engine was handed a request that left it out"
        assert after[f"{idle}_rows"] == before[f"{idle}_rows"], f"the {idle} engine ran a request that left it out"
        assert after[f"{chosen[0]}_rows"] - before[f"{chosen[0]}_rows"] == tokens > 0
        for request in out.requests:
            prompts = {**request.teacher_prompt_token_ids, THETA: request.theta_prompt_token_ids}
            for sample in request.samples:
                assert sample.ok and sample.teachers == chosen, (sample.error, sample.teachers)
                assert f"logp_{idle}" not in sample.roster_columns
                assert sample.roster_columns[f"alpha_{idle}"] == [0.0] * len(sample.token_ids)
                weights = dict(zip(engine.roster.teachers, ALPHA))
                assert sample.roster_columns[f"alpha_{chosen[0]}"] == pytest.approx(
                    [weights[chosen[0]]] * len(sample.token_ids)
                )
                alpha = np.tile([w if t in chosen else 0.0 for t, w in weights.items()], (len(sample.token_ids), 1))
                assert _check_sample(sample, _rows(hf, prompts, sample.token_ids, engine.vocab), alpha) < RESCORE_ATOL
    for teachers, message in (
        (["physics"], "teachers: 'physics' is not a teacher here"),
        ([], "teachers must be a non-empty list"),
        (["qwen", "qwen"], "teachers names a teacher twice"),
    ):
        with pytest.raises(ValueError, match=message):
            engine.generate(PROMPTS[:1], max_tokens=2, teachers=teachers)
    with pytest.raises(ValueError, match="dense_logprobs: a request that leaves teachers out"):
        engine.generate(PROMPTS[:1], max_tokens=2, teachers=["qwen"], dense_logprobs=2)

    async def deltas():
        return [d async for d in engine.stream(PROMPTS[0], max_tokens=6, seed=4, teachers=["qwen"], top_logprobs=3)]

    streamed = asyncio.run(deltas())
    wanted = tuple(c for c in engine.roster.token_columns if c != "logp_llama")
    assert all(d.columns == wanted and d.records.shape[1] == len(wanted) for d in streamed)
    # q's top tokens with the log π of θ and the qwen teacher only (ids, log q, then the models run, in roster order).
    assert all(len(d.top) == 4 and d.top[0].shape == (len(d.records), 3) for d in streamed if len(d.records))
    joined = np.concatenate([d.records for d in streamed])
    final = streamed[-1].sample
    assert final.teachers == ("qwen",) and np.array_equal(joined.T, np.array([final.roster_columns[c] for c in wanted]))


def test_records_of_two_teachers_with_their_own_prompts_match_float64_rescoring(trio):
    """Fixed weights (0.35, 0.25); the qwen teacher sees a long hint, the llama teacher θ's prompt. Every recorded
    α, log π of each model and log q equals the float64 re-scoring; the sample's own θ and q fields are the roster
    columns', and its one-teacher fields stay empty. Positive control: the qwen teacher re-scored without its hint
    misses by far more than the tolerance, so the hint reached its engine alone."""
    engine, hf = trio
    assert engine.roster.names == (THETA, "qwen", "llama")  # θ leads: it takes part in every mixture
    out = engine.generate(PROMPTS, teacher_prompts={"qwen": [LONG_HINT + p for p in PROMPTS]}, n=2, max_tokens=12)
    vocab, checked, without_hint = engine.vocab, 0, 0.0
    for request in out.requests:
        prompts = {**request.teacher_prompt_token_ids, THETA: request.theta_prompt_token_ids}
        assert len(prompts["qwen"]) > len(prompts["llama"]) + 50 and prompts["llama"] == prompts[THETA]
        for sample in request.samples:
            assert sample.ok, sample.error
            assert sorted(sample.roster_columns) == sorted(engine.roster.token_columns)
            assert sample.roster_columns["alpha_qwen"] == pytest.approx([ALPHA[0]] * len(sample.token_ids))
            assert sample.roster_columns["alpha_llama"] == pytest.approx([ALPHA[1]] * len(sample.token_ids))
            assert sample.logp_theta == sample.roster_columns["logp_theta"]
            assert sample.logq == sample.roster_columns["logq"]
            assert sample.alpha == [] and sample.logp_teacher == []
            rows = _rows(hf, prompts, sample.token_ids, vocab)
            alpha = np.tile(ALPHA, (len(sample.token_ids), 1))
            assert _check_sample(sample, rows, alpha) < RESCORE_ATOL
            blind = rescore(hf["qwen"], prompts[THETA], sample.token_ids, vocab).numpy()
            steps = np.arange(len(sample.token_ids))
            without_hint = max(
                without_hint,
                float(np.abs(np.array(sample.roster_columns["logp_qwen"]) - blind[steps, sample.token_ids]).max()),
            )
            checked += len(sample.token_ids)
    assert sum(len(r.samples) for r in out.requests) == 4 and checked > 0
    assert without_hint > 100 * RESCORE_ATOL, f"the hint changed nothing measurable ({without_hint})"


def test_a_data_run_of_two_teachers_writes_records_that_match_rescoring(trio, tmp_path):
    """``dual-sampling generate --teacher qwen=... --teacher llama=... --hint-field qwen=solution`` on the trio's
    engines (the command line's settings, parsed from its flags): every Parquet record holds each model's prompt
    (the qwen teacher's with its solution, the others' without), and its α, log π of each model and log q equal the
    float64 re-scoring of each model on its own recorded prompt."""
    engine, hf = trio
    names = engine.roster.names
    folders = {model.name: model.folder for model in engine.config.model_engines()}
    flags = ["generate", "--input", str(problems(tmp_path / "in.jsonl", 3)), "--output", str(tmp_path / "out.parquet")]
    flags += [part for name in engine.roster.teachers for part in ("--teacher", f"{name}={folders[name]}")]
    flags += ["--theta", folders[THETA], "--hint-field", "qwen=solution", "--id-field", "id", "--no-chat-template"]
    flags += ["--alpha-method", "fixed", "--alpha-config", json.dumps({"alpha": list(ALPHA)})]
    flags += ["--n", "2", "--max-tokens", "10", "--max-model-len", "256", "--no-use-tqdm"]
    settings = _run_settings(build_parser().parse_args(flags))
    # A run configured with another α method than the engines decide with is refused before it writes anything.
    other = {**settings, "alpha_method": "kl_symmetry", "alpha_config": {}, "output": str(tmp_path / "other.jsonl")}
    with pytest.raises(ValueError, match="^alpha_method/alpha_config: the sampler decides with 'fixed'"):
        run_generation(RunConfig.from_settings(other), engine)
    assert [f.name for f in tmp_path.glob("other*")] == ["other.jsonl.lock"]  # no records, journal or manifest
    config = RunConfig.from_settings(settings)
    summary = run_generation(config, engine)
    assert summary["samples_written"] == 6 and summary["failed_samples"] == 0, summary
    assert summary["alpha_mean_by_teacher"] == pytest.approx(dict(zip(engine.roster.teachers, ALPHA)))
    records = read_records(str(tmp_path / "out.parquet"))
    assert len(records) == 6
    checked = 0
    for r in records:
        solution = r["id"][1:] + " + "
        assert solution in r["qwen_prompt"] and solution not in r["llama_prompt"] + r["theta_prompt"]
        prompts = {name: engine.tokenizer(r[f"{name}_prompt"], add_special_tokens=True)["input_ids"] for name in names}
        rows = _rows(hf, prompts, r["token_ids"], engine.vocab)
        alpha = np.array([r["alpha_qwen"], r["alpha_llama"]]).T
        assert alpha == pytest.approx(np.tile(ALPHA, (len(r["token_ids"]), 1)))
        recorded = SimpleNamespace(
            token_ids=r["token_ids"], roster_columns={c: r[c] for c in engine.roster.token_columns}
        )
        assert _check_sample(recorded, rows, alpha) < RESCORE_ATOL
        checked += len(r["token_ids"])
    assert checked > 0


def _served_records(engine, hf, records: dict, prompts: dict[str, list[int]]) -> int:
    """One choice's ``dual_sampling`` records against the float64 re-scoring; returns the tokens checked."""
    assert set(engine.roster.token_columns) <= set(records) and not {"alpha", "logp_teacher"} & set(records)
    tokens = records["token_ids"]
    alpha = np.array([records["alpha_qwen"], records["alpha_llama"]]).T
    assert alpha == pytest.approx(np.tile(ALPHA, (len(tokens), 1)))
    rows = _rows(hf, prompts, tokens, engine.vocab)
    assert _check_sample(SimpleNamespace(token_ids=tokens, roster_columns=records), rows, alpha) < RESCORE_ATOL
    return len(tokens)


def test_the_server_takes_prompts_per_teacher_and_answers_with_every_models_records(trio):
    """The OpenAI server on the trio: a completion whose ``hint`` names the qwen teacher and a streamed chat whose
    ``teacher_messages`` names the llama teacher; each choice's records (the stream's chunks joined) hold every
    model's column and re-score in float64 on the prompts the server built; the standard logprobs are log q. A hint
    for a teacher the server does not have, dense top k and beam search are refused by field."""
    import httpx

    from dual_sampling.prompts import DEFAULT_TEACHER_TEMPLATE, user_template
    from dual_sampling.server.app import build_app
    from dual_sampling.server.serve_options import ServeOptions
    from tests.test_serve import KEY, Server

    engine, hf = trio
    server = Server(build_app(engine, ServeOptions(api_key=KEY, max_n=4)))
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        prompt, checked = PROMPTS[0], 0
        body = {"prompt": prompt, "hint": {"qwen": LONG_HINT}, "max_tokens": 8, "n": 2, "logprobs": 0, "seed": 3}
        answer = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=120)
        assert answer.status_code == 200, answer.text
        hinted = user_template(None, DEFAULT_TEACHER_TEMPLATE).render(problem=prompt, hint=LONG_HINT, row={})
        pair = engine.prepare(prompt, {"qwen": hinted})
        prompts = {**pair.teacher_ids, THETA: pair.theta_ids}
        assert len(prompts["qwen"]) > len(prompts["llama"]) + 50 and prompts["llama"] == prompts[THETA]
        for choice in answer.json()["choices"]:
            records = choice["dual_sampling"]
            checked += _served_records(engine, hf, records, prompts)
            assert choice["logprobs"]["token_logprobs"] == records["logq"]
            expected = sum(a - b for a, b in zip(records["logp_theta"], records["logq"]))
            assert records["log_w_theta"] == pytest.approx(expected, abs=1e-5)

        messages = [{"role": "user", "content": "Tell me a story."}]
        own = [{"role": "user", "content": "Tell me a short story about a dragon and a lighthouse keeper."}]
        body = {"messages": messages, "teacher_messages": {"llama": own}, "max_tokens": 6, "stream": True, "seed": 4}
        joined: dict[str, list] = {}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                assert "error" not in chunk, chunk
                records = chunk["choices"][0].get("dual_sampling")
                for name, values in (records or {}).items():
                    if isinstance(values, list):
                        joined.setdefault(name, []).extend(values)
                    elif values is not None:
                        joined[name] = values
        assert joined.get("error") is None and joined.get("log_w_theta") is not None  # the last chunk's

        def chat_ids(conversation):
            text = engine.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
            return engine.tokenizer(text, add_special_tokens=False)["input_ids"]

        prompts = {"qwen": chat_ids(messages), "llama": chat_ids(own), THETA: chat_ids(messages)}
        checked += _served_records(engine, hf, joined, prompts)
        assert checked > 0

        # A request that names its teachers: the llama teacher left out weighs 0 and has no log π in the records.
        body = {"prompt": prompt, "hint": {"qwen": LONG_HINT}, "teachers": ["qwen"], "max_tokens": 8, "logprobs": 2}
        answer = httpx.post(server.url + "/v1/completions", json={**body, "seed": 5}, headers=headers, timeout=120)
        assert answer.status_code == 200, answer.text
        pair = engine.prepare(prompt, {"qwen": hinted})
        prompts = {**pair.teacher_ids, THETA: pair.theta_ids}
        (choice,) = answer.json()["choices"]
        records = choice["dual_sampling"]
        tokens = records["token_ids"]
        assert records.get("logp_llama") is None and records["alpha_llama"] == [0.0] * len(tokens)
        assert choice["logprobs"]["token_logprobs"] == records["logq"]
        assert all(len(alternatives) == 2 for alternatives in choice["logprobs"]["top_logprobs"])
        alpha = np.tile([ALPHA[0], 0.0], (len(tokens), 1))
        rows = _rows(hf, prompts, tokens, engine.vocab)
        assert _check_sample(SimpleNamespace(token_ids=tokens, roster_columns=records), rows, alpha) < RESCORE_ATOL

        prompt_only = {"prompt": prompt, "max_tokens": 2}
        for extra, field in (
            ({"hint": {"physics": "x"}}, "hint"),
            ({"teacher_prompt": {"qwen": "x", "bard": "y"}}, "teacher_prompt"),
            ({"dense_logprobs": 2}, "dense_logprobs"),
            ({"use_beam_search": True, "n": 2}, "use_beam_search"),
            ({"hint": {}}, "hint"),
            ({"teacher_prompt": {"qwen": []}}, "teacher_prompt"),
            ({"teachers": ["bard"]}, "teachers"),
            ({"teachers": []}, "teachers"),
        ):
            refused = httpx.post(server.url + "/v1/completions", json={**prompt_only, **extra}, headers=headers)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()


def test_a_trl_trainer_trains_on_rollouts_of_two_teachers_each_with_its_own_hint_function(trio, tmp_path, monkeypatch):
    """TRL's GRPO (importance correction on) trains two steps on the trio's rollouts, the qwen teacher hinted by its
    own function, the llama teacher seeing the student's prompt. Every rollout's records re-score in
    float64 against the student as it was at the sync before it and each teacher on the prompt it was given; the
    second step's rollouts miss the first sync's student by more than the tolerance (the sync reached the θ engine).
    The trio's θ weights are put back after."""
    pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    import dual_sampling.api
    from dual_sampling.distill.mismatch import sampler_trainer_mismatch
    from dual_sampling.integrations.trl import MixtureRollouts
    from dual_sampling.options import EngineOptions
    from tests.test_trl_backend import HINT, Recorder, _common, _dataset

    engine, hf = trio
    folders = {model.name: model.folder for model in engine.config.model_engines()}

    class Running:
        """The trio's engines as the backend's own: closing the backend leaves them to the module."""

        def __init__(self, *args, **kwargs) -> None:
            assert args[0] == {name: folders[name] for name in ("qwen", "llama")} and args[1] == folders[THETA]

        def __getattr__(self, name):
            return getattr(engine, name)

        def close(self) -> None:
            pass

    monkeypatch.setattr(dual_sampling.api, "OptimalSamplingDual", Running)
    options = EngineOptions(alpha_method="fixed", alpha_config={"alpha": list(ALPHA)})
    teachers = {"qwen": folders["qwen"], "llama": folders["llama"]}
    try:
        with MixtureRollouts(
            teacher=teachers, engine=options, teacher_prompt={"qwen": lambda prompt: HINT + prompt}
        ) as rollouts:
            args = GRPOConfig(num_generations=4, vllm_importance_sampling_correction=True, **_common(tmp_path))
            reward = lambda completions, **_: [len(c) / 10 for c in completions]
            trainer = rollouts.trainer(
                GRPOTrainer, model=folders[THETA], reward_funcs=reward, args=args, train_dataset=_dataset()
            )
            recorder = Recorder(trainer.vllm_generation)
            trainer.train()
    finally:
        engine.update_theta(folders[THETA], version="trio-after-trl")
    student = AutoModelForCausalLM.from_pretrained(folders[THETA], dtype=torch.float32).eval()
    checked = 0
    for index, _, out, _ in recorder.calls:
        student.load_state_dict(recorder.snapshots[index])
        for request in out.requests:
            prompts = {**request.teacher_prompt_token_ids, THETA: request.theta_prompt_token_ids}
            assert prompts["llama"] == prompts[THETA]
            assert len(prompts["qwen"]) > len(prompts[THETA])  # the hint reached the qwen teacher alone
            for sample in request.samples:
                rows = _rows({**hf, THETA: student}, prompts, sample.token_ids, engine.vocab)
                alpha = np.tile(ALPHA, (len(sample.token_ids), 1))
                assert _check_sample(sample, rows, alpha) < RESCORE_ATOL
                checked += len(sample.token_ids)
    assert checked > 0
    later = [out for index, _, out, _ in recorder.calls if index == 1]
    assert later, "no rollouts after the first optimizer step"
    student.load_state_dict(recorder.snapshots[0])
    assert sampler_trainer_mismatch(student, later[0].requests, vocab=engine.vocab).max_abs > 1e-2
    rows = [row for row in trainer.state.log_history if "mixture/alpha_mean" in row]
    assert rows and all(row["mixture/alpha_mean"] == pytest.approx(sum(ALPHA)) for row in rows)
    assert all(row["mixture/alpha_qwen_mean"] == pytest.approx(ALPHA[0]) for row in rows)


def test_distillation_samples_from_both_teachers_and_trains_towards_the_named_one(trio, tmp_path):
    """``dual-sampling distill`` with two teachers (the qwen teacher hinted by its own field) and ``loss_teacher=
    "llama"``: a round samples from the trio, trains on the recorded reverse KL to the llama teacher (its dense pair
    form: tests/test_distill.py) and pushes θ into its engine; the held-out KL is the llama teacher's, measured by the
    trainer's copy of that teacher. The trio's θ weights are put back after."""
    from dual_sampling.distill import DistillConfig, Distiller
    from dual_sampling.distill.evaluate import forced_logp
    from dual_sampling.options import EngineOptions, SamplingOptions
    from dual_sampling.run_settings import ModelsAndPrompts

    engine, hf = trio
    folders = {model.name: model.folder for model in engine.config.model_engines()}
    rows = [{"question": " ".join(random.Random(i).choices(WORDS, k=6)), "answer": LONG_HINT} for i in range(12)]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    teachers = {name: folders[name] for name in ("qwen", "llama")}
    config = DistillConfig(
        prompts=str(prompts),
        output=str(tmp_path / "run"),
        source=ModelsAndPrompts(
            teachers, folders[THETA], prompt_field="question", hint_field={"qwen": "answer"}, chat_template=False
        ),
        loss="reverse",
        loss_teacher="llama",
        loss_top_k=DENSE_K,
        eval_prompts=2,
        eval_max_tokens=4,
        rounds=1,
        prompts_per_round=4,
        steps_per_round=1,
        learning_rate=1e-2,
        engine=EngineOptions(alpha_method="fixed", alpha_config={"alpha": list(ALPHA)}, max_dense_logprobs=DENSE_K),
        sampling=SamplingOptions(max_tokens=6),
    )
    try:
        distiller = Distiller(config, engine)
        assert distiller.teacher.config.model_type == hf["llama"].config.model_type  # the loss's teacher is llama's
        rows_out = distiller.run()
        assert engine.weight_versions["theta"] == "round-1"
    finally:
        engine.update_theta(folders[THETA], version="trio-after-distill")
    assert [r["round"] for r in rows_out] == [0, 1]
    last = rows_out[-1]
    assert last["mean_alpha"] == pytest.approx(sum(ALPHA)) and last["sampler_mismatch_max"] <= RESCORE_ATOL
    assert np.isfinite(last["loss"]) and last["kl_student_teacher"] < rows_out[0]["kl_student_teacher"]
    # The held-out KL is against the llama teacher: its first reference token's log π matches the llama model's own.
    held_out = distiller.eval_set
    k = next(i for i, tokens in enumerate(held_out.references) if tokens)
    reference, prompt = held_out.references[k], held_out.prompts[k]
    llama = forced_logp(hf["llama"], prompt, reference, engine.vocab)
    qwen = forced_logp(hf["qwen"], prompt, reference, engine.vocab)
    mine = forced_logp(distiller.teacher, prompt, reference, engine.vocab)
    assert torch.allclose(mine, llama) and not torch.allclose(mine, qwen, atol=1e-2)


def test_dense_top_k_of_every_model_matches_rescoring(trio):
    """``dense_logprobs``: before each token, each model's top k ids ``[n, 3, k]`` and every model's log π at them
    ``[n, 3, 3, k]`` (``[:, i, j]``: model j's at model i's ids), against the re-scored rows."""
    engine, hf = trio
    (request,) = engine.generate(PROMPTS[:1], max_tokens=8, dense_logprobs=DENSE_K, seed=5).requests
    (sample,) = request.samples
    assert sample.ok, sample.error
    prompts = {**request.teacher_prompt_token_ids, THETA: request.theta_prompt_token_ids}
    rows = _rows(hf, prompts, sample.token_ids, engine.vocab)
    names = engine.roster.names
    assert sample.dense_ids.shape == (len(sample.token_ids), 3, DENSE_K)
    assert sample.dense_logp.shape == (len(sample.token_ids), 3, 3, DENSE_K)
    assert sample.dense_other_logp is None
    for i, owner in enumerate(names):
        own_top = np.argsort(-rows[owner], axis=1)[:, :DENSE_K]
        # Ties aside, each model's own top k are its k most likely ids, most likely first.
        np.testing.assert_array_equal(sample.dense_ids[:, i], own_top)
        for j, scorer in enumerate(names):
            expected = np.take_along_axis(rows[scorer], sample.dense_ids[:, i].astype(np.int64), axis=1)
            np.testing.assert_allclose(sample.dense_logp[:, i, j], expected, atol=RESCORE_ATOL)


def test_kl_symmetry_weights_of_two_teachers_are_scipys_optimum(trio):
    """kl_symmetry for two teachers: each token's α is the minimiser of log Z(α) over the simplex (SciPy's SLSQP from
    several starts, float64), where the KLs of q to every model with weight are equal; log q at the recorded α."""
    engine, hf = trio
    engine.update_alpha("kl_symmetry")
    try:
        (request,) = engine.generate(PROMPTS[1:], n=2, max_tokens=8, seed=11).requests
    finally:
        engine.update_alpha("fixed", alpha=list(ALPHA))
    prompts = {**request.teacher_prompt_token_ids, THETA: request.theta_prompt_token_ids}
    worst = 0.0
    for sample in request.samples:
        assert sample.ok, sample.error
        rows = _rows(hf, prompts, sample.token_ids, engine.vocab)
        alpha = np.stack([sample.roster_columns["alpha_qwen"], sample.roster_columns["alpha_llama"]], axis=1)
        for t in range(len(sample.token_ids)):
            optimum = scipy_optimum(rows[THETA][t], np.stack([rows["qwen"][t], rows["llama"][t]]))
            worst = max(worst, float(np.abs(alpha[t] - optimum).max()))
        assert _check_sample(sample, rows, alpha) < RESCORE_ATOL
    assert worst < 1e-4, f"kl_symmetry's weights miss SciPy's optimum by {worst}"
    assert engine.alpha_settings[0] == "fixed"


def test_what_several_teachers_do_not_take_is_refused_by_name(trio, tmp_path):
    """Beam search, a best_of ranked by one teacher's log π, and new weights for a teacher are refused by name on the
    running trio; the speculative mode, a teacher's engine arguments not keyed by its name, and one teacher's
    weights for two are refused before any engine starts."""
    engine, _ = trio
    with pytest.raises(ValueError, match="beam_search with several teachers"):
        engine.beam_search(PROMPTS[:1], beam_width=2, max_tokens=4)
    with pytest.raises(ValueError, match="best_of_score='logp_teacher'"):
        engine.generate(PROMPTS[:1], n=1, best_of=2, best_of_score="logp_teacher", max_tokens=2)
    with pytest.raises(ValueError, match="role: new weights or labels for one of several teachers"):
        engine.update_teacher(str(tmp_path))
    with pytest.raises(ValueError, match="role: new weights or labels for one of several teachers"):
        engine.set_weight_version("teacher", "relabelled")
    with pytest.raises(ValueError, match="has no meaning with 2 teachers"):
        engine.generate(PROMPTS[:1], teacher_support_top_k=5, max_tokens=2)
    with pytest.raises(ValueError, match="teacher_prompts: with several teachers"):
        engine.generate(PROMPTS[:1], teacher_prompts={"coach": ["x"]}, max_tokens=2)
    with pytest.raises(ValueError, match="teacher_prompts: with several teachers"):
        engine.generate(PROMPTS[:1], teacher_prompts=["x"], max_tokens=2)
    teachers, theta = twin_trio("mixed-trio")
    folders = {name: str(folder) for name, folder in teachers.items()}
    with pytest.raises(ValueError, match="several teachers need mode='lockstep'"):
        DualEngineConfig(folders, str(theta), mode="speculative")
    with pytest.raises(ValueError, match="teacher_engine_kwargs: with several teachers"):
        DualEngineConfig(folders, str(theta), teacher_engine_kwargs={"dtype": "bfloat16"})
    with pytest.raises(ValueError, match="alpha must list one weight per teacher"):
        DualEngineConfig(folders, str(theta), alpha_method="fixed", alpha_config={"alpha": 0.3})
    with pytest.raises(ValueError, match="names must be unique"):
        DualEngineConfig({"theta": folders["qwen"], "llama": folders["llama"]}, str(theta))
    # A request whose teacher prompts do not name the roster's teachers is refused before it takes a slot.
    ids = engine.tokenizer(PROMPTS[0])["input_ids"]
    row = RowSampling(seed=1, stop_token_ids=tuple(engine.eos_token_ids))
    for teachers in ({"qwen": ids}, {}, ids, {"qwen": ids, "llama": ids, "coach": ids}):
        with pytest.raises(ValueError, match="teacher_prompt_ids"):
            engine.driver.call(engine.driver.sample(DualRequest(teachers, ids, row, 2)))
    assert engine.driver.in_flight() == [] and engine.session.held_slots() == []
    # After every refusal the trio still serves.
    (request,) = engine.generate(PROMPTS[:1], max_tokens=3).requests
    assert request.samples[0].ok


def _law(rows: dict[str, np.ndarray], alpha: dict[str, float]) -> np.ndarray:
    """Probabilities of the geometric mixture of ``rows`` (log π over the vocabulary, by model) at teacher weights
    ``alpha`` (θ's weight is the rest), in float64."""
    x = (1 - sum(alpha.values())) * rows[THETA] + sum(a * rows[name] for name, a in alpha.items())
    return np.exp(x - np.logaddexp.reduce(x))


def test_first_two_tokens_follow_the_mixture_of_both_teachers(trio):
    """1,500 seeds' first two tokens at fixed weights (0.35, 0.25), the qwen teacher with a hint: their PITs under
    q ∝ π_θ^0.4·π_qwen^0.35·π_llama^0.25 are independent uniforms (``tests.draws``). Positive control: the same draws
    judged under a one-teacher mixture (the llama teacher's weight given to the qwen teacher) are rejected."""
    engine, hf = trio
    tokenizer = engine.tokenizer
    prompt = tokenizer(PADDING_MASS_PROMPT)["input_ids"]
    hinted = tokenizer(LONG_HINT + PADDING_MASS_PROMPT)["input_ids"]
    out = engine.generate([prompt], teacher_prompts={"qwen": [hinted]}, max_tokens=2, n=SEEDS, seed=13)
    pairs = [s.token_ids for s in out.requests[0].samples if s.ok and len(s.token_ids) == 2]
    assert len(pairs) >= SEEDS - 10  # an EOS first ends a few samples early
    firsts = [p[0] for p in pairs]
    prompts = {"qwen": hinted, "llama": prompt, THETA: prompt}
    first, after = {}, {}
    for name in (THETA, "qwen", "llama"):
        first[name], after[name] = rows_after(hf[name], prompts[name], firsts, engine.vocab)
    weights = {"q": dict(zip(("qwen", "llama"), ALPHA)), "one teacher": {"qwen": sum(ALPHA)}}
    laws = {
        label: (_law(first, alpha), lambda a, alpha=alpha: _law({n: after[n][a] for n in after}, alpha))
        for label, alpha in weights.items()
    }
    p = two_token_p_values_under(pairs, laws)
    assert p["q"] > LEVEL and p["one teacher"] < LEVEL, p


@pytest.mark.budget(150, reason="three engines serve about 60 requests and a θ update, every sample re-scored")
def test_three_engines_stay_in_lockstep_under_distinct_hints_aborts_and_a_theta_update_in_flight(trio):
    """The hazards of two engines, with three: each teacher sees its own hint, long or short at random (so each
    model's prompt is the longest in turn), stop strings and min_tokens; a third of the requests are aborted in
    flight; θ takes new weights (a state dict) while requests run. Every sample that was not aborted re-scores
    exactly against the θ version it records; no model timed out, no step split, nothing diverged or failed, and
    every slot is free after."""
    engine, hf = trio
    rng = random.Random(3)
    before = engine.get_sync_statistics()
    old_version = engine.weight_versions[THETA]
    old_theta = {name: tensor.clone() for name, tensor in hf[THETA].state_dict().items()}
    new_theta = {name: t * 1.25 if name.endswith("mlp.down_proj.weight") else t for name, t in old_theta.items()}
    hf_new = copy.deepcopy(hf[THETA])
    hf_new.load_state_dict(new_theta)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    requests = []
    for i in range(24):
        prompt = words(rng.choice([3, 40]))
        hints = {name: words(rng.choice([2, 70])) + ". " + prompt for name in ("qwen", "llama")}
        max_tokens = rng.randint(8, 40)
        options = {"max_tokens": max_tokens, "min_tokens": rng.randint(0, 4), "stop": [rng.choice(["th", "an"])]}
        requests.append((f"hazard-{i}", prompt, hints, options))

    async def run():
        first = [
            asyncio.create_task(engine.complete(p, h, seed=i, sample_key=i, request_id=r, **o))
            for i, (r, p, h, o) in enumerate(requests)
        ]
        while len(engine.driver.in_flight()) < 4:
            await asyncio.sleep(0.005)
        for request_id, *_ in requests[::3]:
            engine.abort(request_id)
        version = await engine.update_theta_async(new_theta, version="trio-perturbed")
        later = [
            asyncio.create_task(engine.complete(p, h, seed=100 + i, sample_key=i, **o))
            for i, (_, p, h, o) in enumerate(requests[:8])
        ]
        return version, await asyncio.gather(*first), await asyncio.gather(*later)

    try:
        version, first, later = asyncio.run(run())
    finally:
        engine.update_theta(old_theta, version="trio-original")
    assert version == "trio-perturbed"
    assert all(s.theta_version == "trio-perturbed" for s in later)
    aborted = [s for s in first if s.finish_reason == "abort"]
    assert aborted, "no abort reached a request in flight"
    checked = 0
    for (_, prompt, hints, _), sample in zip([*requests, *requests[:8]], [*first, *later]):
        assert sample.error is None, sample.error
        if sample.finish_reason == "abort" or not sample.token_ids:
            continue
        assert sample.teacher_token_ids == sample.theta_token_ids == sample.token_ids
        models = {**hf, THETA: hf_new if sample.theta_version == "trio-perturbed" else hf[THETA]}
        ids = {name: engine.tokenizer(text)["input_ids"] for name, text in {**hints, THETA: prompt}.items()}
        rows = _rows(models, ids, sample.token_ids, engine.vocab)
        alpha = np.tile(ALPHA, (len(sample.token_ids), 1))
        assert _check_sample(sample, rows, alpha) < RESCORE_ATOL
        checked += 1
    assert checked >= 16
    assert {s.theta_version for s in first} <= {old_version, version}
    assert any(s.theta_version == old_version and s.finish_reason != "abort" for s in first), "none was in flight"
    after = engine.get_sync_statistics()
    for name in engine.roster.names:
        assert after[f"{name}_timeouts"] == before[f"{name}_timeouts"], name
    for name in ("split_steps", "follower_diverged"):
        assert after[name] == before[name], name
    failed = {k: after[k] - before[k] for k in after if k.startswith("failed_")}
    assert set(failed.values()) == {0}, failed
    assert after["in_flight"] == 0 and after["queued"] == 0 and engine.session.held_slots() == []


def test_keep_holds_three_engines_across_a_theta_update_of_the_leading_engine(trio):
    """pause(mode="keep") with requests of distinct hints half drawn on three engines, where θ's engine leads: θ takes
    new weights while they are held, and each sample's tokens re-score against the θ version each names."""
    engine, hf = trio
    old_version = engine.weight_versions[THETA]
    old_theta = {name: tensor.clone() for name, tensor in hf[THETA].state_dict().items()}
    new_theta = {name: t * 1.25 if name.endswith("mlp.down_proj.weight") else t for name, t in old_theta.items()}
    hf_new = copy.deepcopy(hf[THETA])
    hf_new.load_state_dict(new_theta)
    rng = random.Random(5)
    requests = []
    words = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.choice([2, 30, 60])))
    for _ in range(4):
        prompt = words()
        requests.append((prompt, {name: words() + ". " + prompt for name in ("qwen", "llama")}))
    drawn: list[int] = []

    async def run():
        tasks = [
            asyncio.create_task(engine.complete(p, h, seed=i, max_tokens=32, min_tokens=32))
            for i, (p, h) in enumerate(requests)
        ]
        control = engine.session.control
        while len(slots := engine.session.held_slots()) < 4 or any(control[s, Slot.NUM_RECORDS] < 3 for s in slots):
            assert not any(t.done() for t in tasks), "a request ended before the pause"
            await asyncio.sleep(0.002)
        await engine.pause_async("keep")
        drawn.extend(int(control[s, Slot.NUM_RECORDS]) for s in engine.session.held_slots())
        await engine.update_theta_async(new_theta, version="trio-kept")
        await engine.resume_async()
        return await asyncio.gather(*tasks)

    try:
        samples = asyncio.run(run())
    finally:
        engine.update_theta(old_theta, version="trio-restored")
    for (prompt, hints), sample in zip(requests, samples):
        assert sample.error is None and len(sample.token_ids) == 32, sample.error
        versions = sample.theta_versions
        assert versions[0] == old_version and versions[-1] == "trio-kept" and versions.index("trio-kept") in drawn
        ids = {name: engine.tokenizer(text)["input_ids"] for name, text in {**hints, THETA: prompt}.items()}
        old_rows = _rows(hf, ids, sample.token_ids, engine.vocab)
        new_rows = _rows({**hf, THETA: hf_new}, ids, sample.token_ids, engine.vocab)
        boundary = versions.index("trio-kept")
        rows = {name: np.concatenate([old_rows[name][:boundary], new_rows[name][boundary:]]) for name in hf}
        alpha = np.tile(ALPHA, (len(sample.token_ids), 1))
        assert _check_sample(sample, rows, alpha) < RESCORE_ATOL
        assert _check_sample(sample, new_rows, alpha) > RESCORE_ATOL  # the oracle tells the versions apart
    assert engine.session.held_slots() == [] and not engine.paused
