"""The server's doors without engines: connection deadlines on real sockets, weight labels over HTTP, the names in
the speculative mode's refusals, and what the options print.

The dual engine here is a stand-in with only what these paths ask of it (none of them reaches the engines), so the
tests run in seconds on any machine.
"""

from __future__ import annotations

import re
import socket
import time
from types import SimpleNamespace

import pytest

from dual_sampling.driver.versions import WeightVersions
from dual_sampling.roster import PAIR, Role
from dual_sampling.server.app import build_app
from dual_sampling.server.serve_options import ServeOptions
from tests.test_serve import KEY, Server


class Idle:
    """What building the app and serving /health ask of a dual engine; the weight routes' calls keep real labels."""

    tokenizer = SimpleNamespace(get_vocab=lambda: {})
    max_model_len = 64
    failure = None
    roster = PAIR

    def __init__(self) -> None:
        self.driver = SimpleNamespace(versions=WeightVersions())
        self.loaded: list[str] = []
        """Folders theta's weights were loaded from, in order."""

    def healthy(self) -> bool:
        return True

    async def update_theta_async(self, path, *, version, mode, follow_symlinks) -> str:
        # As OptimalSamplingDual does: the weights load, then the driver labels them.
        self.loaded.append(str(path))
        return self.driver.versions.updated(Role.THETA, version)

    async def set_weight_version_async(self, role: str, version: str) -> None:
        self.driver.versions.relabel(role, version)

    @property
    def weight_versions(self) -> dict[str, str]:
        return self.driver.versions.snapshot()


# ---------------------------------------------------------------- connection deadlines, on real sockets

HEADER_TIMEOUT = 1.0
DRIP_EVERY = 0.25
"""Seconds between the bytes a dripping client sends (uvicorn's keep-alive timeout stops at the first of them)."""
DRIPPED = 24
"""Bytes dripped at most: 6 s, header_timeout and then some; a connection still open after them is held for good."""


@pytest.fixture(scope="module")
def server():
    s = Server(build_app(Idle(), ServeOptions(api_key=KEY, header_timeout=HEADER_TIMEOUT, body_timeout=0.5)))
    yield s
    s.stop()


def statuses(sock: socket.socket, count: int = 1) -> list[int]:
    """The statuses of the next ``count`` responses on ``sock``, each read whole (its head, then Content-Length bytes
    of body), and nothing after them (pipelined responses may come in one read)."""
    data, seen = b"", []
    while len(seen) < count:
        head, end, rest = data.partition(b"\r\n\r\n")
        length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head) if end else None
        if length is not None and len(rest) >= int(length.group(1)):
            seen.append(int(head.split(b" ")[1]))
            data = rest[int(length.group(1)) :]
            continue
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed mid-response: {data!r}"
        data += chunk
    assert data == b"", f"more than {count} responses: {data!r}"
    return seen


def closed_while_dripping(sock: socket.socket, data: bytes) -> bool:
    """Send the first DRIPPED bytes of ``data`` (a head or a body they do not complete), one every DRIP_EVERY seconds;
    whether the server closed the connection meanwhile (it must answer nothing: no request is complete)."""
    assert len(data) > DRIPPED, "the dripped bytes must not complete a request"
    sock.settimeout(DRIP_EVERY)
    for byte in data[:DRIPPED]:
        try:
            sock.sendall(bytes([byte]))
            reply = sock.recv(1)
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return True
        assert reply == b"", f"the server answered a request that never ended: {reply!r}"
        return True
    return False


def request(method: str, path: str, *headers: str, body: bytes = b"") -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


@pytest.mark.parametrize(
    "first, status",
    [
        (request("GET", "/health"), 200),
        (request("GET", "/v1/models"), 401),  # no key: answered, and the connection kept alive all the same
    ],
)
def test_a_second_head_dripped_after_a_response_is_cut_at_header_timeout(server, first, status):
    """Only a connection's first head was timed: after any response, a second head sent a byte at a time held the
    socket for good (uvicorn's keep-alive timeout stops at the first byte), and max_connections such sockets gave
    everyone 503."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(first)
        assert statuses(sock) == [status]
        assert closed_while_dripping(sock, request("GET", "/health")), "a dripped second head kept its connection open"


@pytest.mark.parametrize(
    "declared, sent, status",
    [
        (10 << 20, b"", 413),  # refused by its declared size, before its body is read
        (100, b'{"prompt": "hi", ', 408),  # 17 of the 100 bytes, then nothing past body_timeout
    ],
)
def test_a_request_answered_before_its_body_arrived_does_not_hold_its_connection(server, declared, sent, status):
    """A POST answered 413 (or 408, its body stalled) and then fed the rest of its body slowly kept its socket: uvicorn
    reads and drops that body, and its first byte stopped the keep-alive timeout."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        headers = (f"Authorization: Bearer {KEY}", "Content-Type: application/json", f"Content-Length: {declared}")
        sock.sendall(request("POST", "/v1/completions", *headers, body=sent))
        assert statuses(sock) == [status]
        assert closed_while_dripping(sock, b"x" * (declared - len(sent))), (
            "the rest of an answered request's body kept it open"
        )


def test_keep_alive_and_pipelined_requests_are_still_served(server):
    """The deadline times heads only: a connection idle past header_timeout after a response still serves its next
    request (idle ones are uvicorn's keep-alive timeout's), and two heads sent at once are both answered."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request("GET", "/health"))
        assert statuses(sock) == [200]
        time.sleep(HEADER_TIMEOUT + 0.5)  # past header_timeout, within uvicorn's keep-alive (5 s)
        sock.sendall(request("GET", "/health") * 2)
        assert statuses(sock, 2) == [200, 200]


# ---------------------------------------------------------------- weight labels over HTTP


def test_update_weights_refuses_a_label_earlier_weights_carried(tmp_path):
    """/update_weights took "0" (the label theta started with) or any earlier label, which /update_weight_version
    refuses and best_of relies on: records of two different θ would name one."""
    from fastapi.testclient import TestClient

    folder = tmp_path / "weights"
    folder.mkdir()
    dual = Idle()
    app = build_app(dual, ServeOptions(api_key=KEY, weights_dirs=[str(tmp_path)]))
    client = TestClient(app, headers={"Authorization": f"Bearer {KEY}"})

    def update(version: str | None):
        body = {"update_info": {"weights_path": str(folder)}}
        return client.post("/update_weights", json=body if version is None else {**body, "weight_version": version})

    assert update("step-1").json()["weight_version"] == "step-1"
    assert client.post("/update_weight_version", json={"new_version": "step-1b"}).status_code == 200
    for used in ("0", "step-1", "step-1b"):  # the first label, an earlier one, and the current one
        refused = update(used)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "weight_version", refused.text
    assert len(dual.loaded) == 1  # refused before any weights loaded
    assert dual.weight_versions["theta"] == "step-1b"
    fresh = update(None).json()["weight_version"]  # the default label is a new one
    assert fresh not in ("0", "step-1", "step-1b") and dual.weight_versions["theta"] == fresh


# ---------------------------------------------------------------- the speculative mode's refusals, by request field


class SpeculativeChecks:
    """What the request translator asks of a dual engine, refusing as mode="speculative" refuses."""

    max_model_len = 256
    max_dense_logprobs = 0
    roster = PAIR

    def __init__(self) -> None:
        from dual_sampling.testing.sim_engines import sim_tokenizer

        self.tokenizer = sim_tokenizer()
        self.vocab = len(self.tokenizer)
        self.eos_token_ids = [self.tokenizer.eos_token_id]

    def prepare(self, prompt, teacher_prompt):
        from dual_sampling.driver.requests import PromptPair

        def ids(p):
            return list(p) if isinstance(p, list) else self.tokenizer(p)["input_ids"]

        own = teacher_prompt.get("teacher") if isinstance(teacher_prompt, dict) else teacher_prompt  # by name or not
        teacher, theta = ids(prompt if own is None else own), ids(prompt)
        return PromptPair(teacher, theta, self.max_model_len - max(len(teacher), len(theta)))

    def check(self, pair, sampling, teachers=None) -> None:
        from dual_sampling.driver.requests import DualRequest
        from dual_sampling.driver.speculative_driver import check_speculative

        row = sampling.row(sampling.seed, masked_before_min_tokens=self.eos_token_ids)
        check_speculative(DualRequest(pair.teacher_ids, pair.theta_ids, row, sampling.max_tokens))


@pytest.fixture(scope="module")
def speculative():
    from dual_sampling.server.translate import Translator

    dual = SpeculativeChecks()
    return dual, Translator(dual, ServeOptions())


def refused_field(translator, body: dict, kind: str) -> str:
    import json

    from dual_sampling.server.wire import BadRequest

    with pytest.raises(BadRequest) as refusal:
        translator.parse(json.dumps(body).encode(), kind, time.monotonic())
    assert refusal.value.status == 400, refusal.value.message
    return refusal.value.param


def test_the_speculative_refusals_name_the_field_the_request_used(speculative):
    """The speculative mode's checks name SamplingOptions' fields: a completion was told top_logprobs for its logprobs,
    and a chat prompt for its messages."""
    dual, translator = speculative
    messages = [{"role": "user", "content": "Count to five."}]
    assert refused_field(translator, {"prompt": "Count to five.", "max_tokens": 2, "logprobs": 2}, "completion") == (
        "logprobs"
    )
    chat = {"messages": messages, "max_tokens": 2, "logprobs": True, "top_logprobs": 2}
    assert refused_field(translator, chat, "chat") == "top_logprobs"
    # A stop id equal to the prompt's last token: the speculative check refuses the prompt.
    rendered = dual.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    last = dual.tokenizer(rendered, add_special_tokens=False)["input_ids"][-1]
    chat = {"messages": messages, "max_tokens": 2, "stop_token_ids": [last]}
    assert refused_field(translator, chat, "chat") == "messages"
    prompt = dual.tokenizer("Count to five.")["input_ids"]
    body = {"prompt": prompt, "max_tokens": 2, "stop_token_ids": [prompt[-1]]}
    assert refused_field(translator, body, "completion") == "prompt"


def test_the_options_repr_leaves_the_api_key_out():
    assert "sk-do-not-log" not in repr(ServeOptions(api_key="sk-do-not-log"))


def test_a_server_of_several_teachers_describes_their_records_and_a_pair_refuses_values_per_teacher(speculative):
    """/openapi.json of a server of several teachers names the roster's columns in each choice's records (not the
    pair's); a pair's server refuses a hint or teacher prompt given per teacher name, naming the field (its one
    teacher has no name to give). The trio's server on engines: tests/test_teachers_engine.py."""
    from fastapi.testclient import TestClient

    from dual_sampling.roster import THETA, Roster

    dual = Idle()
    dual.roster = Roster(("math", "general", THETA))
    schema = TestClient(build_app(dual, ServeOptions(api_key=KEY))).get("/openapi.json").json()
    response = schema["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]["application/json"]
    records = next(v for k, v in schema["components"]["schemas"].items() if k.startswith("DualRecords_"))
    assert response["schema"]["$ref"].endswith("_math_general_theta")
    pair = TestClient(build_app(Idle(), ServeOptions(api_key=KEY))).get("/openapi.json").json()["components"]["schemas"]
    assert {"DualCompletionChoice", "DualChatCompletionChoice", "DualRecords"} <= set(pair)  # names kept
    columns = {"alpha_math", "alpha_general", "logp_math", "logp_general", "logp_theta", "logq"}
    assert columns <= set(records["properties"]) and not {"alpha", "logp_teacher"} & set(records["properties"])
    # A request may name its teachers: a teacher's log π may then be absent, every other column never is.
    required = set(records.get("required", ()))
    assert {"alpha_math", "alpha_general", "logp_theta", "logq"} <= required
    assert not {"logp_math", "logp_general"} & required
    requests = [v for k, v in schema["components"]["schemas"].items() if k.startswith("Dual") and "Request" in k]
    assert requests and all("teachers" in r["properties"] for r in requests)
    _, translator = speculative
    chat = [{"role": "user", "content": "Count to five."}]
    for body, kind, field in (
        ({"prompt": "Count to five.", "hint": {"math": "1 2 3 4 5"}}, "completion", "hint"),
        ({"prompt": "Count to five.", "teacher_prompt": {"math": "Count."}}, "completion", "teacher_prompt"),
        ({"messages": chat, "teacher_messages": {"math": chat}}, "chat", "teacher_messages"),
    ):
        assert refused_field(translator, {**body, "max_tokens": 2}, kind) == field
