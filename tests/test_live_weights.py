"""New weights without a restart, on real CPU engines (tiny models), checked by re-scoring in transformers.

The oracle for "a sample comes from one version" is teacher-forced re-scoring: a sample's
records must match the transformers model of the version it names, at every token, so a
sample drawn half from one θ and half from another fails it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import math
import random
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dual_sampling import OptimalSamplingDual
from dual_sampling.driver import health
from dual_sampling.lockstep import Phase, Slot, listing_dir
from dual_sampling.records import RequestRecord
from tests.oracles import assert_records_match_rescoring, rescore
from tests.tolerances import LOGQ_ATOL_FACTOR, RESCORE_ATOL, SAME_WEIGHTS_TWO_RUNS

pytestmark = pytest.mark.engine

LONG_PROMPT = " ".join(f"item {i} costs {3 * i + 1} coins;" for i in range(20))  # ~190 tokens: many KV blocks


@pytest.fixture
def live(dual_engine):
    """The session's engine: these tests change its weights, and each puts both models back (``restore``) or
    changes nothing (a refused update), so the tests after them see the weights they started with."""
    return dual_engine


@pytest.fixture
def restore(live, tiny_same):
    yield live
    if live.paused:  # a test that failed while it held requests
        live.resume()
    teacher, theta = tiny_same
    live.update_teacher(str(teacher))
    live.update_theta(str(theta))


def one(s: OptimalSamplingDual, prompt: str, **options) -> RequestRecord:
    return s.generate([prompt], **options).requests[0]


def assert_drawn_from(request: RequestRecord, hf_teacher, hf_theta, vocab: int) -> int:
    """Every record of ``request`` against float64 re-scoring by these two models; tokens checked.

    With one model on both sides every α gives q = π, so α has no root to compare with: then
    log π_t, log π_θ and log q must all equal the model's re-scored log π.
    """
    if hf_teacher is not hf_theta:
        return assert_records_match_rescoring(request, hf_teacher, hf_theta, vocab, "kl_symmetry")
    for sample in request.samples:
        assert sample.error is None, sample.error
        logp = rescore(hf_teacher, request.teacher_prompt_token_ids, sample.token_ids, vocab)
        expected = logp.gather(-1, torch.tensor(sample.token_ids).unsqueeze(-1)).squeeze(-1)
        for name in ("logp_teacher", "logp_theta", "logq"):
            got = torch.tensor(getattr(sample, name), dtype=torch.float64)
            atol = RESCORE_ATOL * (LOGQ_ATOL_FACTOR if name == "logq" else 1)
            torch.testing.assert_close(got, expected, atol=atol, rtol=0, msg=name)
        assert all(0.0 <= a <= 1.0 for a in sample.alpha)
    return sum(len(x.token_ids) for x in request.samples)


def test_theta_given_the_teachers_weights_scores_as_the_teacher(restore, hf_models, tiny_same):
    s = restore
    hf_teacher, hf_theta = hf_models
    old_version = s.weight_versions["theta"]
    before = one(s, "The recipe says", max_tokens=24, seed=3)
    assert before.samples[0].theta_version == old_version
    version = s.update_theta(str(tiny_same[0]), version="copy-of-teacher")
    assert version == "copy-of-teacher" == s.weight_versions["theta"]
    after = one(s, "The recipe says", max_tokens=24, seed=3)
    sample = after.samples[0]
    assert sample.error is None and sample.theta_version == "copy-of-teacher"
    assert sample.teacher_version == s.weight_versions["teacher"]
    # Both engines now hold the same model: log π_θ = log π_t at every token, and q = π at any α.
    assert max(abs(a - b) for a, b in zip(sample.logp_theta, sample.logp_teacher)) <= SAME_WEIGHTS_TWO_RUNS
    assert len(sample.token_ids) > 0
    # α, log q and both log π against float64 re-scoring with the new θ (the teacher's model).
    assert assert_drawn_from(after, hf_teacher, hf_teacher, s.vocab) > 0
    assert assert_drawn_from(before, hf_teacher, hf_theta, s.vocab) > 0


def test_a_state_dict_update_and_the_teacher_update_use_the_new_weights(restore, hf_models):
    s = restore
    hf_teacher, hf_theta = hf_models
    version = s.update_theta(hf_teacher.state_dict())  # a transformers state dict, tied names and all
    assert version == s.weight_versions["theta"]
    assert not list(listing_dir().glob("weights-*")), "the staged weights were left behind"
    sample = one(s, "Once upon a time", max_tokens=16, seed=5).samples[0]
    assert sample.theta_version == version
    assert max(abs(a - b) for a, b in zip(sample.logp_theta, sample.logp_teacher)) <= SAME_WEIGHTS_TWO_RUNS
    s.update_teacher(hf_theta.state_dict(), version="teacher-as-theta")
    s.update_theta(hf_theta.state_dict())
    request = one(s, "Once upon a time", max_tokens=16, seed=5)
    assert request.samples[0].teacher_version == "teacher-as-theta"
    assert assert_drawn_from(request, hf_theta, hf_theta, s.vocab) > 0


def test_a_prompt_cached_before_the_update_is_scored_by_the_new_weights(restore, hf_models, tiny_same):
    """The theta engine's prefix cache is reset: KV computed with the old weights is never reused."""
    s = restore
    hf_teacher, hf_theta = hf_models
    before = one(s, LONG_PROMPT, max_tokens=8, seed=11, n=2)  # the prompt's blocks are now cached on both engines
    assert assert_drawn_from(before, hf_teacher, hf_theta, s.vocab) > 0
    s.update_theta(str(tiny_same[0]))
    after = one(s, LONG_PROMPT, max_tokens=8, seed=11, n=2)
    assert assert_drawn_from(after, hf_teacher, hf_teacher, s.vocab) > 0


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda sd: sd.pop("model.layers.1.self_attn.o_proj.weight"), "model.layers.1.self_attn.o_proj.weight"),
        (lambda sd: sd.__setitem__("model.layers.9.mlp.up_proj.weight", torch.zeros(2, 2)), "layers.9.mlp.up_proj"),
        (lambda sd: sd.__setitem__("model.norm.weight", torch.ones(7)), "model.norm.weight"),
        (lambda sd: sd["model.layers.0.mlp.down_proj.weight"].__setitem__((0, 0), math.nan), "down_proj.weight"),
        (lambda sd: sd["model.layers.1.mlp.gate_proj.weight"].__setitem__((3, 5), -math.inf), "gate_proj.weight"),
        (lambda sd: sd.__setitem__("model.embed_tokens.weight", sd["model.embed_tokens.weight"].long()), "embed"),
    ],
    ids=["missing", "extra", "shape", "nan", "-inf", "integer"],
)
def test_a_refused_update_names_the_tensor_and_changes_nothing(live, hf_models, change, named):
    s = live
    versions = s.weight_versions
    before = one(s, "Count to ten:", max_tokens=12, seed=2).samples[0]
    state = {k: v.clone() for k, v in hf_models[0].state_dict().items()}
    change(state)
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        s.update_theta(state)
    assert s.weight_versions == versions
    after = one(s, "Count to ten:", max_tokens=12, seed=2).samples[0]
    assert after.token_ids == before.token_ids and after.logp_theta == before.logp_theta and after.logq == before.logq


def test_a_folder_of_another_model_and_bad_arguments_are_refused_by_name(live, tmp_path):
    s = live
    with pytest.raises(ValueError, match="holds no .safetensors"):
        s.update_theta(str(tmp_path))
    with pytest.raises(ValueError, match="mode must be one of"):
        s.update_theta({}, mode="keep")
    with pytest.raises(ValueError, match="version must be"):
        s.update_theta({}, version="")
    with pytest.raises(ValueError, match="non-empty mapping"):
        s.update_theta({})


@pytest.mark.budget(
    120,
    reason=(
        "requests of 150-200 steps must be in flight when the update starts, and every sample is re-scored: 58 s on "
        "an idle CI run"
    ),
)
@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_an_update_with_requests_in_flight_never_mixes_versions(restore, hf_models, tiny_same, mode):
    s = restore
    hf_teacher, hf_theta = hf_models
    prompts = [f"Story {i}: the {w} went" for i, w in enumerate(["cat", "dog", "fox", "owl", "bee", "elk"])]
    counters_before = s.get_sync_statistics()
    old_version = s.weight_versions["theta"]  # theta's own weights, whatever earlier tests labelled them

    async def run():
        # At least 150 steps each, so requests are surely in flight (and two wait for a slot) when the update starts.
        first = [
            asyncio.create_task(s.complete(p, max_tokens=200, min_tokens=150, seed=i, sample_key=i))
            for i, p in enumerate(prompts)
        ]
        while not s.driver.in_flight():
            await asyncio.sleep(0.01)
        version = await s.update_theta_async(str(tiny_same[0]), mode=mode, version="new")
        later = [asyncio.create_task(s.complete(p, max_tokens=16, seed=7, sample_key=9)) for p in prompts[:2]]
        return version, await asyncio.gather(*first), await asyncio.gather(*later)

    version, first, later = asyncio.run(run())
    assert version == "new"
    samples = [*first, *later]
    assert {x.theta_version for x in samples} <= {old_version, "new"}
    assert all(x.theta_version == "new" for x in later)
    old = [x for x in first if x.theta_version == old_version]
    assert old, "no request was in flight when the update began"
    if mode == "abort":
        assert all(x.finish_reason == "abort" and x.stop_reason == "weight_update" for x in old)
    else:
        assert all(x.finish_reason in ("stop", "length") for x in old)
    for i, x in enumerate(samples):
        assert x.error is None, x.error
        if not x.token_ids:
            continue
        prompt = prompts[i] if i < len(first) else prompts[i - len(first)]
        ids = s.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        request = RequestRecord(i, ids, ids, [x])
        hf_new_or_old = hf_teacher if x.theta_version == "new" else hf_theta
        assert assert_drawn_from(request, hf_teacher, hf_new_or_old, s.vocab) > 0
    stats = s.get_sync_statistics()
    failed = {k: stats[k] - counters_before[k] for k in stats if k.startswith("failed_")}
    assert set(failed.values()) == {0}, failed
    assert stats["in_flight"] == 0 and stats["queued"] == 0
    assert s.session.held_slots() == []


def halved_mlps(model):
    """A copy of ``model`` with every MLP weight halved (exact in float32): weights neither side started with."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for name, parameter in other.named_parameters():
            if ".mlp." in name:
                parameter.mul_(0.5)
    return other


def drawing(s: OptimalSamplingDual, count: int, tokens: int = 3) -> bool:
    """``count`` requests hold slots, and each has drawn at least ``tokens`` tokens."""
    slots = s.session.held_slots()
    return len(slots) >= count and all(int(s.session.control[slot, Slot.NUM_RECORDS]) >= tokens for slot in slots)


def test_keep_holds_requests_across_a_theta_update_and_each_token_records_its_version(restore, hf_models, monkeypatch):
    """pause(mode="keep") with requests half drawn (two with long teacher prompts that θ does not see), θ updated,
    resume: each held sample names the θ version of every token, and every record re-scores against the version it
    names (the KV cache of the old θ is not reused: with it, the tokens after the resume do not re-score). A request
    aborted while held ends at the resume; one that arrives while held waits and draws from the new θ alone. The
    health watch, here declaring a stall after 1.5 s without a row, does not count held requests as stalled."""
    s = restore
    monkeypatch.setattr(health, "STALL_GRACE_S", 1.5 - s.driver.sync_timeout)
    hf_teacher, hf_theta = hf_models
    new_theta = halved_mlps(hf_theta)
    old = s.weight_versions["theta"]
    tok = lambda text: s.tokenizer(text, add_special_tokens=True)["input_ids"]
    thetas = [tok(f"Tale {i}: the {w} sat") for i, w in enumerate(["cat", "dog", "fox", "owl"])]
    teachers = [tok(LONG_PROMPT + " Tale 0: the cat sat"), tok(LONG_PROMPT + " Tale 1: the dog sat"), *thetas[2:]]
    before = s.get_sync_statistics()
    drawn_at_pause: dict[int, int] = {}

    async def run():
        def start(i: int, tokens: int, key: int):
            return asyncio.create_task(
                s.complete(thetas[i], teachers[i], max_tokens=tokens, min_tokens=tokens, seed=i, sample_key=key)
            )

        held = [start(i, 40, i) for i in range(3)]
        aborted = asyncio.create_task(s.complete(thetas[3], max_tokens=40, min_tokens=40, seed=3, request_id="gone"))
        while not drawing(s, 4):
            assert not any(t.done() for t in [*held, aborted]), "a request ended before the pause"
            await asyncio.sleep(0.002)
        await s.pause_async("keep")
        assert s.paused and s.session.held
        counts = {slot: int(s.session.control[slot, Slot.NUM_RECORDS]) for slot in s.session.held_slots()}
        await asyncio.sleep(3 * health.WATCH_S + 1.5)
        assert counts == {slot: int(s.session.control[slot, Slot.NUM_RECORDS]) for slot in s.session.held_slots()}
        assert s.healthy(), s.failure
        drawn_at_pause.update(counts)
        queued = start(0, 8, 9)  # waits for the resume
        assert s.abort("gone")
        with pytest.raises(ValueError, match="role='teacher'"):
            await s.update_teacher_async(hf_teacher.state_dict())
        with pytest.raises(ValueError, match="mode='wait'"):
            await s.pause_async("wait")
        with pytest.raises(ValueError, match=r"resume\(\) before a new alpha"):
            s.update_alpha("kl_symmetry")  # held requests finish on the computer they started with
        state = {name: tensor.detach().clone() for name, tensor in new_theta.state_dict().items()}
        with pytest.raises(ValueError, match="mode='abort'"):
            await s.update_theta_async(state, mode="abort")
        assert await s.update_theta_async(state, version="kept-1") == "kept-1"
        await asyncio.sleep(0.1)
        assert not any(t.done() for t in [*held, aborted, queued]), "a request moved while held"
        await s.resume_async()
        return await asyncio.gather(*held), await aborted, await queued

    held, aborted, queued = asyncio.run(run())
    assert not s.paused and not s.session.held and s.session.held_slots() == []
    assert aborted.finish_reason == "abort" and aborted.error is None and aborted.theta_versions is None
    assert len(drawn_at_pause) == 4 and len(aborted.token_ids) in drawn_at_pause.values()  # nothing drawn after
    spans = sorted(x.theta_versions.index("kept-1") for x in held if x.theta_versions)
    assert len(spans) == len(held) and set(spans) <= set(drawn_at_pause.values()), (spans, drawn_at_pause)
    for i, x in enumerate(held):
        assert x.error is None and len(x.token_ids) == 40, x.error
        assert x.theta_version == old and x.theta_versions[0] == old and x.theta_versions[-1] == "kept-1"
        request = RequestRecord(i, teachers[i], thetas[i], [x])
        versions = {old: hf_theta, "kept-1": new_theta}
        assert assert_records_match_rescoring(request, hf_teacher, versions, s.vocab, "kl_symmetry") == 40
        with pytest.raises(AssertionError):  # the oracle tells the versions apart: one θ for all fails
            assert_records_match_rescoring(request, hf_teacher, new_theta, s.vocab, "kl_symmetry")
    assert queued.theta_version == "kept-1" and queued.theta_versions is None
    request = RequestRecord(0, teachers[0], thetas[0], [queued])
    assert assert_records_match_rescoring(request, hf_teacher, new_theta, s.vocab, "kl_symmetry") == 8
    stats = s.get_sync_statistics()
    failed = {k: stats[k] - before[k] for k in stats if k.startswith("failed_")}
    assert set(failed.values()) == {0}, failed


def test_keep_lands_while_requests_end_at_every_step_and_fails_none(restore, hf_models):
    """A pause with keep while requests end at nearly every step (short ones stream through three of the four seats,
    most ending at a stop string, which the leader decides), beside a long one: vLLM then completes the pause only
    once each engine reported its ended requests, stepping with a budget of 0 meanwhile, and no running request may
    fail for not being scheduled by such a step. While held, every request the leader ended before the pause ends on
    every engine too (its sample is delivered, its slot freed). After the resume every sample re-scores."""
    s = restore
    hf_teacher, hf_theta = hf_models
    rng = random.Random(11)
    prompts = [f"Item {i}: the {rng.choice(['red', 'blue', 'tall'])} one" for i in range(40)]
    before = s.get_sync_statistics()

    async def run():
        long = [
            asyncio.create_task(s.complete(p, max_tokens=24, min_tokens=24, seed=i, sample_key=i))
            for i, p in enumerate(prompts[:1])
        ]
        short = [
            asyncio.create_task(s.complete(p, max_tokens=8, stop=["e", "a", "o", "i", " "], seed=i, sample_key=i))
            for i, p in enumerate(prompts[1:], 1)
        ]
        while sum(t.done() for t in short) < 6:
            await asyncio.sleep(0.001)
        await s.pause_async("keep")
        await asyncio.sleep(0.5)
        control = s.session.control
        ended = [slot for slot in s.session.held_slots() if int(control[slot, Slot.PHASE]) == Phase.FINISHED]
        assert not ended, "requests the leader ended before the pause were held on another engine"
        done = sum(t.done() for t in [*long, *short])
        await asyncio.sleep(0.2)
        assert sum(t.done() for t in [*long, *short]) == done and not any(t.done() for t in long)
        await s.resume_async()
        return await asyncio.gather(*long, *short)

    samples = asyncio.run(run())
    stats = s.get_sync_statistics()
    failed = {k: stats[k] - before[k] for k in stats if k.startswith("failed_")}
    assert set(failed.values()) == {0}, failed
    for i, x in enumerate(samples):
        assert x.error is None and x.finish_reason in ("stop", "length"), (x.error, x.finish_reason)
        ids = s.tokenizer(prompts[i], add_special_tokens=True)["input_ids"]
        assert assert_drawn_from(RequestRecord(i, ids, ids, [x]), hf_teacher, hf_theta, s.vocab) > 0
    assert s.session.held_slots() == []


# ---------------------------------------------------------------------- vLLM's RL routes on the server


@pytest.fixture
def weights_server(restore, tiny_same, tmp_path):
    from dual_sampling.server.app import build_app
    from dual_sampling.server.serve_options import ServeOptions
    from tests.test_serve import KEY, Server

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "teacher").symlink_to(tiny_same[0])  # inside by name, but it resolves outside: refused
    copy = allowed / "teacher-copy"
    copy.mkdir()
    for f in Path(tiny_same[0]).glob("*.safetensors"):
        (copy / f.name).write_bytes(f.read_bytes())
    server = Server(build_app(restore, ServeOptions(api_key=KEY, weights_dirs=[str(allowed)])))
    yield server, KEY, allowed
    server.stop()


def test_the_rl_routes_need_the_key_and_update_theta_from_an_allowed_folder(weights_server, tiny_same):
    import httpx

    server, key, allowed = weights_server
    auth = {"Authorization": f"Bearer {key}"}
    body = {"update_info": {"weights_path": str(allowed / "teacher-copy")}, "weight_version": "step-1"}
    for method, path in [
        ("POST", "/pause"),
        ("POST", "/resume"),
        ("GET", "/is_paused"),
        ("POST", "/update_weights"),
        ("POST", "/update_weight_version"),
        ("GET", "/weight_info"),
    ]:
        assert httpx.request(method, server.url + path, json=body, timeout=30).status_code == 401, path
    post = lambda path, **kw: httpx.post(server.url + path, headers=auth, timeout=60, **kw)
    get = lambda path: httpx.get(server.url + path, headers=auth, timeout=60).json()

    old = get("/weight_info")["weight_version"]
    for bad, param, status in [
        ({"update_info": {"weights_path": str(tiny_same[0])}}, "update_info.weights_path", 403),  # outside
        ({"update_info": {"weights_path": str(allowed / "teacher")}}, "update_info.weights_path", 403),  # symlink
        ({"update_info": {"weights_path": str(allowed / "..")}}, "update_info.weights_path", 403),
        ({"update_info": {"weights_path": str(allowed)}}, "update_info.weights_path", 400),  # no safetensors
        ({"update_info": {}}, "update_info", 400),
        ({"update_info": {"weights_path": str(allowed / "teacher-copy")}, "mode": "keep"}, "mode", 400),
        ({"update_info": {"weights_path": str(allowed / "teacher-copy")}, "weight_version": ""}, "weight_version", 400),
        ({**body, "extra": 1}, "extra", 400),
    ]:
        response = post("/update_weights", json=bad)
        assert response.status_code == status, (bad, response.text)
        assert response.json()["error"]["param"] == param, response.text
    assert post("/pause", params={"mode": "freeze"}).json()["error"]["param"] == "mode"
    assert get("/weight_info")["weight_version"] == old

    assert post("/pause", params={"mode": "wait"}).json() == {"status": "paused"}
    assert get("/is_paused") == {"is_paused": True}
    assert post("/update_weights", json=body).json() == {"message": "Weights updated", "weight_version": "step-1"}
    assert get("/is_paused") == {"is_paused": True}  # an update inside a pause leaves it paused
    assert post("/resume").json() == {"status": "resumed"}
    assert post("/update_weight_version", json={"new_version": "step-1b"}).json() == {
        "success": True,
        "new_version": "step-1b",
    }
    # A label earlier weights carried is refused: records of two θ would name one.
    for used in ("step-1", old):
        response = post("/update_weight_version", json={"new_version": used})
        assert response.status_code == 400 and response.json()["error"]["param"] == "new_version", response.text
    assert get("/weight_info") == {
        "weight_version": "step-1b",
        "teacher_weight_version": get("/weight_info")["teacher_weight_version"],
    }
    reply = post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "seed": 1}).json()
    records = reply["choices"][0]["dual_sampling"]
    assert records["theta_version"] == "step-1b"
    # theta holds the teacher's weights now: its log-probabilities are the teacher's
    assert max(abs(a - b) for a, b in zip(records["logp_theta"], records["logp_teacher"])) <= SAME_WEIGHTS_TWO_RUNS
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'dual_sampling_weight_version_info{role="theta",version="step-1b"} 1.0' in metrics


def test_trls_vllm_client_drives_the_weight_transfer_routes_with_the_shared_memory_engine(
    weights_server, live, hf_models, monkeypatch
):
    """TRL's own async GRPO client, vLLM's own trainer-side factory with our engine's init info, the teacher's
    transformers model as the source: θ takes the teacher's weights in several chunks. A refused chunk (a NaN)
    names its tensor and changes nothing; the server stays healthy."""
    import functools

    import httpx
    import requests
    from trl.experimental.async_grpo.vllm_client import VLLMClient
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from processors.weight_transfer import SharedMemoryTrainerInitInfo, register, weights_folder, write_chunk

    server, key, _ = weights_server
    auth = {"Authorization": f"Bearer {key}"}
    # TRL's client sends no key, and the server serves these routes only with one (docs/server.md says how).
    monkeypatch.setattr(requests, "post", functools.partial(requests.post, headers=auth))
    monkeypatch.setattr(requests, "get", functools.partial(requests.get, headers=auth))
    client = VLLMClient(server.url, server_timeout=30)
    hf_teacher = hf_models[0]

    def completion(prompt: str = "Hello there", tokens: int = 8):
        reply = httpx.post(
            server.url + "/v1/completions",
            headers=auth,
            json={"prompt": prompt, "max_tokens": tokens, "min_tokens": tokens, "seed": 3},
            timeout=120,
        )
        return reply.json()["choices"][0]["dual_sampling"]

    before = completion()
    assert client.get_world_size() == 1
    refused = httpx.post(server.url + "/start_draft_weight_update", headers=auth, timeout=30)
    assert refused.status_code == 400 and "not a draft model" in refused.text  # θ has an engine of its own here
    client.init_weight_transfer_engine({})
    with pytest.raises(Exception, match="init_info.master_address"):
        client.init_weight_transfer_engine({"master_address": "127.0.0.1"})

    # A chunk with a NaN and malformed chunks: refused by name, the update left open, nothing loaded; then a finish
    # that misses tensors is refused and drops the update.
    client.start_weight_update()
    folder = weights_folder()
    try:
        name, tensor = next(iter(hf_teacher.named_parameters()))
        poisoned = tensor.detach().clone()
        poisoned.view(-1)[7] = math.nan
        with pytest.raises(Exception, match=f"{name}.*holds a NaN"):
            client.update_weights(write_chunk([(name, poisoned)], folder, "nan"))
        good = write_chunk([(name, tensor.detach())], folder, "good")
        for bad in (
            {**good, "path": "/etc/passwd"},  # not in this user's weights folders
            {**good, "shapes": [[1, 2, 3]]},  # not the tensor's shape (and past the file's end)
            {**good, "names": [name, name]},  # lengths disagree
            {**good, "offsets": [-64]},
            [good, good],  # one entry per worker: this engine has one
            "chunk",
            {**good, "extra": True},
        ):
            reply = httpx.post(server.url + "/update_weights", headers=auth, json={"update_info": bad}, timeout=30)
            assert reply.status_code == 400 and reply.json()["error"]["param"] == "update_info", (bad, reply.text)
        with pytest.raises(Exception, match="missing"):
            client.finish_weight_update()  # refused: the update is dropped, so the next start is taken
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    finally:
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()
    assert completion() == before  # same seed, same weights: the same records

    # TRL's loop: pause with keep while completions are half drawn, push θ := the teacher, resume.
    prompts = [f"Note {i}: the {w} ran" for i, w in enumerate(["ant", "yak", "emu"])]
    control = live.session.control
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        held = [pool.submit(completion, p, 40) for p in prompts]
        while len(live.session.held_slots()) < len(prompts) or any(
            int(control[slot, Slot.NUM_RECORDS]) < 3 for slot in live.session.held_slots()
        ):
            assert not any(f.done() for f in held), "a completion ended before the pause"
            time.sleep(0.002)
        client.pause()  # mode=keep
        assert httpx.get(server.url + "/is_paused", headers=auth, timeout=30).json() == {"is_paused": True}
        register()
        sender = WeightTransferTrainerFactory.trainer_init(
            SharedMemoryTrainerInitInfo(rank=0, chunk_bytes=1 << 16), client=client, source=ModuleSource(hf_teacher)
        )
        sender.send_weights()  # start, a dozen chunks, finish
        assert not any(f.done() for f in held), "a held completion ended while paused"
        client.resume()
        spanning = [f.result() for f in held]
    after = completion()
    assert after["theta_version"] != before["theta_version"]
    old_theta, new_version = before["theta_version"], after["theta_version"]
    for prompt, records in zip(prompts, spanning):
        versions = records["theta_versions"]
        assert len(versions) == 40 and versions[0] == old_theta and versions[-1] == new_version, versions
        sample = SimpleNamespace(**{**records, "theta_versions": versions})
        ids = live.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        request = SimpleNamespace(samples=[sample], teacher_prompt_token_ids=ids, theta_prompt_token_ids=ids)
        thetas = {old_theta: hf_models[1], new_version: hf_teacher}
        assert assert_records_match_rescoring(request, hf_teacher, thetas, live.vocab, "kl_symmetry") == 40
    # θ holds the teacher's weights now: its log-probabilities are the teacher's.
    assert max(abs(a - b) for a, b in zip(after["logp_theta"], after["logp_teacher"])) <= SAME_WEIGHTS_TWO_RUNS
    assert not [p for p in listing_dir().glob("weights-*")], "a chunk was left behind"
