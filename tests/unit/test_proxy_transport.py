"""A fault of the socket layer while a connection to an instance is set up (an instance killed under load: anyio
asked a closed socket for its peer name) counts as that instance failing, not as an error of the proxy. Stub
backends, real HTTP."""

from __future__ import annotations

from typing import Any

import httpcore
import httpx
import pytest

from tests.helpers.servers import serve
from tests.unit.test_proxy import proxy_for


def test_a_socket_fault_while_connecting_to_a_prefill_instance_is_that_instance_failing(
        backends: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    p, d, p_seen, d_seen = backends
    port = int(p.rsplit(":", 1)[1])
    real = httpcore.AsyncConnectionPool.handle_async_request

    async def dies_while_connecting(pool: httpcore.AsyncConnectionPool, request: httpcore.Request) -> Any:
        if request.url.port == port:  # as anyio failed in the 2P2D test once the prefill instance was killed
            raise AttributeError("'NoneType' object has no attribute 'getpeername'")
        return await real(pool, request)

    monkeypatch.setattr(httpcore.AsyncConnectionPool, "handle_async_request", dies_while_connecting)
    with serve(proxy_for(p, d)) as proxy:
        resp = httpx.post(f"http://{proxy}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30)
        metrics = httpx.get(f"http://{proxy}/metrics").text
    assert resp.status_code == 200, resp.text
    assert not p_seen and len(d_seen) == 1 and "kv_transfer_params" not in d_seen[0]
    assert "p2pkv_proxy_decode_only_fallbacks_total 1.0" in metrics
