"""The proxy's routing logic against stub OpenAI backends that are real HTTP servers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from p2pkv.errors import ConfigError
from p2pkv.proxy import Instance, ProxyConfig, create_app
from tests.helpers.servers import serve


def stub_prefill(seen: list[dict[str, Any]], fail: bool = False) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> JSONResponse:
        body = await request.json()
        seen.append({"body": body, "auth": request.headers.get("authorization")})
        if fail:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        tid = body["kv_transfer_params"]["transfer_id"]
        params = {"p2pkv": 1, "transfer_id": tid, "load_remote_kv": True, "num_prompt_tokens": 5}
        return JSONResponse({"choices": [{"text": "x"}], "kv_transfer_params": params})

    return app


def stub_decode(seen: list[dict[str, Any]]) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"data": [{"id": "tiny"}]}

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> Any:
        body = await request.json()
        params = body.get("kv_transfer_params") or {}
        if params.get("probe"):
            return {"choices": [{"text": ""}], "kv_transfer_params": {"p2pkv": 1, "kv_port": 23456, "kv_host": ""}}
        seen.append(body)
        if body.get("stream"):
            async def events() -> AsyncIterator[bytes]:
                for word in ("a", "b", "c"):
                    yield f"data: {json.dumps({'choices': [{'text': word}]})}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return {"choices": [{"text": "abc"}], "usage": {"prompt_tokens": 5}}

    return app


@pytest.fixture
def backends() -> Iterator[tuple[str, str, list[dict[str, Any]], list[dict[str, Any]]]]:
    p_seen: list[dict[str, Any]] = []
    d_seen: list[dict[str, Any]] = []
    with serve(stub_prefill(p_seen)) as p, serve(stub_decode(d_seen)) as d:
        yield p, d, p_seen, d_seen


def proxy_for(prefill: str, decode: str) -> FastAPI:
    return create_app(ProxyConfig(prefill=(Instance.parse(prefill),), decode=(Instance.parse(decode),)))


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
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]) == "abc"


def test_prefill_error_is_returned_not_sent_to_decode() -> None:
    p_seen: list[dict[str, Any]] = []
    d_seen: list[dict[str, Any]] = []
    with serve(stub_prefill(p_seen, fail=True)) as p, serve(stub_decode(d_seen)) as d, serve(proxy_for(p, d)) as px:
        resp = httpx.post(f"http://{px}/v1/completions", json={"prompt": "x"})
    assert resp.status_code == 500
    assert d_seen == []


def test_unreachable_prefill_gives_openai_error_json(backends: Any) -> None:
    _, d, _, d_seen = backends
    with serve(proxy_for("127.0.0.1:1", d)) as proxy:
        resp = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x"})
    assert resp.status_code == 502
    assert "prefill instance 127.0.0.1:1 failed" in resp.json()["error"]["message"]
    assert d_seen == []


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
