"""vLLM's standard disaggregation protocol, as a router that does not know p2pkv drives the instances: the prefill
instance takes `do_remote_decode` without p2pkv's marker as a transfer held for a pull and answers with what the
decode instance needs (p2pkv's fields and the standard ones); the decode instance loads from that answer, passed on
verbatim. Another connector's params, or none, load nothing: counted by reason, said once per peer."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

pytest.importorskip("vllm", reason="the scheduler side imports vLLM's connector base class")

from p2pkv.bench.router import STANDARD_PREFILL_PARAMS, decode_body, prefill_body
from p2pkv.config import parse_connector_config
from p2pkv.params import Address, DecodeParams, foreign_params, parse_transfer_params, standard_transfer_id
from p2pkv.vllm.scheduler import SchedulerSide
from tests.helpers.router import router
from tests.helpers.servers import serve
from tests.helpers.unit import BS, Blocks, Req, step

NIXL_ANSWER = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2, 3],
               "remote_engine_id": "e-1", "remote_request_id": "r-1", "remote_host": "10.0.0.1", "remote_port": 5600,
               "tp_size": 1}


def side(role: str, **extra: Any) -> SchedulerSide:
    config = parse_connector_config(role, 21001, "recompute", {"kv_host": "127.0.0.1", **extra}, start="engine-7")
    return SchedulerSide(config, BS, engine_id="engine-7")


def saved(s: SchedulerSide, req: Req, blocks: list[int]) -> None:
    s.update_state_after_alloc(req, Blocks(blocks), 0)
    new = SimpleNamespace(req_id=req.request_id, block_ids=(blocks,), num_computed_tokens=0)
    s.build_connector_meta(step([new], scheduled={req.request_id: len(req.prompt_token_ids)}))


def test_a_standard_prefill_request_is_held_for_a_pull_and_answered_with_both_kinds_of_fields() -> None:
    prefill = side("kv_producer", send_type="PUT_ASYNC")
    req = Req("cmpl-4f0c-0-9a1b2c3d", list(range(300)), dict(STANDARD_PREFILL_PARAMS))
    assert prefill.get_num_new_matched_tokens(req, 0) == (0, False)
    prefill.update_state_after_alloc(req, Blocks([1, 2, 3]), 0)
    new = SimpleNamespace(req_id=req.request_id, block_ids=([1, 2, 3],), num_computed_tokens=0)
    (save,) = prefill.build_connector_meta(step([new], scheduled={req.request_id: 300})).saves
    assert save.peer is None and save.block_ids == (1, 2, 3)  # held: the router names no decode instance
    delay, answer = prefill.request_finished(req, [1, 2, 3])
    assert delay is True and answer is not None
    assert answer["remote_host"] == "127.0.0.1" and answer["remote_port"] == 21001
    assert answer["remote_engine_id"] == "engine-7" and answer["do_remote_decode"] is False
    assert "do_remote_prefill" not in answer  # vLLM would report the prefill side's cache hits as the decode's
    params = parse_transfer_params(json.loads(json.dumps(answer)))  # as a router passes it on
    assert isinstance(params, DecodeParams) and params.pull and params.prefill_kv == Address("127.0.0.1", 21001)
    assert params.transfer_id == standard_transfer_id(prefill._config.launch, req.request_id)
    assert params.num_prompt_tokens == 300 and params.lease_s == 30.0
    decode = side("kv_consumer")
    load = Req("cmpl-4f0c-0-77aa", list(range(300)), answer)
    decode.on_new_request(load)
    assert decode.get_num_new_matched_tokens(load, 0) == (299, True)
    decode.update_state_after_alloc(load, Blocks([7, 8, 9]), 299)
    meta = decode.build_connector_meta(step())
    (spec,) = meta.loads
    assert spec.pull_from == Address("127.0.0.1", 21001) and spec.block_ids == (7, 8, 9)
    assert meta.computed_here == []


def test_transfer_ids_of_standard_requests_are_stable_valid_and_apart_per_instance() -> None:
    one = standard_transfer_id("0123456789abcdef", "chatcmpl-x y/z-0-1a2b")
    assert one == standard_transfer_id("0123456789abcdef", "chatcmpl-x y/z-0-1a2b")
    assert one != standard_transfer_id("fedcba9876543210", "chatcmpl-x y/z-0-1a2b")
    long = standard_transfer_id("0123456789abcdef", "r" * 300)
    for tid in (one, long):
        assert parse_transfer_params({"p2pkv": 1, "transfer_id": tid, "do_remote_decode": True}) is not None


@pytest.mark.parametrize(("raw", "producer", "expected"), [
    (None, False, ("none", "")),
    ({}, False, ("none", "")),
    (NIXL_ANSWER, False, ("foreign", "10.0.0.1:5600")),
    ({"remote_engine_id": "e-2", "do_remote_prefill": True}, False, ("foreign", "e-2")),
    (dict(STANDARD_PREFILL_PARAMS), False, ("prefill", "")),
    (None, True, None),
    (dict(STANDARD_PREFILL_PARAMS), True, None),
    (NIXL_ANSWER, True, ("foreign", "10.0.0.1:5600")),
    (DecodeParams("t1", 10, None).to_dict(), False, None),
])
def test_why_a_request_loads_nothing(raw: Any, producer: bool, expected: tuple[str, str] | None) -> None:
    assert foreign_params(raw, producer) == expected


def test_other_connectors_params_are_computed_here_counted_and_said_once_per_peer(
        caplog: pytest.LogCaptureFixture) -> None:
    decode = side("kv_consumer")
    requests = [Req(f"r{i}", list(range(300)), params) for i, params in enumerate(
        [NIXL_ANSWER, NIXL_ANSWER, {**NIXL_ANSWER, "remote_host": "10.0.0.2"}, None, None,
         dict(STANDARD_PREFILL_PARAMS)])]
    with caplog.at_level(logging.WARNING, logger="p2pkv.vllm.scheduler"):
        for req in requests:
            decode.on_new_request(req)
            assert decode.get_num_new_matched_tokens(req, 0) == (0, False)
    assert decode.build_connector_meta(step()).computed_here == ["foreign"] * 3 + ["none"] * 2 + ["prefill"]
    assert decode.build_connector_meta(step()).computed_here == []
    said = [r.getMessage() for r in caplog.records]
    assert sum("another connector" in m and "10.0.0.1:5600" in m for m in said) == 1
    assert sum("another connector" in m and "10.0.0.2:5600" in m for m in said) == 1
    assert sum("without kv_transfer_params" in m for m in said) == 1
    assert sum("sent to a decode instance" in m for m in said) == 1


def test_the_router_sends_the_standard_bodies() -> None:
    client = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "stream": True,
              "stream_options": {"include_usage": True}, "temperature": 0}
    first = prefill_body(client)
    assert first == {"model": "m", "messages": client["messages"], "max_tokens": 1, "max_completion_tokens": 1,
                     "stream": False, "temperature": 0, "kv_transfer_params": STANDARD_PREFILL_PARAMS}
    answer = {"choices": [], "kv_transfer_params": {"p2pkv": 1, "anything": [1, 2]}}
    assert decode_body(client, answer) == {**client, "kv_transfer_params": {"p2pkv": 1, "anything": [1, 2]}}
    assert "kv_transfer_params" not in decode_body({**client, "kv_transfer_params": {"x": 1}}, {"choices": []})


def test_the_router_drives_instances_round_robin_and_relays_streams() -> None:
    seen: list[tuple[str, str, dict[str, Any]]] = []

    def backend(name: str) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            body = await request.json()
            seen.append((name, request.headers["x-request-id"], body))
            if name.startswith("prefill"):
                return JSONResponse({"choices": [{"text": "x"}], "kv_transfer_params": {"from": name}})
            if body.get("stream"):
                async def events() -> AsyncIterator[bytes]:
                    for word in ("a", "b"):
                        yield f"data: {json.dumps({'choices': [{'text': word}]})}\n\n".encode()
                    yield b"data: [DONE]\n\n"
                return StreamingResponse(events(), media_type="text/event-stream")
            return JSONResponse({"choices": [{"text": f"from {name}"}]})

        return app

    with serve(backend("prefill0")) as p0, serve(backend("prefill1")) as p1, serve(backend("decode0")) as d0:
        with router([f"http://{p0}", f"http://{p1}"], [f"http://{d0}"]) as base:
            plain = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 8},
                               headers={"X-Request-Id": "req-1"}, timeout=30)
            streamed = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 8,
                                                                  "stream": True}, timeout=30)
    assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == "from decode0"
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.count("data: ") == 3 and streamed.text.endswith("data: [DONE]\n\n")
    assert [(name, body.get("kv_transfer_params")) for name, _, body in seen] == [
        ("prefill0", STANDARD_PREFILL_PARAMS), ("decode0", {"from": "prefill0"}),
        ("prefill1", STANDARD_PREFILL_PARAMS), ("decode0", {"from": "prefill1"})]
    assert seen[0][1] == seen[1][1] == "req-1" and seen[2][1] == seen[3][1] != "req-1"
    assert seen[0][2]["max_tokens"] == 1 and seen[1][2]["max_tokens"] == 8 and seen[3][2]["stream"] is True
