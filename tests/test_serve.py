"""The OpenAI-compatible server, driven by the official ``openai`` client, on the shared tiny engines."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from dual_sampling.lockstep import RECORD_FIELDS
from dual_sampling.records import DENSE_FIELDS
from dual_sampling.server.app import build_app
from dual_sampling.server.serve_options import ServeOptions
from tests import processes
from tests.budget import ENGINE_PAIR_START_S
from tests.tolerances import ALPHA_TWO_RUNS_ATOL, LOGQ_ATOL_FACTOR, SAME_WEIGHTS_TWO_RUNS, TWO_NORMALISATIONS_ATOL

pytestmark = pytest.mark.engine

KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A uvicorn server for an app, in a thread of this process."""

    def __init__(self, app, send_buffer: int | None = None) -> None:
        """``send_buffer``: SO_SNDBUF in bytes of the listening socket, which the accepted connections inherit
        (a small one makes a client that stops reading block the server after kilobytes, not megabytes)."""
        import uvicorn

        from dual_sampling.server.connections import uvicorn_config

        listener = socket.socket()
        if send_buffer is not None:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        listener.bind(("127.0.0.1", 0))
        self.port = listener.getsockname()[1]
        # The app's own options set the connection limits, as `dual-sampling serve` sets them (serve()).
        config = uvicorn_config(app, app.state.service.options, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [listener]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(dual_engine):
    s = Server(build_app(dual_engine, ServeOptions(api_key=KEY, max_n=4, max_queue=256)))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def chat_text(dual, messages) -> str:
    return dual.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


QUESTION = [{"role": "user", "content": "What is 12 + 30?"}]
TEACHER = [{"role": "user", "content": "What is 12 + 30? A reference solution: 12 + 30 = 42."}]


def assert_records_agree(extra: dict, token_ids: list[int], sample) -> None:
    """A choice's dual_sampling records against the offline sample of the same seed."""
    assert extra["token_ids"] == token_ids == sample.token_ids
    atol = {"alpha": ALPHA_TWO_RUNS_ATOL, "logp_teacher": SAME_WEIGHTS_TWO_RUNS, "logp_theta": SAME_WEIGHTS_TWO_RUNS}
    atol["logq"] = LOGQ_ATOL_FACTOR * SAME_WEIGHTS_TWO_RUNS
    for name in ("alpha", "logp_teacher", "logp_theta", "logq"):
        assert extra[name] == pytest.approx(getattr(sample, name), abs=atol[name])


# ---------------------------------------------------------------- round trips, same seed, same sample


def test_chat_round_trip_matches_offline_generate(client, dual_engine):
    r = client.chat.completions.create(
        model="dual", messages=QUESTION, max_tokens=12, seed=5, n=2, extra_body={"teacher_messages": TEACHER}
    )
    offline = dual_engine.generate(
        [chat_text(dual_engine, QUESTION)],
        teacher_prompts=[chat_text(dual_engine, TEACHER)],
        max_tokens=12,
        seed=5,
        n=2,
    )
    assert len(r.choices) == 2 and r.usage.completion_tokens == sum(offline.num_tokens)
    for choice, sample in zip(r.choices, offline.requests[0].samples):
        extra = choice.model_extra["dual_sampling"]
        assert_records_agree(extra, sample.token_ids, sample)
        assert choice.message.content == sample.text and choice.finish_reason == sample.finish_reason
        # log w is a sum over the sample's tokens of log π_θ − log q, within (1 + LOGQ_ATOL_FACTOR)·SAME each.
        bound = (1 + LOGQ_ATOL_FACTOR) * SAME_WEIGHTS_TWO_RUNS * len(sample.token_ids)
        assert extra["log_w_theta"] == pytest.approx(sample.log_w_theta, abs=bound) and extra["error"] is None


def test_chat_stream_with_hint_matches_offline_and_chunks_hold_their_records(client, dual_engine):
    stream = client.chat.completions.create(
        model="dual",
        messages=QUESTION,
        max_tokens=16,
        seed=6,
        stream=True,
        extra_body={"hint": "12 + 30 = 42."},
        stream_options={"include_usage": True},
    )
    text, tokens, records, finish, usage = "", [], {"alpha": [], "logq": []}, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            extra = (choice.model_extra or {}).get("dual_sampling")
            if extra:
                assert len(extra["token_ids"]) == len(extra["alpha"]) == len(extra["logq"])  # exactly this chunk's
                tokens += extra["token_ids"]
                records["alpha"] += extra["alpha"]
                records["logq"] += extra["logq"]
            finish = choice.finish_reason or finish
    from dual_sampling.prompts import DEFAULT_TEACHER_TEMPLATE, user_template

    hinted = user_template(None, DEFAULT_TEACHER_TEMPLATE).render(
        problem=QUESTION[0]["content"], hint="12 + 30 = 42.", row={}
    )
    offline = (
        dual_engine.generate(
            [chat_text(dual_engine, QUESTION)],
            teacher_prompts=[chat_text(dual_engine, [{"role": "user", "content": hinted}])],
            max_tokens=16,
            seed=6,
        )
        .requests[0]
        .samples[0]
    )
    assert tokens == offline.token_ids and text == offline.text and finish == offline.finish_reason
    assert records["alpha"] == pytest.approx(offline.alpha, abs=ALPHA_TWO_RUNS_ATOL)
    assert records["logq"] == pytest.approx(offline.logq, abs=LOGQ_ATOL_FACTOR * SAME_WEIGHTS_TWO_RUNS)
    assert usage.completion_tokens == len(tokens)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_with_teacher_prompt_match_offline(client, dual_engine, stream):
    kwargs = dict(
        model="dual",
        prompt="The sea is",
        max_tokens=10,
        seed=7,
        n=2,
        extra_body={"teacher_prompt": "Waves and tides. The sea is"},
    )
    offline = (
        dual_engine.generate(
            ["The sea is"], teacher_prompts=["Waves and tides. The sea is"], max_tokens=10, seed=7, n=2
        )
        .requests[0]
        .samples
    )
    if not stream:
        r = client.completions.create(**kwargs)
        for choice, sample in zip(sorted(r.choices, key=lambda c: c.index), offline):
            assert choice.text == sample.text
            assert_records_agree(choice.model_extra["dual_sampling"], sample.token_ids, sample)
        return
    texts, tokens = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            tokens[choice.index] += (choice.model_extra or {}).get("dual_sampling", {}).get("token_ids", [])
    for i, sample in enumerate(offline):
        assert tokens[i] == sample.token_ids and texts[i] == sample.text


def test_beam_search_over_http_is_the_offline_beam_search(client, dual_engine):
    # vLLM's request fields: use_beam_search with n beams and length_penalty; each choice is a beam, with records.
    r = client.completions.create(
        model="dual",
        prompt="The sea is",
        max_tokens=5,
        n=2,
        extra_body={"use_beam_search": True, "length_penalty": 0.5},
    )
    (offline,) = dual_engine.beam_search(["The sea is"], beam_width=2, max_tokens=5, length_penalty=0.5)
    choices = sorted(r.choices, key=lambda c: c.index)
    assert [c.model_extra["dual_sampling"]["token_ids"] for c in choices] == [b.tokens for b in offline]
    for choice, beam in zip(choices, offline):
        assert choice.text == beam.text and choice.finish_reason == beam.finish_reason
        records = choice.model_extra["dual_sampling"]
        assert records["logq"] == pytest.approx(beam.logq, abs=LOGQ_ATOL_FACTOR * SAME_WEIGHTS_TWO_RUNS)
        assert records["logp_theta"] == pytest.approx(beam.logp_theta, abs=SAME_WEIGHTS_TWO_RUNS)


def test_logprobs_report_log_q_and_its_alternatives(client):
    r = client.chat.completions.create(
        model="dual", messages=QUESTION, max_tokens=6, seed=3, logprobs=True, top_logprobs=3
    )
    choice = r.choices[0]
    extra = choice.model_extra["dual_sampling"]
    content = choice.logprobs.content
    assert [c.logprob for c in content] == pytest.approx(extra["logq"], abs=TWO_NORMALISATIONS_ATOL)
    for c in content:
        values = [t.logprob for t in c.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert c.logprob <= values[0] + TWO_NORMALISATIONS_ATOL
    legacy = client.completions.create(model="dual", prompt="one two", max_tokens=5, seed=3, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.token_logprobs == pytest.approx(
        legacy.choices[0].model_extra["dual_sampling"]["logq"], abs=TWO_NORMALISATIONS_ATOL
    )


@pytest.mark.parametrize("stream", [False, True])
def test_dense_logprobs_carry_each_models_top_k(dual_engine, client, stream):
    k = 5
    kwargs = dict(model="dual", prompt="one two three", max_tokens=6, seed=9, extra_body={"dense_logprobs": k})
    fields = ["token_ids", *RECORD_FIELDS, *DENSE_FIELDS]
    if stream:
        parts = [c.choices[0].model_extra["dual_sampling"] for c in client.completions.create(stream=True, **kwargs)]
        extra = {key: [v for p in parts if p and p.get(key) for v in p[key]] for key in fields}
    else:
        extra = client.completions.create(**kwargs).choices[0].model_extra["dual_sampling"]
    assert len(extra["token_ids"]) == 6
    assert set(DENSE_FIELDS) == {
        "teacher_top_ids", "teacher_top_logprobs", "teacher_top_theta_logprobs",
        "theta_top_ids", "theta_top_logprobs", "theta_top_teacher_logprobs",
    }  # fmt: skip
    for role, own, other in (("teacher", "logp_teacher", "theta"), ("theta", "logp_theta", "teacher")):
        ids, logp = extra[f"{role}_top_ids"], extra[f"{role}_top_logprobs"]
        other_logp = extra[f"{role}_top_{other}_logprobs"]
        assert len(ids) == len(logp) == len(other_logp) == 6 and all(len(row) == k for row in ids + logp + other_logp)
        assert all(row == sorted(row, reverse=True) and row[0] <= 0 for row in logp)
        assert all(v <= 0 for row in other_logp for v in row)
        # Where the drawn token is among a model's top k, its dense values are both models' records of it.
        for step, (token, top_ids, top_logp, value) in enumerate(zip(extra["token_ids"], ids, logp, extra[own])):
            if token in top_ids:
                assert top_logp[top_ids.index(token)] == value
                assert other_logp[step][top_ids.index(token)] == extra[f"logp_{other}"][step]
            else:
                assert value <= top_logp[-1]
    # The two roles' lists are one computation per model: a token in both top k has one value per model.
    for step in range(6):
        for j, token in enumerate(extra["teacher_top_ids"][step]):
            if token in extra["theta_top_ids"][step]:
                i = extra["theta_top_ids"][step].index(token)
                assert extra["teacher_top_logprobs"][step][j] == extra["theta_top_teacher_logprobs"][step][i]
                assert extra["teacher_top_theta_logprobs"][step][j] == extra["theta_top_logprobs"][step][i]
    plain = client.completions.create(model="dual", prompt="one", max_tokens=2, seed=9)
    assert plain.choices[0].model_extra["dual_sampling"].get("teacher_top_ids") is None
    limit = dual_engine.max_dense_logprobs
    r = httpx.post(
        str(client.base_url) + "completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"prompt": "one", "max_tokens": 2, "dense_logprobs": limit + 1},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "dense_logprobs", r.text


def scrape(url: str) -> dict[tuple, float]:
    """The /metrics samples by (name, labels), read with prometheus_client's own text parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_models_health_and_metrics_count_what_was_served(server, client):
    assert [m.id for m in client.models.list().data] == ["dual"]
    assert httpx.get(server.url + "/health").status_code == 200
    before = scrape(server.url)
    out = client.completions.create(model="dual", prompt="count with me", max_tokens=5, n=2, seed=3)
    after = scrape(server.url)
    delta = lambda name, **labels: (
        after.get((name, tuple(sorted(labels.items()))), 0.0) - before.get((name, tuple(sorted(labels.items()))), 0.0)
    )
    alphas = [a for c in out.choices for a in c.model_extra["dual_sampling"]["alpha"]]
    reasons = [c.finish_reason for c in out.choices]
    assert delta("dual_sampling_requests_total", route="completions", status="200") == 1
    for reason in set(reasons):
        assert delta("dual_sampling_samples_finished_total", finish_reason=reason) == reasons.count(reason)
    assert delta("dual_sampling_generated_tokens_total") == out.usage.completion_tokens == len(alphas)
    assert delta("dual_sampling_alpha_count") == len(alphas)
    # The same α values summed in another order, in float64: rounding of about len(alphas)·1e-16, far below 1e-5.
    assert delta("dual_sampling_alpha_sum") == pytest.approx(sum(alphas), abs=1e-5)
    assert delta("dual_sampling_alpha_bucket", le="0.5") == sum(a <= 0.5 for a in alphas)
    for gauge in ("dual_sampling_requests_running", "dual_sampling_requests_queued", "dual_sampling_samples_held"):
        assert after[(gauge, ())] == 0, gauge
    assert delta("dual_sampling_sync_timeouts_total") == 0 and after[("dual_sampling_engine_deaths_total", ())] == 0
    assert ("dual_sampling_sync_wait_seconds_total", (("side", "teacher"),)) in after


# ---------------------------------------------------------------- bad input


BAD = [
    ({"messages": QUESTION, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool"),
    ({"messages": QUESTION, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"messages": QUESTION, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"messages": QUESTION, "n": 9}, 400, "n"),
    ({"messages": QUESTION, "max_tokens": 10_000}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "word " * 400}]}, 400, "messages"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": ""}]}, 400, "messages[0].content"),
    ({"messages": QUESTION, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": QUESTION, "temperature": -1}, 400, "temperature"),
    ({"messages": QUESTION, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"messages": QUESTION, "model": "gpt-4"}, 404, "model"),
    ({"messages": QUESTION, "teacher_messages": "not a list"}, 400, "teacher_messages"),
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": QUESTION, "use_beam_search": True, "stream": True}, 400, "stream"),
    ({"messages": QUESTION, "use_beam_search": True, "temperature": 0.5}, 400, "temperature"),
    ({"messages": QUESTION, "use_beam_search": True, "top_logprobs": 2, "logprobs": True}, 400, "top_logprobs"),
    ({"messages": QUESTION, "length_penalty": 2.0}, 400, "length_penalty"),
    ({"messages": QUESTION, "use_beam_search": True, "n": 2, "stop": ["x"]}, 400, "stop"),
]


@pytest.mark.parametrize("body, status, param", BAD, ids=[p for _, _, p in BAD])
def test_bad_chat_requests_name_the_field(server, body, status, param):
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and (error["param"] or "").startswith(param.split(".")[0]) and error["message"]


def test_a_completions_beam_search_refusal_names_its_own_field(server):
    """The options say top_logprobs; a completion asks for logprobs, so its 400 names logprobs in param and message."""
    body = {"prompt": "The sea is", "n": 2, "max_tokens": 4, "use_beam_search": True, "logprobs": 2}
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "logprobs" and error["message"].startswith("logprobs is not used by beam search")


def test_bad_bodies_and_credentials(server, client):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    cases = [
        (
            httpx.post(server.url + "/v1/chat/completions", content=b'{"messages": [', headers=auth),
            400,
            "not valid JSON",
        ),
        (httpx.post(server.url + "/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers=auth), 400, "UTF-8"),
        (httpx.post(server.url + "/v1/completions", json={"prompt": ""}, headers=auth), 400, "empty"),
        (httpx.post(server.url + "/v1/completions", json={"prompt": ["a", "b"]}, headers=auth), 400, "one prompt"),
        (httpx.post(server.url + "/v1/completions", content=b"x" * (2 << 20), headers=auth), 413, "exceeds"),
        (httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}), 401, "API key"),
        (
            httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer no"}),
            401,
            "API key",
        ),
    ]
    for response, status, words in cases:
        assert response.status_code == status, response.text
        assert words in response.json()["error"]["message"]
    r = client.completions.create(model="dual", prompt="still fine", max_tokens=3)  # nothing above hurt the server
    assert r.choices[0].finish_reason in ("stop", "length")


def test_past_the_queue_bound_requests_get_429_at_once(dual_engine):
    s = Server(build_app(dual_engine, ServeOptions(max_queue=2)))
    try:

        async def run() -> list[int]:
            async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
                slow = {"prompt": "long story", "max_tokens": 240, "min_tokens": 240}
                first = [asyncio.ensure_future(c.post("/v1/completions", json=slow)) for _ in range(2)]
                deadline = time.monotonic() + 60
                while "dual_sampling_samples_held 2.0" not in (await c.get("/metrics")).text:
                    assert time.monotonic() < deadline, "the first two requests were never admitted"
                    await asyncio.sleep(0.01)
                third = await c.post("/v1/completions", json=slow)
                assert not any(f.done() for f in first), "a request past the bound must not wait for a seat"
                assert third.json()["error"]["type"] == "rate_limit_error"
                return [third.status_code] + [(await f).status_code for f in first]

        assert asyncio.run(run()) == [429, 200, 200]
    finally:
        s.stop()


# ---------------------------------------------------------------- load, with clients walking away


def disconnects_total(metrics: str) -> float:
    return float(
        next(
            line.split()[-1]
            for line in metrics.splitlines()
            if line.startswith("dual_sampling_client_disconnects_total")
        )
    )


def test_load_200_streams_with_disconnects(server, dual_engine):
    from openai import AsyncOpenAI

    rng = random.Random(0)
    plan = [(rng.random() < 0.2, rng.randint(1, 6)) for _ in range(200)]
    me = psutil.Process()
    rss_before = me.memory_info().rss
    before = dual_engine.get_sync_statistics()
    disconnects_before = disconnects_total(httpx.get(server.url + "/metrics").text)

    async def one(i: int, client: AsyncOpenAI) -> str:
        leave, after = plan[i]
        stream = await client.completions.create(
            model="dual", prompt=f"story number {i}", max_tokens=24, seed=i, stream=True
        )
        chunks, tokens, finish = 0, [], None
        async for chunk in stream:
            chunks += 1
            for choice in chunk.choices:
                extra = (choice.model_extra or {}).get("dual_sampling") or {}
                assert len(extra.get("token_ids", [])) == len(extra.get("logq", []))
                tokens += extra.get("token_ids", [])
                finish = choice.finish_reason or finish
            if leave and chunks >= after:
                await stream.close()
                return "left"
        assert finish in ("stop", "length") and 1 <= len(tokens) <= 24, (finish, len(tokens))
        return "done"

    async def run() -> list[str]:
        async with AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300) as client:
            return await asyncio.gather(*(one(i, client) for i in range(200)))

    started = time.monotonic()
    outcomes = asyncio.run(run())
    wall = time.monotonic() - started
    deadline = time.monotonic() + 10
    session = dual_engine.session
    while time.monotonic() < deadline and (dual_engine.driver.in_flight() or session.held_slots()):
        time.sleep(0.05)
    after = dual_engine.get_sync_statistics()
    rss_after = me.memory_info().rss
    print(
        f"load: 200 streams, {outcomes.count('left')} left early, {wall:.1f} s, "
        f"server RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB"
    )
    # A planned leaver whose stream ends before its chunk count finishes normally: it is "done" too.
    assert all(outcome == "done" for outcome, (leave, _) in zip(outcomes, plan) if not leave)
    assert outcomes.count("left") > 0
    assert dual_engine.driver.in_flight() == [] and session.held_slots() == []
    assert (
        after["teacher_timeouts"] == before["teacher_timeouts"]
        and after["follower_diverged"] == before["follower_diverged"]
    )
    assert after["failed_diverged"] == before["failed_diverged"]
    assert after["requests"] - before["requests"] == 200
    metrics = httpx.get(server.url + "/metrics").text
    assert "dual_sampling_samples_held 0.0" in metrics
    disconnects = disconnects_total(metrics) - disconnects_before
    aborted = after["finished_abort"] - before["finished_abort"]
    # A client can close after the server has put its whole stream in the socket: that one is no disconnect.
    # Every disconnect the server sees ends its stream early, aborting the request unless it had just finished.
    assert 0 < disconnects <= outcomes.count("left") and 0 < aborted <= disconnects
    print(f"load: {disconnects:.0f} disconnects seen by the server, {aborted} requests aborted on the engines")
    assert rss_after < rss_before * 1.10 + 64 * 2**20  # the wall time is printed, not asserted (pytest-timeout)


# ---------------------------------------------------------------- a dead engine, a real server process


def test_engine_death_turns_health_red_and_ends_open_streams(tiny_same):
    teacher, theta = tiny_same
    port = free_port()
    before = processes.snapshot()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dual_sampling.cli",
            "serve",
            "--teacher",
            str(teacher),
            "--theta",
            str(theta),
            "--port",
            str(port),
            "--max-num-seqs",
            "2",
            "--max-model-len",
            "256",
            "--sync-timeout",
            "10",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ENGINE_PAIR_START_S
        while not _healthy(url):
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)

        streaming = asyncio.Semaphore(0)

        async def stream_until_error() -> str:
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                body = {"prompt": "a long story", "max_tokens": 240, "min_tokens": 240, "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    first = True
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            return "done"
                        event = json.loads(line[6:])
                        if "error" in event:
                            return event["error"]["message"]
                        if first:
                            first = False
                            streaming.release()
            return "closed"

        async def run() -> list[str]:
            tasks = [asyncio.ensure_future(stream_until_error()) for _ in range(3)]
            for _ in range(2):  # both seats (max_num_seqs 2) are generating; the third request waits for one
                await asyncio.wait_for(streaming.acquire(), timeout=120)
            tree = psutil.Process(proc.pid).children(recursive=True)  # the EngineCores are its fork server's
            engines = [p for p in tree if p.name().startswith("VLLM::EngineCor")]
            engines[0].kill()
            return await asyncio.gather(*tasks)

        messages = asyncio.run(run())
        assert all("engine failed" in m for m in messages), messages
        # Until it has exited, the server answers red: /health 503, and new requests 503.
        answers = []
        while proc.poll() is None:
            try:
                answers.append(httpx.get(url + "/health", timeout=5).status_code)
                r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
                assert r.status_code == 503 and "not running" in r.json()["error"]["message"], r.text
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline + 120, "the server did not exit after its engine died"
        assert set(answers) <= {503}, answers
        # As vllm serve does, it exits non-zero so that a supervisor starts it again.
        assert proc.returncode == 1, proc.stderr.read().decode()[-3000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    # No process the server started (orphaned engines included) and no file of ours is left; an orphaned engine
    # notices its dead driver within a second, so SETTLE_S is a deadline, not a measurement.
    assert processes.settled(before) == (set(), set())


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_a_disconnect_ends_the_request_within_one_engine_step(server, dual_engine, monkeypatch):
    stats = dual_engine.get_sync_statistics
    abort, requested = dual_engine.driver.abort, {}

    def recording_abort(request_id: str) -> bool:
        # The engines keep stepping while the server notices the disconnect: count steps from here.
        requested.setdefault("steps", stats()["teacher_steps"])
        requested.setdefault("at", time.monotonic())
        return abort(request_id)

    monkeypatch.setattr(dual_engine.driver, "abort", recording_abort)

    async def run() -> float:
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
            body = {"prompt": "tell me everything", "max_tokens": 200, "min_tokens": 200, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                chunks = 0
                async for line in r.aiter_lines():
                    chunks += line.startswith("data: {")
                    if chunks >= 3:
                        break
            closed = time.monotonic()
        while dual_engine.driver.in_flight():
            await asyncio.sleep(0.005)
        return closed

    aborts = stats()["finished_abort"]
    closed = asyncio.run(run())
    assert "steps" in requested, "the disconnect never reached the scheduler"
    steps = stats()["teacher_steps"] - requested["steps"]
    # The step running when the abort was asked for, and the one at whose boundary the leader ends it.
    assert steps <= 2, steps
    assert stats()["finished_abort"] == aborts + 1
    print(f"disconnect to abort request: {(requested['at'] - closed) * 1e3:.0f} ms; then {steps} engine steps")


def test_cancelling_an_asyncio_task_aborts_its_request(dual_engine):
    async def run() -> None:
        task = asyncio.ensure_future(
            dual_engine.complete("a long answer", max_tokens=200, min_tokens=200, request_id="to-cancel")
        )
        while "to-cancel" not in dual_engine.driver.in_flight():
            await asyncio.sleep(0.01)
        rows = dual_engine.get_sync_statistics()["teacher_rows"]
        while dual_engine.get_sync_statistics()["teacher_rows"] < rows + 3:  # it is decoding: cancel it there
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 60  # a deadline for the abort to land, not a measurement
        while dual_engine.driver.in_flight():
            assert time.monotonic() < deadline, "the cancelled request is still in the engines"
            await asyncio.sleep(0.01)

    aborts = dual_engine.get_sync_statistics()["finished_abort"]
    asyncio.run(run())
    assert dual_engine.get_sync_statistics()["finished_abort"] == aborts + 1
