"""The proxy's routing logic against stub OpenAI backends that are real HTTP servers."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from p2pkv.errors import ConfigError
from p2pkv.proxy import Instance, ProxyConfig, create_app
from tests.helpers.servers import serve
from tests.helpers.stubs import USAGE, Observed, stub_decode, stub_prefill, stub_slow
from tests.helpers.unit import DropsFirstRequest, proxy_for, proxy_with, stub_prefill_status


def test_prefill_then_decode_with_the_returned_params(backends: Any) -> None:
    p, d, p_seen, d_seen = backends
    with serve(proxy_for(p, d)) as proxy:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 20, "stream_options": {"include_usage": True},
                "min_tokens": 3}
        resp = httpx.post(f"http://{proxy}/v1/completions", json=body, headers={"Authorization": "Bearer k"})
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["text"] == "abc"
    sent = p_seen[0]["body"]
    assert sent["max_tokens"] == 1 and sent["stream"] is False
    assert "stream_options" not in sent and "min_tokens" not in sent
    params = sent["kv_transfer_params"]
    # The decode instance's KV address was asked of the instance itself (probe), its host from the HTTP address.
    assert params["decode_kv_address"] == "127.0.0.1:23456"
    assert p_seen[0]["auth"] == "Bearer k"
    assert d_seen[0]["max_tokens"] == 20 and d_seen[0]["min_tokens"] == 3
    assert d_seen[0]["kv_transfer_params"]["transfer_id"] == params["transfer_id"]
    assert d_seen[0]["kv_transfer_params"]["load_remote_kv"] is True


def test_parallel_sampling_prefills_once_and_samples_n_times_on_decode(backends: Any) -> None:
    p, d, p_seen, d_seen = backends
    with serve(proxy_for(p, d)) as proxy:
        resp = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "hi", "max_tokens": 5, "n": 3})
    assert resp.status_code == 200
    assert p_seen[0]["body"]["n"] == 1  # the prefill instance computes the prompt's KV once
    assert d_seen[0]["n"] == 3


@pytest.mark.parametrize(("path", "extra"), [
    ("/v1/completions", {"prompt_logprobs": 1}),
    ("/v1/completions", {"prompt_logprobs": 0}),
    ("/v1/completions", {"echo": True, "logprobs": 2}),
    ("/v1/chat/completions", {"echo": True}),  # vLLM then takes top_logprobs (0 by default) as prompt logprobs
])
def test_prompt_logprobs_go_to_the_decode_instance_alone(backends: Any, path: str, extra: dict[str, Any]) -> None:
    p, d, p_seen, d_seen = backends
    app = proxy_for(p, d)
    with serve(app) as proxy:
        body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra,
                "kv_transfer_params": {"p2pkv": 1, "transfer_id": "stale", "load_remote_kv": True,
                                       "num_prompt_tokens": 3}}
        resp = httpx.post(f"http://{proxy}{path}", json=body)
        metrics = httpx.get(f"http://{proxy}/metrics").text
    assert resp.status_code == 200
    assert p_seen == [] and len(d_seen) == 1 and "kv_transfer_params" not in d_seen[0]
    assert "p2pkv_proxy_decode_only_total 1.0" in metrics


@pytest.mark.parametrize(("path", "extra"), [
    ("/v1/completions", {"logprobs": 2}),
    ("/v1/completions", {"echo": True}),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2}),
    ("/v1/completions", {"prompt_logprobs": None}),
])
def test_other_logprobs_are_prefilled_as_usual(backends: Any, path: str, extra: dict[str, Any]) -> None:
    p, d, p_seen, d_seen = backends
    with serve(proxy_for(p, d)) as proxy:
        body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
        assert httpx.post(f"http://{proxy}{path}", json=body).status_code == 200
    assert len(p_seen) == 1 and d_seen[0]["kv_transfer_params"]["load_remote_kv"] is True


def test_a_batch_of_prompts_goes_as_one_transfer_per_prompt(backends: Any) -> None:
    p, d, p_seen, d_seen = backends
    with serve(proxy_for(p, d)) as proxy:
        resp = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": ["one", "two", "three"], "n": 2})
    assert resp.status_code == 200
    assert sorted(s["body"]["prompt"] for s in p_seen) == ["one", "three", "two"]
    assert sorted(b["prompt"] for b in d_seen) == ["one", "three", "two"]
    transfers = resp.headers["x-p2pkv-transfer-id"].split(",")
    assert len(set(transfers)) == 3
    # Each prompt's decode request names its own transfer, and the answer lists them in prompt order.
    assert [next(b["kv_transfer_params"]["transfer_id"] for b in d_seen if b["prompt"] == prompt)
            for prompt in ("one", "two", "three")] == transfers
    answer = resp.json()
    assert [(c["index"], c["prompt_seen"]) for c in answer["choices"]] == [
        (0, "one"), (1, "one"), (2, "two"), (3, "two"), (4, "three"), (5, "three")]
    assert answer["usage"] == {"prompt_tokens": 15, "completion_tokens": 18,
                               "prompt_tokens_details": {"cached_tokens": 12, "other": None}}


@pytest.mark.parametrize("body", [
    {"prompt": [1, 2, 3]},  # token ids: one prompt
    {"prompt": ["one"]},
    {"prompt": [[1, 2], [3]], "stream": True},  # a batch, but through the chat endpoint: not a completion
])
def test_what_is_not_split(backends: Any, body: dict[str, Any]) -> None:
    p, d, p_seen, _ = backends
    path = "/v1/chat/completions" if body.get("stream") else "/v1/completions"
    with serve(proxy_for(p, d)) as proxy:
        if body.get("stream"):
            with httpx.stream("POST", f"http://{proxy}{path}", json=body) as resp:
                assert resp.status_code == 200 and list(resp.iter_lines())
        else:
            assert httpx.post(f"http://{proxy}{path}", json=body).status_code == 200
    assert len(p_seen) == 1 and p_seen[0]["body"]["prompt"] == body["prompt"]


def events(resp: httpx.Response) -> list[Any]:
    """A stream's events: each data line's JSON, or the string "[DONE]"."""
    out: list[Any] = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.mark.parametrize("n", [1, 2])
def test_a_streamed_batch_goes_as_one_transfer_per_prompt_and_is_merged(backends: Any, n: int) -> None:
    """Each prompt of a streamed batch is a request (and a transfer) of its own; the streams are merged as vLLM
    streams a batch: each choice numbered by its prompt (prompt i's sample j is i * n + j), one id, one final usage
    chunk summing the prompts', one [DONE] at the end."""
    p, d, p_seen, d_seen = backends
    prompts = ["one", "two", "three"]
    body = {"prompt": prompts, "stream": True, "n": n, "stream_options": {"include_usage": True}}
    with serve(proxy_for(p, d)) as proxy:
        with httpx.stream("POST", f"http://{proxy}/v1/completions", json=body, timeout=10) as resp:
            assert resp.status_code == 200
            got = events(resp)
            transfers = resp.headers["x-p2pkv-transfer-id"].split(",")
        wait_idle(proxy)
    assert sorted(s["body"]["prompt"] for s in p_seen) == sorted(prompts)
    assert sorted(b["prompt"] for b in d_seen) == sorted(prompts)
    assert len(set(transfers)) == 3 and {b["kv_transfer_params"]["transfer_id"] for b in d_seen} == set(transfers)
    assert got[-1] == "[DONE]" and got.count("[DONE]") == 1
    *chunks, usage = got[:-1]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 15, "completion_tokens": 6,
                                                         "total_tokens": 21}
    assert len({c["id"] for c in got[:-1]}) == 1
    for position, prompt in enumerate(prompts):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["prompt_seen"] == prompt]
        assert [c["text"] for c in mine] == ["a", "b", "c"]  # in order
        assert {c["index"] for c in mine} == {position * n}


def test_a_streamed_batch_answers_with_the_failure_of_a_prompt_and_closes_the_other_streams() -> None:
    seen: list[dict[str, Any]] = []
    with serve(stub_prefill([])) as p, serve(stub_decode(seen, failures=["400"])) as d, \
            serve(proxy_for(p, d)) as proxy:
        resp = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": ["a", "b"], "stream": True},
                          timeout=10)
        assert resp.status_code == 400
        wait_idle(proxy)  # the other prompt's stream was closed, never read
    assert len(seen) == 2


def test_a_client_leaving_a_streamed_batch_cancels_every_decode_request(backends: Any) -> None:
    """Every prompt's decode stream is closed when the client goes away. (One of them used to stay open: closed
    from a task that anyio was cancelling, its connection was marked closed but was not, and the decode instance
    went on decoding for nobody.)"""
    p, _, _, _ = backends
    obs = Observed()
    prompts = ["one", "two", "three"]
    with serve(stub_slow(obs)) as slow, serve(proxy_for(p, slow)) as proxy:
        with httpx.stream("POST", f"http://{proxy}/v1/completions",
                          json={"prompt": prompts, "stream": True}, timeout=10) as resp:
            next(line for line in resp.iter_lines() if line.startswith("data: "))
        deadline = time.monotonic() + 5
        while len(obs.closed_early) < len(prompts) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(obs.closed_early) == sorted(prompts), "a decode backend still streams to a client that left"
        wait_idle(proxy)
    assert len(obs.bodies) == 3


def test_a_batch_answers_with_a_failure_of_any_of_its_prompts() -> None:
    from contextlib import ExitStack

    from tests.helpers.unit import Setup

    with ExitStack() as stack:
        setup = Setup(stack, 1, [["400"]])  # the first decode request (of whichever prompt) is refused
        resp = httpx.post(f"http://{setup.proxy}/v1/completions", json={"prompt": ["a", "b", "c"]}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == 400
    assert len(setup.d_seen[0]) == 3


def test_transfer_ids_are_fresh_per_request(backends: Any) -> None:
    p, d, p_seen, _ = backends
    with serve(proxy_for(p, d + "@127.0.0.1:9999")) as proxy:
        for _ in range(3):
            httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    ids = {s["body"]["kv_transfer_params"]["transfer_id"] for s in p_seen}
    assert len(ids) == 3
    assert all(s["body"]["kv_transfer_params"]["decode_kv_address"] == "127.0.0.1:9999" for s in p_seen)


def test_chat_max_completion_tokens_and_streaming(backends: Any) -> None:
    p, d, p_seen, _ = backends
    with serve(proxy_for(p, d)) as proxy:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9, "stream": True}
        with httpx.stream("POST", f"http://{proxy}/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert p_seen[0]["body"]["max_completion_tokens"] == 1
    assert lines[-1] == "data: [DONE]"
    assert "".join(json.loads(line[6:])["choices"][0].get("text", "") for line in lines[:-1]) == "abc"


def test_failed_prefill_is_retried_on_another_instance(backends: Any) -> None:
    good, d, good_seen, d_seen = backends
    bad_seen: list[dict[str, Any]] = []
    with serve(stub_prefill_status(500, bad_seen)) as bad, serve(proxy_with([bad, good], d)) as proxy:
        resp = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x", "max_tokens": 3})
        metrics = httpx.get(f"http://{proxy}/metrics").text
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "abc"
    assert len(bad_seen) == 1 and len(good_seen) == 1
    assert d_seen[0]["kv_transfer_params"]["transfer_id"] == good_seen[0]["body"]["kv_transfer_params"][
        "transfer_id"]
    assert "p2pkv_proxy_prefill_retries_total 1.0" in metrics


def test_no_healthy_prefill_falls_back_to_the_decode_instance_alone(backends: Any) -> None:
    _, d, _, d_seen = backends
    with serve(proxy_with(["127.0.0.1:1", "127.0.0.1:2"], d)) as proxy:
        resp = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x", "max_tokens": 3})
        metrics = httpx.get(f"http://{proxy}/metrics").text
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "abc"
    assert "kv_transfer_params" not in d_seen[0] and d_seen[0]["max_tokens"] == 3
    assert "p2pkv_proxy_decode_only_fallbacks_total 1.0" in metrics
    assert "p2pkv_proxy_prefill_retries_total 1.0" in metrics


def test_a_request_the_prefill_instance_rejects_is_answered_not_retried(backends: Any) -> None:
    _, d, _, d_seen = backends
    seen: list[dict[str, Any]] = []
    with serve(stub_prefill_status(400, seen)) as p, serve(proxy_with([p, p], d)) as proxy:
        resp = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x"})
    assert resp.status_code == 400 and len(seen) == 1
    assert d_seen == []


def test_decode_failure_is_an_openai_error_not_an_empty_200(backends: Any) -> None:
    p, _, _, _ = backends
    with serve(proxy_for(p, "127.0.0.1:1@127.0.0.1:2")) as proxy:
        resp = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x"})
    assert resp.status_code == 502
    assert "decode instance 127.0.0.1:1 failed" in resp.json()["error"]["message"]


def test_api_key_is_required_and_passed_on(backends: Any) -> None:
    p, d, p_seen, _ = backends
    with serve(proxy_with([p], d, api_key="k1")) as proxy:
        assert httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x"}).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x"}, headers=wrong).status_code == 401
        ok = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x"},
                        headers={"Authorization": "Bearer k1"})
    assert ok.status_code == 200
    assert p_seen[0]["auth"] == "Bearer k1"


def test_instances_endpoint_lists_roles_and_load(backends: Any) -> None:
    p, d, _, _ = backends
    with serve(proxy_with([p], d + "@127.0.0.1:9")) as proxy:
        httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x"})
        listed = httpx.get(f"http://{proxy}/instances").json()["instances"]
        models = httpx.get(f"http://{proxy}/v1/models").json()
    assert [(i["role"], i["address"], i["in_flight"]) for i in listed] == [("prefill", p, 0), ("decode", d, 0)]
    assert listed[1]["kv_address"] == "127.0.0.1:9"
    assert models["data"][0]["id"] == "tiny"


def test_tokenize_and_the_version_come_from_a_decode_instance(backends: Any) -> None:
    p, d, p_seen, d_seen = backends
    with serve(proxy_with([p], d)) as proxy:
        tokens = httpx.post(f"http://{proxy}/tokenize", json={"model": "tiny", "prompt": "hey"},
                            headers={"Authorization": "Bearer k"})
        version = httpx.get(f"http://{proxy}/version")
        rogue = httpx.get(f"http://{proxy}/v1/models", params={"path": "/v1/completions"})
    assert tokens.status_code == 200 and tokens.json() == {"tokens": [104, 101, 121], "count": 3}
    assert d_seen == [{"tokenize": {"model": "tiny", "prompt": "hey"}, "auth": "Bearer k"}] and p_seen == []
    assert version.status_code == 404  # the stub has none: its answer is passed on
    assert rogue.json()["data"][0]["id"] == "tiny"  # a query parameter does not choose the upstream path


def test_policies() -> None:
    from p2pkv.proxy.registry import Policy, static_pool

    a, b, c = (Instance.parse(f"h:{i}") for i in (1, 2, 3))
    least = static_pool("prefill", (a, b, c), Policy.LEAST_OUTSTANDING)
    first = least.pick()
    assert first is not None
    with least.busy(first):
        picks = {least.pick().instance for _ in range(4)}
        assert first.instance not in picks and len(picks) == 2
    assert least.pick(frozenset({a, b})).instance == c
    assert least.pick(frozenset({a, b, c})) is None
    rr = static_pool("decode", (a, b), Policy.ROUND_ROBIN)
    assert [rr.pick().instance for _ in range(4)] == [a, b, a, b]


def test_bad_json_body(backends: Any) -> None:
    p, d, p_seen, _ = backends
    with serve(proxy_for(p, d)) as proxy:
        resp = httpx.post(f"http://{proxy}/v1/completions", content=b"{nope")
    assert resp.status_code == 400
    assert p_seen == []


def test_instance_parsing() -> None:
    assert Instance.parse("http://h:1/").http.port == 1
    inst = Instance.parse("h:1@k:2")
    assert inst.kv is not None and inst.kv.port == 2
    with pytest.raises(ConfigError, match="HOST:PORT"):
        Instance.parse("nope")
    with pytest.raises(ConfigError, match="at least one prefill"):
        ProxyConfig(prefill=(), decode=(inst,))
    for name in ("prefill_retries", "transfer_retries", "stream_resumes"):
        with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')}: expected 0 or more"):
            ProxyConfig(prefill=(inst,), decode=(inst,), **{name: -1})


def test_bench_proxy_measures_every_path() -> None:
    from p2pkv.bench.proxy import run

    results = run(requests=60, concurrency=4)
    assert set(results) == {"backend directly", "prefill then decode, by hand", "through the proxy"}
    for figures in results.values():
        assert 0 < figures.p50_ms <= figures.p99_ms and figures.per_second > 0


def wait_set(event: threading.Event, timeout_s: float = 5.0) -> bool:
    return event.wait(timeout_s)


def test_streaming_passes_chunks_as_they_come_and_keeps_usage(backends: Any) -> None:
    p, _, p_seen, _ = backends
    obs = Observed()
    with serve(stub_slow(obs)) as slow, serve(proxy_for(p, slow)) as proxy:
        body = {"prompt": "hi", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"http://{proxy}/v1/completions", json=body, timeout=10) as resp:
            lines = (line for line in resp.iter_lines() if line.startswith("data: "))
            first = next(lines)
            # The decode backend is still holding the rest: the proxy did not buffer the response.
            assert not obs.release.is_set()
            assert json.loads(first[6:])["choices"][0]["text"] == "a"
            obs.release.set()
            rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in rest[:-1]]
    assert chunks[0]["choices"][0]["text"] == "b"
    assert chunks[-1]["usage"] == USAGE
    assert obs.bodies[0]["stream_options"] == {"include_usage": True}
    assert "stream_options" not in p_seen[0]["body"]
    assert not obs.cancelled.is_set()


def ttft(proxy: str) -> tuple[float, float]:
    """The proxy's time-to-first-token histogram: (count, sum)."""
    found = {}
    for line in httpx.get(f"http://{proxy}/metrics").text.splitlines():
        for part in ("count", "sum"):
            if line.startswith(f"p2pkv_proxy_time_to_first_token_seconds_{part} "):
                found[part] = float(line.split()[1])
    return found["count"], found["sum"]


def test_time_to_first_token_is_taken_at_the_first_token_not_the_headers(backends: Any) -> None:
    # The decode stub sends a stream's headers at once and its first token 0.3 s later, as vLLM does.
    p, _, _, _ = backends
    with serve(stub_decode([], first_token_s=0.3)) as slow, serve(proxy_for(p, slow)) as proxy:
        body = {"prompt": "hi", "max_tokens": 3, "stream": True}
        started = time.monotonic()
        with httpx.stream("POST", f"http://{proxy}/v1/completions", json=body, timeout=10) as resp:
            texts = [line for line in resp.iter_lines() if line.startswith("data: ")]
        elapsed = time.monotonic() - started
        assert texts[-1] == "data: [DONE]"
        count, total = ttft(proxy)
        assert count == 1 and 0.3 <= total <= elapsed
        httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=10)
        assert ttft(proxy)[0] == 2  # a plain answer counts too, once it has come


def test_a_client_leaving_a_stream_cancels_the_decode_request(backends: Any) -> None:
    p, _, _, _ = backends
    obs = Observed()
    with serve(stub_slow(obs)) as slow, serve(proxy_for(p, slow)) as proxy:
        with httpx.stream("POST", f"http://{proxy}/v1/completions", json={"prompt": "hi", "stream": True},
                          timeout=10) as resp:
            next(line for line in resp.iter_lines() if line.startswith("data: "))
        assert wait_set(obs.cancelled), "the decode backend still streams to a client that left"
        wait_idle(proxy)
        time.sleep(0.3)
        assert obs.discards == []  # the decode instance had the request (it answered): nothing to discard


def test_a_client_leaving_a_plain_request_cancels_the_decode_request(backends: Any) -> None:
    p, _, _, _ = backends
    obs = Observed()
    with serve(stub_slow(obs)) as slow, serve(proxy_for(p, slow)) as proxy:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "hi", "model": "tiny"}, timeout=1.0)
        assert wait_set(obs.cancelled), "the decode backend still works for a client that left"
        wait_idle(proxy)
        assert 'p2pkv_proxy_requests_total{outcome="client_gone"} 1.0' in httpx.get(f"http://{proxy}/metrics").text
        # The decode request may not have got there: the decode instance is told to free the transfer, with what
        # the prefill instance answered for it.
        (discard,) = wait_for(lambda: obs.discards)
        (decoded,) = obs.bodies
        assert discard["kv_transfer_params"] == {"p2pkv": 1, "transfer_id": decoded["kv_transfer_params"][
            "transfer_id"], "discard_transfer": True}
        assert (discard["prompt"], discard["max_tokens"], discard["model"]) == ([0], 1, "tiny")
        assert 'p2pkv_proxy_discards_total{outcome="sent"} 1.0' in httpx.get(f"http://{proxy}/metrics").text


def wait_for(found: Any, timeout_s: float = 5.0) -> Any:
    """What `found()` returns once it is not empty (the proxy's discard requests go in the background)."""
    deadline = time.monotonic() + timeout_s
    while not found():
        assert time.monotonic() < deadline, "nothing came"
        time.sleep(0.02)
    time.sleep(0.1)  # and nothing more comes
    return found()


def test_a_client_that_stays_leaves_nothing_to_discard(backends: Any) -> None:
    p, d, _, d_seen = backends
    with serve(proxy_for(p, d)) as proxy:
        assert httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "hi"}, timeout=10).status_code == 200
        with httpx.stream("POST", f"http://{proxy}/v1/completions", json={"prompt": "hi", "stream": True},
                          timeout=10) as resp:
            assert list(resp.iter_lines())[-2] == "data: [DONE]"
        time.sleep(0.3)
    assert len(d_seen) == 2 and not any(b["kv_transfer_params"].get("discard_transfer") for b in d_seen)


def test_a_client_leaving_during_prefill_cancels_the_prefill_request(backends: Any) -> None:
    _, d, _, d_seen = backends
    obs = Observed()
    with serve(stub_slow(obs)) as slow, serve(proxy_for(slow, d + "@127.0.0.1:9")) as proxy:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "hi"}, timeout=1.0)
        assert wait_set(obs.cancelled), "the prefill backend still works for a client that left"
        wait_idle(proxy)
        # No decode request; only, in case the prefill pushed before it was cancelled, the transfer's discard. The
        # prefill instance gets one too: had it finished, its answer went to nobody.
        (discard,) = wait_for(lambda: d_seen)
        (to_prefill,) = wait_for(lambda: obs.discards)
    (prefilled,) = obs.bodies
    for sent in (discard, to_prefill):
        assert sent["kv_transfer_params"] == {"p2pkv": 1, "transfer_id": prefilled["kv_transfer_params"][
            "transfer_id"], "discard_transfer": True}
        assert "model" not in sent  # the client named none; vLLM takes the one it serves


def wait_idle(proxy: str, timeout_s: float = 5.0) -> None:
    """Every instance's in-flight count is back to zero."""
    deadline = time.monotonic() + timeout_s
    while any(i["in_flight"] for i in httpx.get(f"http://{proxy}/instances").json()["instances"]):
        assert time.monotonic() < deadline, "requests still counted in flight"
        time.sleep(0.05)


@pytest.mark.parametrize("reset", [False, True])
def test_a_decode_connection_broken_before_any_answer_is_sent_once_more(backends: Any, reset: bool) -> None:
    p, _, _, _ = backends
    decode = DropsFirstRequest(reset=reset)
    try:
        with serve(proxy_for(p, decode.address)) as proxy:
            resp = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x"}, timeout=30)
            metrics = httpx.get(f"http://{proxy}/metrics").text
    finally:
        decode.close()
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "abc"
    assert decode.requests == 2
    assert "p2pkv_proxy_decode_resends_total 1.0" in metrics


@pytest.mark.parametrize("static_kv", [False, True])
def test_the_decode_side_parallel_sizes_go_to_the_prefill_side(static_kv: bool) -> None:
    p_seen: list[dict[str, Any]] = []
    with serve(stub_prefill(p_seen)) as p, serve(stub_decode([], tp_size=2, pp_size=3)) as d:
        decode = d + "@127.0.0.1:9999" if static_kv else d
        with serve(proxy_for(p, decode)) as proxy:
            for _ in range(2):
                assert httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x", "max_tokens": 2}).is_success
    params = [s["body"]["kv_transfer_params"] for s in p_seen]
    assert [(x["decode_tp_size"], x["decode_pp_size"]) for x in params] == [(2, 3), (2, 3)]
    # A configured KV address stands; the probe only adds what the configuration did not say.
    assert {x["decode_kv_address"] for x in params} == {"127.0.0.1:9999" if static_kv else "127.0.0.1:23456"}


def test_parallel_sizes_from_heartbeats_need_no_probe() -> None:
    import asyncio

    from p2pkv.discovery import Announcement
    from p2pkv.params import Address
    from p2pkv.proxy.metrics import ProxyMetrics
    from p2pkv.proxy.router import KvTarget, Router

    class NoClient:  # a probe would fail the test: the heartbeat said everything
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"the proxy probed the instance ({name})")

    router = Router(ProxyConfig((), (), discovery_port=1), NoClient(), ProxyMetrics())  # type: ignore[arg-type]
    kv = Address("127.0.0.1", 23000)
    router.announce(Announcement("decode", Address("127.0.0.1", 8200), kv, 1.0, tp_size=2, pp_size=4))
    state = router.decode.pick()
    assert state is not None
    assert asyncio.run(router.kv_target(state.instance, {})) == KvTarget(kv, 2, 4)
    router.announce(Announcement("decode", Address("127.0.0.1", 8200), kv, 1.0, tp_size=2, pp_size=4, pulls=True))
    assert asyncio.run(router.kv_target(state.instance, {})) == KvTarget(kv, 2, 4, pulls=True)


@pytest.mark.parametrize("restarted", [True, False])
def test_an_instance_dropped_and_back_under_another_engine_id_is_paired_again_at_once(restarted: bool) -> None:
    """A prefill instance the decode instance refused restarts (fixed): its heartbeats stop for longer than the
    proxy waits, so it is dropped, and it comes back under another engine id while the decode instance still names
    the refusal (no hello from the new engine yet). The pair is used again at once, as for a restart seen without a
    drop. The control: back under the same engine id (its heartbeats were only lost), the pair stays passed over."""
    from p2pkv.discovery import Announcement
    from p2pkv.params import Address
    from p2pkv.proxy.metrics import ProxyMetrics
    from p2pkv.proxy.router import Router

    router = Router(ProxyConfig((), (), discovery_port=1), None, ProxyMetrics())  # type: ignore[arg-type]
    p_http, p_kv = Address("127.0.0.1", 8100), Address("127.0.0.1", 23100)
    refusal = ((p_kv, "KV layout mismatch: dtype", 1.0, ""),)  # no launch said: the engine ids tell
    router.announce(Announcement("prefill", p_http, p_kv, 0.01, engine_id="before"))
    router.announce(Announcement("decode", Address("127.0.0.1", 8200), Address("127.0.0.1", 23200), 60.0,
                                 refused=refusal, engine_id="d"))
    (decode,) = router.decode.states
    assert len(router.unpaired(decode)) == 1
    time.sleep(0.05)
    assert router.prefill.count() == 0, "dropped: its heartbeats are overdue"
    router.announce(Announcement("prefill", p_http, p_kv, 60.0, engine_id="after" if restarted else "before"))
    router.announce(Announcement("decode", Address("127.0.0.1", 8200), Address("127.0.0.1", 23200), 60.0,
                                 refused=refusal, engine_id="d"))
    assert len(router.unpaired(decode)) == (0 if restarted else 1)


@pytest.mark.parametrize("now", ["a1" * 8, "b2" * 8, ""])
def test_a_refusal_of_another_start_than_the_instance_says_now_does_not_pass_the_pair_over(now: str) -> None:
    """A proxy that never saw the prefill instance before (it started after the prefill instance restarted, so no
    engine id changed before its eyes) hears the decode instance name a refusal of the prefill worker's start
    `a1..`. The prefill instance's heartbeats say start `b2..`: the refusal is of an earlier start, and the pair
    is used. Said `a1..` (the refused start), or no start at all, the pair is passed over. Both ways round: the
    prefill instance refusing the decode instance's worker (GET) alike."""
    from p2pkv.discovery import Announcement
    from p2pkv.params import Address
    from p2pkv.proxy.metrics import ProxyMetrics
    from p2pkv.proxy.router import Router

    p_http, p_kv = Address("127.0.0.1", 8100), Address("127.0.0.1", 23100)
    d_http, d_kv = Address("127.0.0.1", 8200), Address("127.0.0.1", 23200)
    for refusing in ("decode", "prefill"):
        router = Router(ProxyConfig((), (), discovery_port=1), None, ProxyMetrics())  # type: ignore[arg-type]
        refused_kv = p_kv if refusing == "decode" else d_kv
        said = ((refused_kv, "KV layout mismatch: dtype", 1.0, "a1" * 8),)
        router.announce(Announcement("prefill", p_http, p_kv, 60.0, engine_id="p", launch=now if refusing == "decode"
                                     else "c3" * 8, refused=said if refusing == "prefill" else ()))
        router.announce(Announcement("decode", d_http, d_kv, 60.0, engine_id="d", launch=now if refusing == "prefill"
                                     else "c3" * 8, refused=said if refusing == "decode" else ()))
        (decode,) = router.decode.states
        assert len(router.unpaired(decode)) == (0 if now == "b2" * 8 else 1), refusing
        (state,) = router.decode.states if refusing == "decode" else router.prefill.states
        assert [r["launch"] for r in state.describe()["refused"]] == ["a1" * 8]  # type: ignore[attr-defined]


@pytest.mark.parametrize("pulls", [True, False])
def test_a_decode_instance_that_pulls_has_every_prefill_hold_its_kv(pulls: bool) -> None:
    """Its probe answer says it pulls (send_type GET on the decode instance): each prefill request asks for a
    pull (`send_type` GET in its params), whatever the prefill instance's own send_type. The control: one that
    does not say so gets pushes."""
    p_seen: list[dict[str, Any]] = []
    with serve(stub_prefill(p_seen)) as p, serve(stub_decode([], tp_size=1, pp_size=1, pulls=pulls)) as d, \
            serve(proxy_for(p, d)) as proxy:
        for _ in range(2):
            assert httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x", "max_tokens": 2}).is_success
    params = [s["body"]["kv_transfer_params"] for s in p_seen]
    assert [x.get("send_type") for x in params] == (["GET", "GET"] if pulls else [None, None])
    assert {x["decode_kv_address"] for x in params} == {"127.0.0.1:23456"}  # it pulls from there: named still


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
@pytest.mark.parametrize("relayed", [True, False])
def test_a_stream_whose_client_left_before_it_began_is_closed(spec: str, relayed: bool) -> None:
    """The client went away as its stream was about to begin: Starlette never reads the body (both ways it serves
    a stream, by ASGI spec version). A relay's cleanup (closing its upstream request, counting it out of its
    instance's requests in flight) would then never run; a RelayResponse runs it anyway. The control, a plain
    StreamingResponse, leaves it undone."""
    import asyncio
    import contextlib

    from fastapi.responses import StreamingResponse

    from p2pkv.proxy.upstream import RelayResponse

    cleaned: list[str] = []

    async def body() -> Any:
        try:
            yield b"data: x\n\n"
        finally:
            cleaned.append("by the body")

    async def close() -> None:
        cleaned.append("closed")

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        raise OSError("the client is gone")

    response = RelayResponse(body(), [close], {}) if relayed else StreamingResponse(body())
    with contextlib.suppress(Exception):
        asyncio.run(response({"type": "http", "asgi": {"spec_version": spec}}, receive, send))  # type: ignore[arg-type]
    assert cleaned == (["closed"] if relayed else [])


@pytest.mark.parametrize(("path", "body", "cap"), [
    # The Responses API caps an answer with max_output_tokens; the prefill's one-token answer is not stored.
    ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 20, "store": True},
     {"max_output_tokens": 1, "store": False, "background": False}),
    ("/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20},
     {"max_tokens": 1}),
])
def test_responses_and_anthropic_messages_are_prefilled_then_decoded(backends: Any, path: str, body: dict[str, Any],
                                                                     cap: dict[str, Any]) -> None:
    p, d, p_seen, d_seen = backends
    with serve(proxy_for(p, d)) as proxy:
        plain = httpx.post(f"http://{proxy}{path}", json=body)
        streamed = httpx.post(f"http://{proxy}{path}", json={**body, "stream": True})
    assert plain.status_code == 200 and streamed.status_code == 200
    assert [seen["path"] for seen in p_seen] == [path, path]
    sent = p_seen[0]["body"]
    assert {k: sent[k] for k in cap} == cap and sent["stream"] is False and p_seen[1]["body"]["stream"] is False
    assert ("max_tokens" in sent) == (path == "/v1/messages")  # not a Responses API field
    params = sent["kv_transfer_params"]
    assert params["do_remote_decode"] is True
    # The decode instance gets the client's request as it was, with the prefill's answer.
    assert {k: v for k, v in d_seen[0].items() if k != "kv_transfer_params"} == body
    assert d_seen[0]["kv_transfer_params"]["transfer_id"] == params["transfer_id"]
    assert d_seen[1]["stream"] is True and "c" in streamed.text


@pytest.mark.parametrize("extra", [{"previous_response_id": "resp_1"}, {"background": True}])
def test_responses_that_need_the_response_store_go_to_a_decode_instance_alone(backends: Any,
                                                                              extra: dict[str, Any]) -> None:
    p, d, p_seen, d_seen = backends
    with serve(proxy_for(p, d)) as proxy:
        resp = httpx.post(f"http://{proxy}/v1/responses", json={"model": "tiny", "input": "hi", **extra})
    assert resp.status_code == 200
    assert p_seen == [] and d_seen[0] == {"model": "tiny", "input": "hi", **extra}


def test_a_stored_response_is_fetched_and_continued_on_the_decode_instance_that_holds_it() -> None:
    first: list[dict[str, Any]] = []
    second: list[dict[str, Any]] = []
    with serve(stub_decode(first)) as d1, serve(stub_decode(second, stored=("resp_2",))) as d2:
        config = ProxyConfig(prefill=(Instance.parse(d1),), decode=(Instance.parse(d1), Instance.parse(d2)))
        with serve(create_app(config)) as proxy:
            found = httpx.get(f"http://{proxy}/v1/responses/resp_2")
            missing = httpx.get(f"http://{proxy}/v1/responses/resp_9")
            for _ in range(3):  # whichever instance has fewer requests in flight, the one holding it
                continued = httpx.post(f"http://{proxy}/v1/responses",
                                       json={"model": "tiny", "input": "more", "previous_response_id": "resp_2"})
                assert continued.status_code == 200
    assert found.status_code == 200 and found.json()["id"] == "resp_2"
    assert missing.status_code == 404
    assert first == [] and [b["previous_response_id"] for b in second] == ["resp_2"] * 3
