"""The server against hostile input, idle readers and a schema fuzzer, on the shared tiny engines.

Every case here broke the server before (a dead EngineCore, a 500, a NaN in a response, a
queue held for good). Each must now get its status with the field named, and afterwards the
engines must still serve and hold nothing.
"""

from __future__ import annotations

import json
import math
import re
import socket
import time

import httpx
import pytest

from dual_sampling.server.app import build_app
from dual_sampling.server.serve_options import ServeOptions
from tests.test_serve import KEY, Server

pytestmark = pytest.mark.engine

AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
CHAT = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def server(dual_engine):
    s = Server(build_app(dual_engine, ServeOptions(api_key=KEY, max_n=4, max_queue=64)))
    yield s
    s.stop()


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def completion(**fields) -> bytes:
    return json.dumps({"prompt": "hi", "max_tokens": 2, **fields}).encode()


def chat(**fields) -> bytes:
    return json.dumps({"messages": CHAT, "max_tokens": 2, **fields}).encode()


def raw_completion(tail: str) -> bytes:
    """A completion body whose last member is written by hand (JSON that json.dumps would not write)."""
    return ('{"prompt": "hi", "max_tokens": 2, ' + tail + "}").encode()


# (route, body, status, the error's param or a word of its message)
HOSTILE = [
    # Values the engines cannot take: each killed an EngineCore or reached torch as an overflow.
    ("completions", completion(top_k=2**63), 400, "top_k"),
    ("chat", chat(top_k=9223372036854775808), 400, "top_k"),
    ("completions", completion(top_k=-2), 400, "top_k"),
    ("completions", completion(seed=2**64), 400, "seed"),
    ("completions", completion(stop_token_ids=[2**40]), 400, "stop_token_ids"),
    ("completions", completion(stop_token_ids=[49152]), 400, "stop_token_ids"),
    ("completions", completion(logit_bias={str(2**40): 1}), 400, "logit_bias"),
    ("completions", completion(logit_bias={"²": 1}), 400, "logit_bias"),
    ("completions", json.dumps({"prompt": [10**30], "max_tokens": 2}).encode(), 400, "prompt"),
    ("completions", completion(teacher_prompt=[49152]), 400, "prompt"),
    ("completions", completion(temperature=1e-30), 400, "temperature"),
    ("completions", completion(temperature=1e30), 400, "temperature"),
    ("completions", completion(logprobs=21), 400, "logprobs"),
    ("chat", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("completions", completion(stop=["x" * 300]), 400, "stop"),
    ("completions", completion(stop=[str(i) for i in range(17)]), 400, "stop"),
    # Lone surrogates (valid JSON escapes; no tokenizer or UTF-8 writer takes them), in every text field.
    ("completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "prompt"),
    ("chat", b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', 400, "messages"),
    ("completions", raw_completion('"hint": "\\ud800"'), 400, "hint"),
    ("completions", raw_completion('"teacher_prompt": "\\ud800"'), 400, "teacher_prompt"),
    ("completions", raw_completion('"stop": ["\\ud800"]'), 400, "stop"),
    ("completions", raw_completion('"\\ud800": 1'), 400, "surrogate"),
    # Numbers and shapes the JSON parser takes but Python cannot.
    ("completions", raw_completion('"seed": ' + "9" * 5000), 400, "digit"),
    ("completions", raw_completion('"temperature": NaN'), 400, "NaN"),
    ("completions", raw_completion('"temperature": Infinity'), 400, "Infinity"),
    ("completions", raw_completion('"temperature": 1e400'), 400, "range"),
    ("completions", raw_completion('"stop": ' + "[" * 100_000 + "]" * 100_000), 400, "nests"),
    ("completions", raw_completion('"stop": ' + "[" * 40 + "]" * 40), 400, "nests"),
    # Zero means zero: vLLM answers 400, and so do we (it used to mean "fill the context", and n=0 meant 1).
    ("completions", completion(max_tokens=0), 400, "max_tokens"),
    ("chat", chat(max_tokens=0), 400, "max_tokens"),
    ("chat", json.dumps({"messages": CHAT, "max_completion_tokens": 0}).encode(), 400, "max_completion_tokens"),
    ("completions", completion(n=0), 400, "n"),
    ("chat", chat(n=0), 400, "n"),
    ("completions", completion(best_of=0), 400, "best_of"),
    ("completions", completion(n=2, best_of=1), 400, "best_of"),
    ("completions", completion(max_tokens=10**6), 400, "max_tokens"),
    # The teacher's view: one of its two forms, and text prompts only for a hint.
    ("completions", completion(hint="h", teacher_prompt="t"), 400, "hint"),
    ("chat", chat(hint="h", teacher_messages=CHAT), 400, "hint"),
    ("completions", json.dumps({"prompt": [1, 2, 3], "hint": "h", "max_tokens": 2}).encode(), 400, "hint"),
    # Stop ids that cover the vocabulary left no token to force a failed row with: both EngineCores died.
    ("completions", completion(stop_token_ids=list(range(49152)), min_tokens=1), 400, "stop_token_ids"),
    # vLLM's own "before" validators meet these raw and raised TypeError, KeyError or AttributeError: 500s.
    ("chat", json.dumps({"messages": None}).encode(), 400, "messages"),
    ("chat", json.dumps({"messages": 5}).encode(), 400, "messages"),
    ("chat", chat(tools=[1], tool_choice={"type": "function", "function": {"name": "f"}}), 400, "tool"),
    ("chat", chat(tools=[{}]), 400, "tools"),
    ("completions", completion(structured_outputs="x"), 400, "structured_outputs"),
    ("chat", chat(messages=[{"role": "assistant", "content": "x", "tool_calls": 5}]), 400, "messages"),
    ("chat", chat(skip_special_tokens=False), 400, "skip_special_tokens"),
    # A prompt far past max_model_len is refused before it is tokenized.
    ("completions", completion(prompt="word " * 6000), 400, "prompt"),
    ("chat", chat(messages=[{"role": "user", "content": "word " * 6000}]), 400, "messages"),
]


@pytest.mark.parametrize(
    "route, body, status, where", HOSTILE, ids=[f"{r}-{w}-{i}" for i, (r, _, _, w) in enumerate(HOSTILE)]
)
def test_hostile_input_is_refused_naming_the_field(server, route, body, status, where):
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    r = httpx.post(server.url + path, content=body, headers=AUTH, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"]
    assert (error["param"] or "").startswith(where) or where in error["message"], error


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_strings_for_numbers_are_read_as_their_type(server, route):
    """'"max_tokens": "5"' reached a comparison as a string; the typed model reads it as 5, as vLLM does."""
    if route == "chat":
        path, body = "/v1/chat/completions", {"messages": CHAT, "max_tokens": "5", "min_tokens": 5}
    else:
        path, body = "/v1/completions", {"prompt": "hi", "max_tokens": "5", "min_tokens": 5, "best_of": "2"}
    r = httpx.post(server.url + path, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["dual_sampling"]["token_ids"]) == 5


@pytest.mark.parametrize("stream", [False, True])
def test_an_overflowing_logit_bias_is_clamped_and_every_value_is_finite(server, stream):
    """A bias of 1e39 became inf in float32: the wrong token was drawn with log q = NaN and ok=True."""
    body = {"prompt": "hi", "max_tokens": 3, "logit_bias": {"1000": 1e39, "2": -1e39}, "stream": stream}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        records = [e["choices"][0]["dual_sampling"] for e in events if e["choices"]]
    else:
        records = [r.json()["choices"][0]["dual_sampling"]]
    tokens = [t for rec in records for t in rec["token_ids"]]
    assert tokens == [1000, 1000, 1000]  # +100 on log q: the biased token holds all of q's mass
    for rec in records:
        for name in ("alpha", "logp_teacher", "logp_theta", "logq"):
            assert all(math.isfinite(v) for v in rec[name]), (name, rec[name])
    assert all(rec.get("error") is None for rec in records)


@pytest.mark.parametrize("stream", [False, True])
def test_alternatives_filtered_out_are_sent_as_vllm_sends_them(server, stream):
    """top_k=1 leaves one token with mass: the other alternatives' log q is -inf, which is not JSON (a 500)."""
    body = {"prompt": "hi", "max_tokens": 3, "logprobs": 5, "top_k": 1, "stream": stream}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        blocks = [e["choices"][0]["logprobs"] for e in events if e["choices"] and e["choices"][0]["logprobs"]]
    else:
        blocks = [r.json()["choices"][0]["logprobs"]]
    alternatives = [v for b in blocks for top in b["top_logprobs"] for v in top.values()]
    assert alternatives and all(v == -9999.0 or math.isclose(v, 0.0, abs_tol=1e-6) for v in alternatives)
    assert sum(v == -9999.0 for v in alternatives) >= 3


def test_a_chat_without_the_generation_prompt_is_rendered_so(server, dual_engine):
    tok = dual_engine.tokenizer
    for generation in (True, False):
        body = {"messages": CHAT, "max_tokens": 1, "add_generation_prompt": generation}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        text = tok.apply_chat_template(CHAT, add_generation_prompt=generation, tokenize=False)
        assert r.json()["usage"]["prompt_tokens"] == len(tok(text, add_special_tokens=False)["input_ids"])


def test_credentials_and_content_types(server, dual_engine):
    url = server.url + "/v1/completions"
    body = completion()
    lower = {"Authorization": f"bearer {KEY}", "Content-Type": "application/json"}
    assert httpx.post(url, content=body, headers=lower, timeout=60).status_code == 200  # the scheme is any case
    for headers, status in [
        ({"Content-Type": "application/json"}, 401),
        ({"Authorization": f"Bearer {KEY}x", "Content-Type": "application/json"}, 401),
        ({"Authorization": f"Basic {KEY}", "Content-Type": "application/json"}, 401),
        ({"Authorization": f"Bearer {KEY}"}, 415),  # no type: a browser's simple request
        ({"Authorization": f"Bearer {KEY}", "Content-Type": "text/plain"}, 415),
        ({"Authorization": f"Bearer {KEY}", "Content-Type": "application/x-www-form-urlencoded"}, 415),
    ]:
        r = httpx.post(url, content=body, headers=headers, timeout=60)
        assert r.status_code == status, (headers, r.text)
    # Without a body a POST needs no type when the server has a key (the key makes a browser ask first): vLLM's
    # clients send /pause and /resume so. The empty body then fails as JSON, not as a type.
    assert httpx.post(url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60).status_code == 400
    # Every route but the public three needs the key, including ones the router does not know.
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/v2/anything").status_code == 401
    for public in ("/health", "/metrics", "/openapi.json"):
        assert httpx.get(server.url + public).status_code == 200
    with pytest.raises(ValueError, match="api_key"):
        ServeOptions(api_key="")


def test_a_keyless_server_wants_json_even_without_a_body(dual_engine):
    """Without a key nothing makes a browser ask first: a bodiless cross-site POST must still be refused."""
    import asyncio

    app = build_app(dual_engine, ServeOptions())

    async def post() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return (await client.post("/v1/completions")).status_code

    assert asyncio.run(post()) == 415


def test_a_keyless_server_serves_no_weight_routes_and_refuses_weights_dirs(dual_engine, tmp_path):
    """Without a key anyone reaching the port (a web page too, by DNS rebinding) could pause the server, relabel θ or
    load weights: the routes are not served, and weights_dirs without a key is refused by name."""
    import asyncio

    app = build_app(dual_engine, ServeOptions())
    body = {"new_version": "x", "update_info": {"weights_path": str(tmp_path)}}

    async def post() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            routes = ("/pause", "/resume", "/update_weights", "/update_weight_version")
            return [(await client.post(path, json=body)).status_code for path in routes] + [
                (await client.get(path)).status_code for path in ("/is_paused", "/weight_info")
            ]

    assert asyncio.run(post()) == [404] * 6
    assert dual_engine.weight_versions["theta"] != "x" and not dual_engine.driver.paused
    with pytest.raises(ValueError, match="weights_dirs needs an api_key"):
        ServeOptions(weights_dirs=[str(tmp_path)])


def test_a_keyless_server_answers_only_requests_addressed_by_ip_or_localhost(dual_engine):
    """DNS rebinding: a page whose name now resolves to 127.0.0.1 sends its own name in Host. Without a key only IP
    literals and localhost are served (421 naming Host); with a key any name is, the key being the defence."""
    import asyncio

    keyless, keyed = build_app(dual_engine, ServeOptions()), build_app(dual_engine, ServeOptions(api_key=KEY))

    async def get(app, host: str, headers=None) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            return await c.get("/v1/models", headers={"Host": host, **(headers or {})})

    for host in ("127.0.0.1:8000", "localhost:8000", "LOCALHOST", "[::1]:8000", "10.1.2.3", "::1"):
        assert asyncio.run(get(keyless, host)).status_code == 200, host
    refused = ("attacker.example:8000", "localhost.attacker.example", "127.0.0.1.nip.io", "", "[::1", "[::1]x.example")
    for host in (*refused, "127.0.0.1:notaport", "localhost:"):
        response = asyncio.run(get(keyless, host))
        assert response.status_code == 421 and response.json()["error"]["param"] == "Host", (host, response.text)
    assert asyncio.run(get(keyed, "model-server.internal:8000", {"Authorization": f"Bearer {KEY}"})).status_code == 200


def test_a_mount_prefix_does_not_open_the_routes(dual_engine):
    """The key check used the full path, so /prefix/v1/... under a root_path passed without a key."""
    import asyncio

    app = build_app(dual_engine, ServeOptions(api_key=KEY))

    async def run() -> list[int]:
        transport = httpx.ASGITransport(app=app, root_path="/prefix")
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            open_ = await c.post("/prefix/v1/completions", content=completion(), headers=AUTH)
            shut = await c.post(
                "/prefix/v1/completions", content=completion(), headers={"Content-Type": "application/json"}
            )
            health = await c.get("/prefix/health")
            return [open_.status_code, shut.status_code, health.status_code]

    assert asyncio.run(run()) == [200, 401, 200]


def test_after_the_hostile_list_the_engines_serve_and_hold_nothing(server, dual_engine):
    for route, body, _, _ in HOSTILE:
        path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
        httpx.post(server.url + path, content=body, headers=AUTH, timeout=60)
    r = httpx.post(server.url + "/v1/completions", content=completion(max_tokens=4), headers=AUTH, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"][0]["dual_sampling"]["token_ids"]) >= 1
    assert httpx.get(server.url + "/health").status_code == 200
    assert metric(server.url, "dual_sampling_samples_held") == 0
    assert dual_engine.driver.failure is None
    assert metric(server.url, "dual_sampling_server_errors_total") == 0


# ---------------------------------------------------------------- clients that stop reading


def idle_stream(port: int, body: dict) -> socket.socket:
    """Send a streaming request, read its headers, then read nothing more (a small window fills fast)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert b" 200 " in head.split(b"\r\n")[0], head
    return sock


def test_idle_readers_are_aborted_and_a_normal_client_is_served(dual_engine):
    """Streams that never read held every seat of the queue for good; every later request got 429 (first seen with 16
    streams of n=16 on max_queue=256; here 4 of them fill a queue of 64). Each stream must produce more than the
    socket buffers between the server and the client take, so that the server's sends block. The server's send
    buffer is set small (a loopback socket's grows to 4 MB, which n=16 of 200 tokens with 20 logprobs barely
    outgrew: a minute of generation); that changes when a send blocks, not what the server does then."""
    s = Server(build_app(dual_engine, ServeOptions(max_n=16, max_queue=64, send_timeout=1.0)), send_buffer=4096)
    idle = []
    try:
        body = {"prompt": "tell a long story", "max_tokens": 200, "min_tokens": 200, "n": 16, "logprobs": 20}
        idle = [idle_stream(s.port, {**body, "stream": True, "seed": i}) for i in range(4)]
        assert metric(s.url, "dual_sampling_samples_held") == 64
        # A normal client is refused while the idle ones hold the queue, then served once they are aborted.
        deadline = time.monotonic() + 240
        statuses = []
        while True:
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=240)
            statuses.append(r.status_code)
            if r.status_code == 200:
                break
            assert r.status_code == 429, r.text
            assert time.monotonic() < deadline, "the idle streams were never aborted"
            time.sleep(0.2)
        while metric(s.url, "dual_sampling_samples_held") != 0:
            assert time.monotonic() < deadline, "the idle streams' samples were never released"
            time.sleep(0.2)
        assert metric(s.url, "dual_sampling_send_timeouts_total") == 4
        assert metric(s.url, "dual_sampling_requests_running") == 0
    finally:
        for sock in idle:
            sock.close()
        s.stop()


def test_silent_connections_are_closed_and_cannot_starve_the_server(dual_engine):
    """uvicorn counts a connection from its accept; with no deadline before a request head, max_connections sockets
    that never send a byte gave every later client 503, before authentication. Here 4 of 4 seats are taken by silent
    sockets and one that sends half a head: each is closed after header_timeout, and a client is served."""
    s = Server(build_app(dual_engine, ServeOptions(api_key=KEY, max_connections=4, header_timeout=1.0)))
    socks: list[socket.socket] = []
    try:
        for i in range(4):
            sock = socket.create_connection(("127.0.0.1", s.port), timeout=30)
            if i == 3:  # a slow head: the deadline is for the whole head, not for the first byte
                sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            socks.append(sock)
        start = time.monotonic()
        for sock in socks:
            assert sock.recv(1) == b"", "a silent connection was answered instead of closed"
        assert time.monotonic() - start < 30
        r = httpx.get(s.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert r.status_code == 200, r.text
        # A connection that made a request is not cut by the head deadline: the same socket serves after it.
        with socket.create_connection(("127.0.0.1", s.port), timeout=30) as sock:
            request = f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode()
            for _ in range(2):
                sock.sendall(request)
                assert read_response(sock).startswith("HTTP/1.1 200")
                time.sleep(1.5)  # past header_timeout, within uvicorn's keep-alive (5 s)
    finally:
        for sock in socks:
            sock.close()
        s.stop()


def read_response(sock: socket.socket) -> str:
    """One whole HTTP/1.1 response (its head, then Content-Length bytes of body): uvicorn writes them separately."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
        re.search(rb"(?i)content-length: *(\d+)", data.partition(b"\r\n\r\n")[0]).group(1)
    ):
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed mid-response: {data!r}"
        data += chunk
    return data.decode()


def test_a_body_that_stops_arriving_gets_408_and_a_request_past_its_time_504_aborted_on_both_engines(dual_engine):
    """--body-timeout and --request-timeout, set small: a body that stops halfway gets 408 naming the limit; a request
    of 240 tokens given 1 s, seen running in the engines first, gets 504 and is aborted on both engines (no slot and
    no request left in them)."""
    import threading

    s = Server(build_app(dual_engine, ServeOptions(api_key=KEY, body_timeout=0.5, request_timeout=1.0)))
    try:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", s.port), timeout=60) as sock:
            sock.sendall(head.encode() + b'{"prompt": "hi", ')  # 17 of the 100 bytes announced, then nothing
            reply = read_response(sock)
        assert reply.startswith("HTTP/1.1 408") and "body_timeout=0.5" in reply, reply

        stats = dual_engine.get_sync_statistics
        aborts, answer = stats()["finished_abort"], {}
        body = {"prompt": "a long answer", "max_tokens": 240, "min_tokens": 240}
        post = threading.Thread(
            target=lambda: answer.update(r=httpx.post(s.url + "/v1/completions", headers=AUTH, json=body, timeout=120))
        )
        post.start()
        session, deadline = dual_engine.session, time.monotonic() + 60  # deadlines for what must happen, not measures
        while not dual_engine.driver.in_flight():  # it reached the engines before its time ran out
            assert post.is_alive() and time.monotonic() < deadline, answer
            time.sleep(0.001)
        post.join(120)
        r = answer["r"]
        assert r.status_code == 504 and "request_timeout" in r.text, r.text
        while dual_engine.driver.in_flight() or session.held_slots():
            assert time.monotonic() < deadline, "the timed-out request is still in the engines"
            time.sleep(0.02)
        assert stats()["finished_abort"] == aborts + 1
    finally:
        s.stop()


# ---------------------------------------------------------------- the event loop stays free


def test_parsing_and_tokenizing_run_off_the_event_loop(server, dual_engine, monkeypatch):
    """Tokenizing and templating ran on the event loop (0.76 s for a 1 MiB prompt), stalling /health and streams."""
    import threading

    service = server.server.config.app.state.service
    seen = []
    parse = service.parse

    def recording(*args):
        seen.append(threading.current_thread().name)
        return parse(*args)

    monkeypatch.setattr(service, "parse", recording)
    r = httpx.post(server.url + "/v1/completions", content=completion(prompt="word " * 3000), headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"  # 3,000 words: more than 256 tokens
    assert seen and all(name.startswith("dual-sampling-parse") for name in seen), seen


def test_a_prompt_past_any_possible_fit_is_refused_without_tokenizing(server, dual_engine, monkeypatch):
    calls = []
    tokenizer = dual_engine.tokenizer
    original = type(tokenizer).__call__

    def counting(self, *args, **kwargs):
        calls.append(len(args[0]) if args else 0)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", counting)
    body = completion(prompt="x" * 900_000)
    r = httpx.post(server.url + "/v1/completions", content=body, headers=AUTH, timeout=60)
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    assert calls == []


@pytest.mark.parametrize(
    "host, loopback", [("127.0.0.1", True), ("localhost", True), ("::1", True), ("0.0.0.0", False), ("10.1.2.3", False)]
)
def test_only_loopback_addresses_are_served_keyless_without_a_warning(host, loopback):
    from dual_sampling.server.app import _loopback

    assert _loopback(host) is loopback


# ---------------------------------------------------------------- a soak of distinct stop lists


def test_two_thousand_distinct_stop_lists_leave_the_leader_engines_memory_flat(server, dual_engine):
    """The leader engine kept one stop-string watcher per distinct stop list, for good, inside the EngineCore."""
    import asyncio

    import psutil

    core = psutil.Process(dual_engine.engine_pids()["teacher"][0])  # the leader's EngineCore, which checks stops

    async def soak(first: int, count: int) -> list[int]:
        limit = asyncio.Semaphore(8)

        async def one(c: httpx.AsyncClient, i: int) -> int:
            # 4 stop strings of 250 characters (vLLM's request model allows 4), distinct per request.
            stop = [f"{i:08d}{k}" + "z" * 241 for k in range(4)]
            async with limit:
                r = await c.post("/v1/completions", content=completion(max_tokens=2, stop=stop), headers=AUTH)
                return r.status_code

        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(first, first + count)))

    assert set(asyncio.run(soak(0, 200))) == {200}  # warm: every allocator pool the steps use exists now
    before = core.memory_info().rss
    assert set(asyncio.run(soak(200, 2000))) == {200}
    grown = core.memory_info().rss - before
    # Measured: the watchers kept per stop list grew it by 0.74 MiB per 1,000 requests, the fixed engine by 0.13 MiB
    # (allocator noise) over the same 1,000.
    assert grown < 768 << 10, f"the leader's EngineCore grew by {grown / 2**20:.2f} MiB over 2,000 requests"


def test_a_cancelled_handler_aborts_its_request_on_both_engines(dual_engine):
    """A handler cancelled by its server (a shutdown, a dropped ASGI task) left its request running to the end."""
    import asyncio

    app = build_app(dual_engine, ServeOptions())
    service = app.state.service
    deadline = time.monotonic() + 60
    while dual_engine.driver.in_flight():  # an earlier test's request ending now would look like this one's
        assert time.monotonic() < deadline, "an earlier request still runs"
        time.sleep(0.01)
    before = dict(dual_engine.driver.counters)

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=120) as c:
            # Eight samples of 200 tokens on four seats: two waves, so the cancel lands while they run even on a
            # loaded machine (one sample of 200 tokens once finished first under CI's load).
            body = completion(prompt="a long story", max_tokens=200, min_tokens=200, n=8)
            task = asyncio.ensure_future(c.post("/v1/completions", content=body, headers=AUTH))
            while not dual_engine.driver.in_flight():
                assert time.monotonic() < deadline and not task.done(), "the request never reached the engines"
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            while dual_engine.driver.in_flight():
                assert time.monotonic() < deadline, "the request still runs on the engines"
                await asyncio.sleep(0.01)

    asyncio.run(run())
    after = dual_engine.driver.counters
    # Run to its end, every sample would have finished as "length" with 200 tokens counted.
    assert after["tokens"] - before.get("tokens", 0) < 8 * 200
    assert after["finished_length"] == before.get("finished_length", 0)
    assert after["finished_abort"] == before.get("finished_abort", 0) + 8
    assert service.held == 0


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_responses_and_chunks_are_what_the_declared_models_say(server, kind):
    """Bodies are written as plain JSON for speed; the models in /openapi.json must still describe them."""
    from dual_sampling.server import protocol

    if kind == "chat":
        path, body = "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
        whole, chunk = protocol.DualChatCompletionResponse, protocol.DualChatCompletionStreamResponse
    else:
        path, body = "/v1/completions", {"prompt": "hi", "max_tokens": 3, "logprobs": 2, "n": 2}
        whole, chunk = protocol.DualCompletionResponse, protocol.DualCompletionStreamResponse
    r = httpx.post(server.url + path, json=body, headers=AUTH, timeout=60)
    response = whole.model_validate(r.json())
    assert all(c.dual_sampling is not None and len(c.dual_sampling.logq) == 3 for c in response.choices)
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(server.url + path, json=stream, headers=AUTH, timeout=60)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    chunks = [chunk.model_validate(e) for e in events]
    assert sum(len(c.choices[0].dual_sampling.token_ids) for c in chunks if c.choices and c.choices[0].dual_sampling)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 3
