"""A decode instance with no staging space: pushes are refused and the KV is pulled instead (GET fallback);
then the prefill instance is killed while it holds KV for a pull. The prefill instance itself, asked without
p2pkv params, is the colocated reference."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from p2pkv.bench.cluster import Cluster, InstanceSpec, free_ports
from p2pkv.params import DecodeParams, PrefillParams, parse_transfer_params
from p2pkv.proxy import Instance, ProxyConfig, create_app
from p2pkv.proxy.trace import PREFILL_HEADER
from tests.helpers.relay import FlipRelay
from tests.helpers.servers import serve
from tests.integration.conftest import EAGER, MAX_TOKENS, complete, greedy, ids_and_logprobs, metric, prompt

pytestmark = pytest.mark.vllm
TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def tight(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """1P1D started directly (not through `p2pkv up`, which would stop the rest when the prefill dies)."""
    work = tmp_path_factory.mktemp("tight")
    cluster = Cluster(model=tiny_model, log_dir=work)
    # Pulls carry their digest, checked where they land (integrity_check).
    extra = {"kv_buffer_size": 1, "mem_pool_size_gb": 0, "transfer_timeout_s": TIMEOUT_S, "integrity_check": True}
    p_http, p_kv, p_metrics, d_http, d_kv, d_metrics, proxy, f_http, f_kv = free_ports(9)
    cluster.add_vllm("prefill", InstanceSpec("kv_producer", p_http, p_kv, {**extra, "metrics_port": p_metrics},
                                                  vllm_args=EAGER))
    cluster.add_vllm("decode", InstanceSpec("kv_consumer", d_http, d_kv, {**extra, "metrics_port": d_metrics},
                                                 vllm_args=EAGER))
    # A second decode instance that fails requests whose KV cannot be loaded (kv_load_failure_policy=fail). It
    # takes pushes (the default staging space), over tcp, so that a relay in front of its KV port can damage one.
    fail_extra = {**extra, "kv_buffer_size": 1e9, "transport": "tcp"}
    cluster.add_vllm("decode-fail", InstanceSpec("kv_consumer", f_http, f_kv, fail_extra, failure_policy="fail",
                                                     vllm_args=EAGER))
    cluster.add_proxy(proxy, [f"127.0.0.1:{p_http}"], [f"127.0.0.1:{d_http}"])
    try:
        cluster.start(timeout_s=900)
        yield {"model": tiny_model, "proxy": f"http://127.0.0.1:{proxy}", "cluster": cluster, "instances": [
            {"role": "kv_producer", "http": f"127.0.0.1:{p_http}", "metrics": f"127.0.0.1:{p_metrics}"},
            {"role": "kv_consumer", "http": f"127.0.0.1:{d_http}", "metrics": f"127.0.0.1:{d_metrics}"},
            {"role": "kv_consumer_fail", "http": f"127.0.0.1:{f_http}", "kv": f"127.0.0.1:{f_kv}"}],
               "log_dir": work}
    finally:
        cluster.stop()


def role(info: dict[str, Any], name: str) -> dict[str, str]:
    found: dict[str, str] = next(i for i in info["instances"] if i["role"] == name)
    return found


def test_refused_push_falls_back_to_get_and_the_request_succeeds(tight: dict[str, Any]) -> None:
    prefill, decode = role(tight, "kv_producer"), role(tight, "kv_consumer")
    pulls_before = metric(decode["metrics"], 'p2pkv_transfers_total{direction="pull",outcome="ok"}')
    checked_before = metric(decode["metrics"], 'p2pkv_digests_total{direction="pull",outcome="ok"}')
    for i, length in enumerate((90, 300)):
        text = prompt(f"tight{i}", length)
        answer = greedy(tight["proxy"], tight["model"], text)
        reference = greedy(f"http://{prefill['http']}", tight["model"], text)
        assert ids_and_logprobs(answer)[0] == ids_and_logprobs(reference)[0]
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == length - 1
    assert metric(decode["metrics"], 'p2pkv_transfers_total{direction="pull",outcome="ok"}') - pulls_before == 2
    assert metric(decode["metrics"], 'p2pkv_digests_total{direction="pull",outcome="ok"}') - checked_before == 2
    assert metric(prefill["metrics"], 'p2pkv_transfers_total{direction="send",outcome="refused"}') >= 2
    assert metric(decode["metrics"], "p2pkv_staging_bytes") == 0


def _rerouted(tight: dict[str, Any], path: str, body: dict[str, Any]) -> tuple[httpx.Response, str, str]:
    """`body` sent to `path` through a proxy in front of decode-fail whose first push is damaged on the way: the
    answer (read whole), the proxy's metrics, and the port of the one prefill server."""
    prefill, failing = role(tight, "kv_producer"), role(tight, "kv_consumer_fail")
    port = prefill["http"].rsplit(":", 1)[1]
    relay = FlipRelay(failing["kv"], at=100_000, upstream=True)  # inside the first layer's payload
    config = ProxyConfig(prefill=(Instance.parse(prefill["http"]), Instance.parse(f"localhost:{port}")),
                         decode=(Instance.parse(f"{failing['http']}@{relay.address}"),))
    try:
        with serve(create_app(config)) as proxy:
            resp = httpx.post(f"http://{proxy}{path}", json=body, timeout=120)
            metrics = httpx.get(f"http://{proxy}/metrics").text
    finally:
        relay.close()
    assert relay.flipped.is_set()
    return resp, metrics, port


def test_kv_lost_under_policy_fail_goes_again_through_the_proxy_as_a_new_transfer(tight: dict[str, Any]) -> None:
    """decode-fail ends a request whose KV it could not load with an error (kv_load_failure_policy=fail); the proxy
    then sends the request again as a new transfer. A relay in front of decode-fail's KV port flips one byte of the
    first push: the digest check drops that transfer and vLLM fails the request. The proxy (in this process, real
    HTTP) has the one prefill server listed under two addresses, so it sees a second prefill instance to try; the
    second transfer lands and the answer equals the colocated one. Then the same for a streamed chat request, whose
    stream vLLM opens with the role before its error event."""
    prefill = role(tight, "kv_producer")
    text = prompt("rerouted", 300)
    body = {"model": tight["model"], "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
            "return_token_ids": True, "ignore_eos": True}
    resp, metrics, port = _rerouted(tight, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    assert "p2pkv_proxy_reroutes_total 1.0" in metrics
    assert resp.headers[PREFILL_HEADER] == f"localhost:{port}"  # the second attempt's prefill instance
    reference = greedy(f"http://{prefill['http']}", tight["model"], text)
    assert ids_and_logprobs(resp.json())[0] == ids_and_logprobs(reference)[0]
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 299  # the second transfer loaded

    chat = {"model": tight["model"], "messages": [{"role": "user", "content": prompt("rerouted-chat", 250)}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    resp, metrics, port = _rerouted(tight, "/v1/chat/completions", {**chat, "stream": True})
    assert resp.status_code == 200, resp.text
    assert "p2pkv_proxy_reroutes_total 1.0" in metrics and resp.headers[PREFILL_HEADER] == f"localhost:{port}"
    assert '"error"' not in resp.text and resp.text.rstrip().endswith("data: [DONE]")
    events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
    streamed = "".join((e["choices"][0].get("delta") or {}).get("content") or "" for e in events if e["choices"])
    reference_chat = complete(f"http://{prefill['http']}", chat, "/v1/chat/completions")
    assert streamed == reference_chat["choices"][0]["message"]["content"]
    log = (tight["log_dir"] / "decode-fail.log").read_text(errors="replace")
    assert log.count("do not match the sender's digest") >= 2


def test_streams_of_the_responses_and_messages_apis_go_again_too(tight: dict[str, Any]) -> None:
    """As above, for streams of the Responses and Anthropic Messages APIs. vLLM opens them with events that name
    no token (`response.created`, `message_start`); on the lost KV its Messages stream goes on with an error
    event and its Responses stream breaks off. The proxy reads on past those opening events, so it still sees the
    failure before anything went to the client, and the request goes again as a new transfer."""
    prefill = role(tight, "kv_producer")
    text = prompt("rerouted-apis", 250)
    for path, body, closing, answer_of in [
        ("/v1/responses", {"input": text, "max_output_tokens": MAX_TOKENS}, "response.completed",
         lambda a: a["output"][0]["content"][0]["text"]),
        ("/v1/messages", {"messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS}, "message_stop",
         lambda a: a["content"][0]["text"]),
    ]:
        body = {"model": tight["model"], "temperature": 0, **body}
        resp, metrics, port = _rerouted(tight, path, {**body, "stream": True})
        assert resp.status_code == 200, resp.text
        assert "p2pkv_proxy_reroutes_total 1.0" in metrics and resp.headers[PREFILL_HEADER] == f"localhost:{port}"
        assert '"error"' not in resp.text and closing in resp.text
        deltas = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
        streamed = "".join(e.get("delta", "") if path == "/v1/responses" else (e.get("delta") or {}).get("text", "")
                           for e in deltas if e.get("type") in ("response.output_text.delta", "content_block_delta"))
        assert streamed == answer_of(complete(f"http://{prefill['http']}", body, path)), path


def test_prefill_killed_while_holding_kv_decode_recomputes_within_the_deadline(tight: dict[str, Any]) -> None:
    prefill, decode = role(tight, "kv_producer"), role(tight, "kv_consumer")
    text = prompt("killed", 300)
    reference = ids_and_logprobs(greedy(f"http://{prefill['http']}", tight["model"], text))[0]
    params = PrefillParams("killed-transfer", None, pull=True)
    body = {"model": tight["model"], "prompt": text, "max_tokens": 1, "kv_transfer_params": params.to_dict()}
    returned = parse_transfer_params(complete(f"http://{prefill['http']}", body)["kv_transfer_params"])
    assert isinstance(returned, DecodeParams) and returned.pull
    tight["cluster"].processes[0].kill()  # SIGKILL to the prefill server and its engine and worker

    started = time.monotonic()
    body = {"model": tight["model"], "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
            "return_token_ids": True, "ignore_eos": True, "kv_transfer_params": returned.to_dict()}
    answer = complete(f"http://{decode['http']}", body)
    assert time.monotonic() - started < TIMEOUT_S + 30
    assert ids_and_logprobs(answer)[0] == reference
    assert metric(decode["metrics"], 'p2pkv_transfers_total{direction="load",outcome="failed"}') >= 1

    # With kv_load_failure_policy=fail the same lost KV ends the request with an error, within the deadline.
    failing = role(tight, "kv_consumer_fail")
    started = time.monotonic()
    resp = httpx.post(f"http://{failing['http']}/v1/completions", json=body, timeout=120)
    assert time.monotonic() - started < TIMEOUT_S + 30
    assert resp.status_code >= 500, resp.text
    assert "error" in resp.json()
