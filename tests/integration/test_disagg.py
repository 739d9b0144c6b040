"""1P1D through the proxy on real vLLM (CPU, tiny model, float32) against one colocated instance."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from p2pkv.params import Address, DecodeParams, DiscardParams, PrefillParams, parse_transfer_params
from p2pkv.proxy import Instance, ProxyConfig, create_app
from p2pkv.proxy.trace import DECODE_HEADER, PREFILL_HEADER, TRANSFER_HEADER
from p2pkv.tinymodel import TinyModelSpec, write_tiny_model
from tests.helpers.router import router
from tests.helpers.servers import serve
from tests.helpers.stubs import failing_relay
from tests.integration.conftest import (
    BLOCK_SIZE,
    LAYERS,
    LOAD_FAILED,
    MAX_TOKENS,
    TRANSFER_TIMEOUT_S,
    UpCluster,
    complete,
    cut_stream,
    greedy,
    ids_and_logprobs,
    kv_bytes_per_block_and_layer,
    metric,
    prompt,
    two_steps,
    vllm_series,
)

pytestmark = pytest.mark.vllm
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


LENGTHS = [1, 7, 60, 127, 128, 129, 250, 385, 700]  # 1: nothing to load (the one token is computed here)


SHM = '{transport="shm"}'  # both instances are on this host: transport auto picks shm


def test_disaggregated_equals_colocated_and_kv_was_transferred(up_cluster: UpCluster) -> None:
    decode = up_cluster.instance("kv_consumer")
    proxy = up_cluster.proxy.removeprefix("http://")
    alongside = 'p2pkv_proxy_decode_alongside_total{outcome="answered"}'
    alongside_before = metric(proxy, alongside)
    received_before = metric(decode["metrics"], "p2pkv_bytes_received_total" + SHM)
    loaded_before = metric(decode["metrics"], "p2pkv_bytes_loaded_total")
    per_block = kv_bytes_per_block_and_layer() * LAYERS
    expected_received = expected_loaded = 0
    for i, length in enumerate(LENGTHS):
        text = prompt(f"eq{i}", length)
        disagg = greedy(up_cluster.proxy, up_cluster.model, text)
        local = greedy(up_cluster.colocated, up_cluster.model, text)
        assert disagg["usage"]["prompt_tokens"] == length
        d_ids, d_lp = ids_and_logprobs(disagg)
        c_ids, c_lp = ids_and_logprobs(local)
        assert len(d_ids) == MAX_TOKENS
        assert d_ids == c_ids, f"prompt of {length} tokens: token ids differ"
        assert max(abs(a - b) for a, b in zip(d_lp, c_lp, strict=True)) < 1e-4
        # All prompt tokens but the last came from the transfer, none were recomputed on the decode side.
        assert disagg["usage"]["prompt_tokens_details"]["cached_tokens"] == length - 1
        expected_received += math.ceil(length / BLOCK_SIZE) * per_block if length > 1 else 0
        expected_loaded += math.ceil((length - 1) / BLOCK_SIZE) * per_block
    # A prompt of one token loads nothing: its decode request, sent alongside, discards its push, which is staged
    # and freed if it came first, or dropped as it comes (not counted as received) if the discard did.
    received = metric(decode["metrics"], "p2pkv_bytes_received_total" + SHM) - received_before
    assert received - expected_received in (0, per_block)
    assert metric(decode["metrics"], "p2pkv_bytes_loaded_total") - loaded_before == expected_loaded
    assert metric(decode["metrics"], "p2pkv_staging_bytes") == 0
    # Each decode request went while its prefill ran (the proxy's default), and loaded the KV pushed to it.
    assert metric(proxy, alongside) - alongside_before == len(LENGTHS)


def test_a_decode_request_sent_alongside_takes_no_kv_of_another_prompt(up_cluster: UpCluster) -> None:
    """A decode request sent before its prefill answered knows only its own prompt: a push under its transfer id of
    another prompt of the same length (two instances that tokenize a request differently) must not land, and the
    decode instance computes its prompt itself, answering as the colocated instance does."""
    prefill, decode = up_cluster.instance("kv_producer"), up_cluster.instance("kv_consumer")
    own, other = prompt("own-prompt", 300), prompt("another-prompt", 300)
    failed_before = metric(decode["metrics"], LOAD_FAILED)
    tid = uuid.uuid4().hex
    along = DecodeParams(tid, 0, Address.parse(prefill["kv"]), alongside_s=60.0)
    body = {"model": up_cluster.model, "prompt": own, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
            "return_token_ids": True, "ignore_eos": True, "kv_transfer_params": along.to_dict()}
    answers: list[dict[str, Any]] = []
    waiting = threading.Thread(target=lambda: answers.append(complete(f"http://{decode['http']}", body)))
    waiting.start()
    time.sleep(0.5)  # the decode request waits for its push
    pushed = PrefillParams(tid, Address.parse(decode["kv"]))
    complete(f"http://{prefill['http']}", {"model": up_cluster.model, "prompt": other, "max_tokens": 1,
                                           "kv_transfer_params": pushed.to_dict()})
    waiting.join(60)
    (answer,) = answers
    assert ids_and_logprobs(answer)[0] == ids_and_logprobs(greedy(up_cluster.colocated, up_cluster.model, own))[0]
    assert answer["usage"]["prompt_tokens_details"] is None or not answer["usage"]["prompt_tokens_details"].get(
        "cached_tokens")
    assert metric(decode["metrics"], LOAD_FAILED) == failed_before + 1
    assert _until(lambda: metric(decode["metrics"], "p2pkv_staging_bytes") == 0, 5)


def _by_hand(cluster: UpCluster, text: str, corrupt: bool) -> dict[str, Any]:
    return two_steps(cluster, text, corrupt=corrupt)[1]


def test_negative_control_corrupted_kv_changes_the_output(up_cluster: UpCluster) -> None:
    clean_text, bad_text = prompt("clean", 300), prompt("corrupt", 300)
    clean = _by_hand(up_cluster, clean_text, corrupt=False)
    assert ids_and_logprobs(clean)[0] == ids_and_logprobs(greedy(up_cluster.colocated, up_cluster.model,
                                                                 clean_text))[0]
    bad = _by_hand(up_cluster, bad_text, corrupt=True)
    reference = greedy(up_cluster.colocated, up_cluster.model, bad_text)
    assert bad["usage"]["prompt_tokens_details"]["cached_tokens"] == 299
    b_ids, b_lp = ids_and_logprobs(bad)
    r_ids, r_lp = ids_and_logprobs(reference)
    assert b_ids != r_ids or max(abs(a - b) for a, b in zip(b_lp, r_lp, strict=True)) > 1e-3


def _stream_text(url: str, body: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    import json

    text, usage = [], None
    with httpx.stream("POST", url, json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(text), usage


def test_a_request_is_traced_from_its_answer_into_every_log(up_cluster: UpCluster) -> None:
    """The proxy's answer names the transfer; the proxy, the prefill and the decode instance each log it."""
    body = {"model": up_cluster.model, "prompt": prompt("traced", 200), "max_tokens": 4, "temperature": 0}
    resp = httpx.post(f"{up_cluster.proxy}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    tid = resp.headers[TRANSFER_HEADER]
    prefill, decode = up_cluster.instance("kv_producer"), up_cluster.instance("kv_consumer")
    assert (resp.headers[PREFILL_HEADER], resp.headers[DECODE_HEADER]) == (prefill["http"], decode["http"])
    logs = Path(up_cluster.info["log_dir"])
    wanted = {logs / "proxy.log": f"request transfer={tid} ",
              logs / f"{prefill['name']}.log": f"transfer {tid} send ok",
              logs / f"{decode['name']}.log": f"transfer {tid} landed"}
    deadline = time.monotonic() + 10  # log lines may trail the answer by a moment
    while (missing := [str(path) for path, line in wanted.items() if line not in path.read_text(errors="replace")]):
        assert time.monotonic() < deadline, f"transfer {tid} is not in {missing}"
        time.sleep(0.2)


P2P_HITS = "vllm:prompt_tokens_cached_by_source_total"


def test_transfers_show_in_vllms_own_metrics_and_log(up_cluster: UpCluster) -> None:
    """Each instance reports p2pkv's transfers to vLLM: on its own /metrics (`vllm:p2pkv_*`, the same bytes as
    p2pkv's metrics port) and in vLLM's periodic "KV Transfer metrics" log line."""
    prefill, decode = up_cluster.instance("kv_producer"), up_cluster.instance("kv_consumer")
    loads = ("vllm:p2pkv_transfers_total", {"direction": "load", "outcome": "ok"})
    sends = ("vllm:p2pkv_transfers_total", {"direction": "send", "outcome": "ok"})
    loaded = ("vllm:p2pkv_bytes_total", {"kind": "loaded"})
    before = {"loads": vllm_series(decode["http"], loads[0], **loads[1]),
              "sends": vllm_series(prefill["http"], sends[0], **sends[1]),
              "loaded": vllm_series(decode["http"], loaded[0], **loaded[1]),
              "own_loaded": metric(decode["metrics"], "p2pkv_bytes_loaded_total"),
              "timed": vllm_series(prefill["http"], "vllm:p2pkv_transfer_seconds_count", direction="send"),
              "p2p": vllm_series(decode["http"], P2P_HITS, source="p2p")}
    n = 4
    for i in range(n):
        greedy(up_cluster.proxy, up_cluster.model, prompt(f"vllm-metrics{i}", 300))
    own_loaded = metric(decode["metrics"], "p2pkv_bytes_loaded_total") - before["own_loaded"]
    assert own_loaded > 0
    # vLLM's front end gets the counts with the engine's step outputs: moments after the answers.
    deadline = time.monotonic() + 10
    while True:
        got = {"loads": vllm_series(decode["http"], loads[0], **loads[1]) - before["loads"],
               "sends": vllm_series(prefill["http"], sends[0], **sends[1]) - before["sends"],
               "loaded": vllm_series(decode["http"], loaded[0], **loaded[1]) - before["loaded"],
               "timed": vllm_series(prefill["http"], "vllm:p2pkv_transfer_seconds_count", direction="send")
               - before["timed"]}
        if got == {"loads": n, "sends": n, "loaded": own_loaded, "timed": n} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got == {"loads": n, "sends": n, "loaded": own_loaded, "timed": n}
    # vLLM counts the prompt tokens loaded as served from another instance: every one but the last of each prompt.
    assert vllm_series(decode["http"], P2P_HITS, source="p2p") - before["p2p"] == n * 299
    logs = Path(up_cluster.info["log_dir"])
    deadline = time.monotonic() + 15  # vLLM logs its stats every 10 s
    # A line names its outcomes in order (`loads failed=1, loads ok=15`, after another test's failed load).
    while not (re.search(r"KV Transfer metrics: .*loads ok=",
                         (logs / f"{decode['name']}.log").read_text(errors="replace"))
               and re.search(r"KV Transfer metrics: .*sends ok=",
                             (logs / f"{prefill['name']}.log").read_text(errors="replace"))):
        assert time.monotonic() < deadline, "no KV Transfer metrics line in the instances' logs"
        time.sleep(0.5)


def test_chat_and_streaming_give_the_same_text(up_cluster: UpCluster) -> None:
    model, proxy = up_cluster.model, up_cluster.proxy
    user = prompt("chat", 200)
    base = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    rendered = f"<|user|>{user}\n<|assistant|>"
    plain = complete(proxy, {**base, "prompt": rendered})["choices"][0]["text"]
    colocated = complete(up_cluster.colocated, {**base, "prompt": rendered})["choices"][0]["text"]
    assert plain == colocated
    streamed, usage = _stream_text(f"{proxy}/v1/completions", {**base, "prompt": rendered, "stream": True,
                                                                "stream_options": {"include_usage": True}})
    assert streamed == plain
    assert usage is not None and usage["completion_tokens"] == MAX_TOKENS
    messages = [{"role": "user", "content": user}]
    chat = complete(proxy, {**base, "messages": messages}, "/v1/chat/completions")
    assert chat["choices"][0]["message"]["content"] == plain
    chat_streamed, _ = _stream_text(f"{proxy}/v1/chat/completions", {**base, "messages": messages, "stream": True})
    assert chat_streamed == plain


LOADED_OK = 'p2pkv_transfers_total{direction="load",outcome="ok"}'
NIXL_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [0, 1],
               "remote_engine_id": "nixl-engine", "remote_request_id": "r-1", "remote_host": "10.9.9.9",
               "remote_port": 5600, "tp_size": 1}


def test_a_router_of_vllms_standard_protocol_moves_the_kv(up_cluster: UpCluster) -> None:
    """Behind a router that knows nothing of p2pkv (`p2pkv.bench.router`: max_tokens 1, `do_remote_decode`, the
    answer's params passed on verbatim): completions, chat and streams answer as colocated, and every prompt is
    loaded on the decode side (cached tokens, the load counter), pulled from the prefill instance."""
    prefill, decode = up_cluster.instance("kv_producer"), up_cluster.instance("kv_consumer")
    model = up_cluster.model
    pulled = 'p2pkv_transfers_total{direction="pull",outcome="ok"}'
    loads, pulls = metric(decode["metrics"], LOADED_OK), metric(decode["metrics"], pulled)
    with router([f"http://{prefill['http']}"], [f"http://{decode['http']}"]) as base:
        for i, length in enumerate([60, 129, 400]):
            text = prompt(f"standard{i}", length)
            through, alone = greedy(base, model, text), greedy(up_cluster.colocated, model, text)
            (ids, logprobs), (ref_ids, ref_logprobs) = ids_and_logprobs(through), ids_and_logprobs(alone)
            assert ids == ref_ids, f"prompt of {length} tokens: token ids differ"
            assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)) < 1e-4
            assert through["usage"]["prompt_tokens_details"]["cached_tokens"] == length - 1
        user = prompt("standard-chat", 200)
        body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": user}]}
        chat = complete(base, body, "/v1/chat/completions")
        expected = complete(up_cluster.colocated, body, "/v1/chat/completions")["choices"][0]["message"]["content"]
        assert chat["choices"][0]["message"]["content"] == expected
        assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] == chat["usage"]["prompt_tokens"] - 1
        streamed, usage = _stream_text(f"{base}/v1/chat/completions", {
            **body, "messages": [{"role": "user", "content": prompt("standard-stream", 150)}], "stream": True,
            "stream_options": {"include_usage": True}})
        colocated = complete(up_cluster.colocated, {**body, "messages": [
            {"role": "user", "content": prompt("standard-stream", 150)}]}, "/v1/chat/completions")
        assert streamed == colocated["choices"][0]["message"]["content"]
        assert usage is not None and usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert metric(decode["metrics"], LOADED_OK) == loads + 5
    assert metric(decode["metrics"], pulled) == pulls + 5  # the router named no decode instance: held, pulled


def test_another_connectors_params_or_none_are_computed_on_the_decode_instance_and_counted(
        up_cluster: UpCluster) -> None:
    """NIXL's decode params (a prefill instance running NIXL behind the same router), or none: the decode instance
    answers right, computing the prompt itself, says why once per peer, and counts it by reason."""
    decode = up_cluster.instance("kv_consumer")
    series = 'p2pkv_requests_computed_here_total{{reason="{}"}}'
    before = {reason: metric(decode["metrics"], series.format(reason)) for reason in ("foreign", "none")}
    text = prompt("nixl-params", 300)
    body = {"model": up_cluster.model, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
            "return_token_ids": True, "ignore_eos": True}
    reference = ids_and_logprobs(greedy(up_cluster.colocated, up_cluster.model, text))[0]
    for params in (NIXL_PARAMS, NIXL_PARAMS, None):
        answer = complete(f"http://{decode['http']}", {**body, "kv_transfer_params": params})
        assert ids_and_logprobs(answer)[0] == reference
    assert metric(decode["metrics"], series.format("foreign")) == before["foreign"] + 2
    assert metric(decode["metrics"], series.format("none")) == before["none"] + 1
    log = (Path(up_cluster.info["log_dir"]) / "decode0.log").read_text(errors="replace")
    assert log.count("kv_transfer_params from another connector") == 1 and "from 10.9.9.9:5600" in log


@pytest.mark.parametrize("chat,interval", [(False, None), (True, None), (False, 3)],
                         ids=["completion", "chat", "completion-3-tokens-an-event"])
def test_a_stream_cut_off_after_its_answer_began_goes_on_with_the_same_text(up_cluster: UpCluster, chat: bool,
                                                                            interval: int | None) -> None:
    """The rest of a stream cut off after 5 events is prefilled and decoded as a new transfer from the tokens
    already streamed (a chat stream's as a completion of its prompt's tokens), and the client's stream reads as one
    uninterrupted answer equal to the colocated instance's, under one id, with one request's usage. With vLLM's
    `stream_interval`, events of several tokens, whose text may end inside a character (the tiny model's tokens
    are bytes): the stream goes on from where its text ended."""
    decode = up_cluster.instance("kv_consumer")
    base: dict[str, Any] = {"model": up_cluster.model, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if chat:
        path, base["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt("resumed-chat", 200)}]
    else:
        path, base["prompt"] = "/v1/completions", prompt("resumed" if interval is None else "interval-0", 200)
    if interval is not None:
        base["stream_interval"] = interval
    loaded_before = metric(decode["metrics"], "p2pkv_bytes_loaded_total")
    events, metrics = cut_stream(up_cluster.info, path, {**base, "stream": True,
                                                         "stream_options": {"include_usage": True}})
    assert not [e for e in events if "error" in e], events
    choices = [c for e in events for c in e["choices"]]
    assert not [c for c in choices if "token_ids" in c or "prompt_token_ids" in c], "ids the client did not ask for"
    assert not [e for e in events if "prompt_token_ids" in e]
    assert len({e["id"] for e in events}) == 1
    answer = complete(up_cluster.colocated, base, path)
    colocated = answer["choices"][0]
    if chat:
        assert {e["object"] for e in events} == {"chat.completion.chunk"}
        streamed = "".join((c.get("delta") or {}).get("content") or "" for c in choices)
        assert streamed == colocated["message"]["content"]
    else:
        assert "".join(c["text"] for c in choices) == colocated["text"]
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == MAX_TOKENS
    assert usage["prompt_tokens"] == answer["usage"]["prompt_tokens"]
    assert "p2pkv_proxy_stream_resumes_total 1.0" in metrics
    assert 'p2pkv_proxy_requests_total{outcome="ok"} 1.0' in metrics
    assert metric(decode["metrics"], "p2pkv_bytes_loaded_total") > loaded_before, "the KV came by transfer"


def test_kv_that_never_arrives_is_recomputed_after_the_deadline_without_delaying_others(
        up_cluster: UpCluster) -> None:
    import threading
    import time

    decode = up_cluster.instance("kv_consumer")
    failed_before = metric(decode["metrics"], 'p2pkv_transfers_total{direction="load",outcome="failed"}')
    lost_text, other_text = prompt("lost", 300), prompt("other", 200)
    lost = DecodeParams(uuid.uuid4().hex, 300, None)  # no prefill instance ever pushes this transfer
    body = {"model": up_cluster.model, "prompt": lost_text, "max_tokens": MAX_TOKENS, "temperature": 0,
            "logprobs": 1, "return_token_ids": True, "ignore_eos": True, "kv_transfer_params": lost.to_dict()}
    result: dict[str, Any] = {}

    def send_lost() -> None:
        started = time.monotonic()
        result["answer"] = complete(f"http://{decode['http']}", body)
        result["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=send_lost)
    thread.start()
    time.sleep(0.5)
    started = time.monotonic()
    other = greedy(up_cluster.proxy, up_cluster.model, other_text)
    other_seconds = time.monotonic() - started
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert other_seconds < TRANSFER_TIMEOUT_S, "a lost transfer held up an unrelated request"
    assert ids_and_logprobs(other)[0] == ids_and_logprobs(greedy(up_cluster.colocated, up_cluster.model,
                                                                 other_text))[0]
    assert TRANSFER_TIMEOUT_S - 1 <= result["seconds"] < TRANSFER_TIMEOUT_S + 30
    reference = greedy(up_cluster.colocated, up_cluster.model, lost_text)
    assert ids_and_logprobs(result["answer"])[0] == ids_and_logprobs(reference)[0]
    failed_after = metric(decode["metrics"], 'p2pkv_transfers_total{direction="load",outcome="failed"}')
    assert failed_after - failed_before == 1


def _until(check: Any, limit_s: float) -> bool:
    """Whether `check()` comes true within `limit_s` (polled)."""
    deadline = time.monotonic() + limit_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_decode_request_whose_client_leaves_while_it_waits_for_kv_frees_its_blocks_at_once(
        up_cluster: UpCluster) -> None:
    """A decode request waits for KV that does not come; its client goes away. vLLM holds the request's blocks
    until its load is reported: it is reported at once (no load error, no failed load), rather than at the
    transfer's deadline (5 s here)."""
    import threading

    decode = up_cluster.instance("kv_consumer")
    failed_before = metric(decode["metrics"], LOAD_FAILED)
    lost = DecodeParams(uuid.uuid4().hex, 300, None)
    body = {"model": up_cluster.model, "prompt": prompt("left-waiting", 300), "max_tokens": MAX_TOKENS,
            "stream": True, "kv_transfer_params": lost.to_dict()}
    held: list[float] = []

    def leave_early() -> None:
        try:
            with httpx.stream("POST", f"http://{decode['http']}/v1/completions", json=body, timeout=1.0) as resp:
                for _ in resp.iter_raw():
                    pass
        except httpx.TimeoutException:
            return

    started = time.monotonic()
    client = threading.Thread(target=leave_early)
    client.start()
    time.sleep(0.5)
    held.append(metric(decode["http"], "vllm:kv_cache_usage_perc"))
    client.join(timeout=30)
    assert held[0] > 0, "the waiting request holds no blocks: nothing to check"
    assert _until(lambda: metric(decode["http"], "vllm:kv_cache_usage_perc") == 0, 1.5), (
        "the blocks of a request whose client left were held")
    assert time.monotonic() - started < TRANSFER_TIMEOUT_S - 1
    time.sleep(TRANSFER_TIMEOUT_S)  # past the deadline: the load was not failed after all
    assert metric(decode["metrics"], LOAD_FAILED) == failed_before


@pytest.mark.parametrize(("pull", "discarded", "to"), [(False, True, "kv_consumer"), (True, True, "kv_consumer"),
                                                       (True, True, "kv_producer"), (False, False, "kv_consumer")])
def test_a_transfer_whose_request_will_not_come_is_freed_when_the_proxy_says_so(up_cluster: UpCluster, pull: bool,
                                                                                 discarded: bool, to: str) -> None:
    """The proxy's client went away after its prefill and before the decode instance had the request: the proxy
    sends the decode instance a discard (a request of one token naming the transfer). Pushed, the staged bytes
    are freed; held for a pull (GET), the prefill instance's blocks are released; either at once, where they were
    held for 120 s (staging expiry) or 30 s (lease). When the client went away before the prefill answered, the
    prefill instance gets the discard too, with only the transfer id: it stops holding the blocks itself. The
    control, with no discard, still holds the staged bytes after 3 s (then it is sent, so that the shared cluster
    holds nothing)."""
    prefill, decode = up_cluster.instance("kv_producer"), up_cluster.instance("kv_consumer")
    text = prompt(f"gone-{pull}-{discarded}-{to}", 3 * BLOCK_SIZE)
    params = PrefillParams(uuid.uuid4().hex, None if pull else Address.parse(decode["kv"]), pull=pull)
    body = {"model": up_cluster.model, "prompt": text, "max_tokens": 1, "kv_transfer_params": params.to_dict()}
    returned = parse_transfer_params(complete(f"http://{prefill['http']}", body)["kv_transfer_params"])
    assert isinstance(returned, DecodeParams)

    def held() -> bool:
        if pull:
            return metric(prefill["http"], "vllm:kv_cache_usage_perc") > 0
        return metric(decode["metrics"], "p2pkv_staging_bytes") > 0

    assert _until(held, 5), "nothing was held for the transfer: nothing to check"
    told = DiscardParams.of(returned) if to == "kv_consumer" else DiscardParams(returned.transfer_id)
    discard = {"model": up_cluster.model, "prompt": [0], "max_tokens": 1, "kv_transfer_params": told.to_dict()}
    if not discarded:
        time.sleep(3)
        assert held()
    complete(f"http://{up_cluster.instance(to)['http']}", discard)
    assert _until(lambda: not held(), 3)
    if to == "kv_producer":  # nobody is to load it (the decode request will not come); the instances serve on
        again = prompt(f"after-gone-{to}", 200)
        assert ids_and_logprobs(greedy(up_cluster.proxy, up_cluster.model, again))[0] == ids_and_logprobs(
            greedy(up_cluster.colocated, up_cluster.model, again))[0]
    # The decode instance serves on, and a request naming the discarded transfer computes its prompt itself, well
    # within the deadline: told of the discard, it loads nothing; not told (the discard went to the prefill
    # instance), its pull is refused at once, the transfer being withdrawn, rather than waiting for an offer.
    late = {"model": up_cluster.model, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
            "return_token_ids": True, "ignore_eos": True, "kv_transfer_params": returned.to_dict()}
    started = time.monotonic()
    answer = complete(f"http://{decode['http']}", late)
    assert time.monotonic() - started < TRANSFER_TIMEOUT_S
    assert ids_and_logprobs(answer)[0] == ids_and_logprobs(greedy(up_cluster.colocated, up_cluster.model, text))[0]


def test_a_prefill_request_aborted_after_its_prompt_was_saved_stops_holding_its_blocks(up_cluster: UpCluster) -> None:
    """GET: a prefill request that goes on decoding (as with `kv_both`, or a proxy that does not cap the prefill at
    one token) is aborted after its prompt was saved and offered: its answer, which names the transfer, reaches
    nobody, so nobody will pull. Its blocks go back to vLLM at once, not when the lease (30 s) runs out."""
    prefill = up_cluster.instance("kv_producer")
    params = PrefillParams(uuid.uuid4().hex, None, pull=True)
    body = {"model": up_cluster.model, "prompt": prompt("aborted-prefill", 300), "max_tokens": 2000,
            "ignore_eos": True, "stream": True, "kv_transfer_params": params.to_dict()}
    with httpx.stream("POST", f"http://{prefill['http']}/v1/completions", json=body, timeout=30) as resp:
        events = (line for line in resp.iter_lines() if line.startswith("data: "))
        for _ in range(3):  # tokens are coming: the prompt was saved, and its blocks are offered
            next(events)
    left = time.monotonic()
    assert _until(lambda: metric(prefill["http"], "vllm:kv_cache_usage_perc") == 0, 3), (
        "an aborted prefill request's blocks are still held for a pull nobody will make")
    assert time.monotonic() - left < 5


def test_clients_that_leave_through_the_proxy_leave_nothing_held(up_cluster: UpCluster) -> None:
    """Clients go away through the proxy at points through the prefill (of a long prompt, in chunks) and the
    decode: each transfer is discarded on the decode instance, and afterwards neither instance holds anything."""
    prefill, decode = up_cluster.instance("kv_producer"), up_cluster.instance("kv_consumer")
    proxy = up_cluster.proxy.removeprefix("http://")
    sent_before = metric(proxy, 'p2pkv_proxy_discards_total{outcome="sent"}')
    cut = 0
    for i, wait_s in enumerate((0.05, 0.1, 0.2, 0.3, 0.45, 0.6)):
        body = {"model": up_cluster.model, "prompt": prompt(f"leave{i}", 2000), "max_tokens": 64, "ignore_eos": True}
        try:
            httpx.post(f"{up_cluster.proxy}/v1/completions", json=body, timeout=wait_s)
        except httpx.TimeoutException:
            cut += 1
    assert cut >= 3
    # One discard to the decode instance per client that left, and one to the prefill instance for each that left
    # before its prefill answered.
    sent = 'p2pkv_proxy_discards_total{outcome="sent"}'
    assert _until(lambda: metric(proxy, sent) - sent_before >= cut, 10)
    time.sleep(1)
    assert metric(proxy, sent) - sent_before <= 2 * cut
    assert metric(proxy, 'p2pkv_proxy_discards_total{outcome="failed"}') == 0
    assert metric(proxy, 'p2pkv_proxy_discards_total{outcome="refused"}') == 0
    assert _until(lambda: metric(decode["metrics"], "p2pkv_staging_bytes") == 0, 5)
    for instance in (prefill, decode):
        assert _until(lambda i=instance: metric(i["http"], "vllm:kv_cache_usage_perc") == 0, 5)


def test_get_mode_decode_pulls_from_prefill(up_cluster: UpCluster) -> None:
    """send_type GET per request: the prefill instance holds the blocks under a lease, the decode side pulls."""
    prefill, decode = up_cluster.instance("kv_producer"), up_cluster.instance("kv_consumer")
    loaded_before = metric(decode["metrics"], "p2pkv_bytes_loaded_total")
    sent_before = metric(prefill["metrics"], "p2pkv_bytes_sent_total" + SHM)
    length = 385
    text = prompt("get", length)
    returned, answer = two_steps(up_cluster, text, PrefillParams(uuid.uuid4().hex, None, pull=True))
    assert returned.pull
    assert returned.prefill_kv == Address.parse(prefill["kv"])
    reference = greedy(up_cluster.colocated, up_cluster.model, text)
    assert ids_and_logprobs(answer)[0] == ids_and_logprobs(reference)[0]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == length - 1
    per_block = kv_bytes_per_block_and_layer() * LAYERS
    pulled = math.ceil((length - 1) / BLOCK_SIZE) * per_block  # only the blocks the decode side needs
    assert metric(decode["metrics"], "p2pkv_bytes_loaded_total") - loaded_before == pulled
    assert metric(prefill["metrics"], "p2pkv_bytes_sent_total" + SHM) - sent_before == pulled


def test_repeated_prompts_with_prefix_caching_on_both_sides(up_cluster: UpCluster) -> None:
    """The second and third runs hit both instances' prefix caches; outputs must not change (vllm#22965)."""
    decode = up_cluster.instance("kv_consumer")
    text = prompt("repeat", 520)  # also longer than --max-num-batched-tokens: chunked on the prefill side
    reference = ids_and_logprobs(greedy(up_cluster.colocated, up_cluster.model, text))[0]
    loaded = []
    for _ in range(3):
        before = metric(decode["metrics"], "p2pkv_bytes_loaded_total")
        answer = greedy(up_cluster.proxy, up_cluster.model, text)
        loaded.append(metric(decode["metrics"], "p2pkv_bytes_loaded_total") - before)
        assert ids_and_logprobs(answer)[0] == reference
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 519
    per_block = kv_bytes_per_block_and_layer() * LAYERS
    assert loaded[0] == math.ceil(519 / BLOCK_SIZE) * per_block
    # Later runs find the full blocks in the decode instance's own cache and load only the partial last one.
    assert loaded[1] == loaded[2] == per_block


def test_a_prompt_the_decode_instance_holds_whole_loads_nothing_and_frees_the_push(up_cluster: UpCluster) -> None:
    """Two whole blocks and one token, sent twice: the second time the decode instance's own prefix cache holds
    every block it would load. Nothing is loaded and the push made for it is freed. (Its decode instance used to
    crash here: a load was reported for a request that waited for none, and vLLM asserts on that.)"""
    decode = up_cluster.instance("kv_consumer")
    length = 2 * BLOCK_SIZE + 1
    text = prompt("whole", length)
    reference = ids_and_logprobs(greedy(up_cluster.colocated, up_cluster.model, text))[0]
    assert ids_and_logprobs(greedy(up_cluster.proxy, up_cluster.model, text))[0] == reference
    loaded_before = metric(decode["metrics"], "p2pkv_bytes_loaded_total")
    failed_before = metric(decode["metrics"], LOAD_FAILED)
    again = greedy(up_cluster.proxy, up_cluster.model, text)
    assert ids_and_logprobs(again)[0] == reference
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == length - 1
    assert metric(decode["metrics"], "p2pkv_bytes_loaded_total") == loaded_before
    # The instance lives on, and once it steps again no staging is left.
    other = prompt("after-whole", 200)
    assert ids_and_logprobs(greedy(up_cluster.proxy, up_cluster.model, other))[0] == ids_and_logprobs(
        greedy(up_cluster.colocated, up_cluster.model, other))[0]
    assert metric(decode["metrics"], "p2pkv_staging_bytes") == 0
    assert metric(decode["metrics"], LOAD_FAILED) == failed_before


def test_in_get_mode_a_prompt_the_decode_instance_holds_whole_frees_the_prefill_blocks_at_once(
        up_cluster: UpCluster) -> None:
    """GET: the prefill instance holds a prompt's blocks for the decode side's pull, for up to `lease_s` (30 s).
    When the decode instance needs none of them, it says so at once."""
    prefill, decode = up_cluster.instance("kv_producer"), up_cluster.instance("kv_consumer")
    text = prompt("whole-get", 2 * BLOCK_SIZE + 1)
    reference = ids_and_logprobs(greedy(up_cluster.colocated, up_cluster.model, text))[0]
    for _ in range(2):  # the second time, the decode instance's prefix cache holds every block it would pull
        loaded_before = metric(decode["metrics"], "p2pkv_bytes_loaded_total")
        _, answer = two_steps(up_cluster, text, PrefillParams(uuid.uuid4().hex, None, pull=True))
        assert ids_and_logprobs(answer)[0] == reference
    assert metric(decode["metrics"], "p2pkv_bytes_loaded_total") == loaded_before
    deadline = time.monotonic() + 5
    while metric(prefill["http"], "vllm:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(prefill["http"], "vllm:kv_cache_usage_perc") == 0


def _samples(base: str, model: str, text: str, n: int, params: dict[str, Any] | None = None,
             ) -> tuple[list[list[int]], float]:
    # vLLM refuses `n` > 1 with temperature 0; top_k 1 samples greedily all the same.
    body: dict[str, Any] = {"model": model, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 1.0,
                            "top_k": 1, "n": n, "return_token_ids": True, "ignore_eos": True}
    if params is not None:
        body["kv_transfer_params"] = params
    started = time.monotonic()
    answer = complete(base, body)
    return [c["token_ids"] for c in sorted(answer["choices"], key=lambda c: c["index"])], time.monotonic() - started


def test_parallel_sampling_loads_the_transfer_once_for_every_sample(up_cluster: UpCluster) -> None:
    """`n` = 3 through the proxy: the decode instance runs one request per sample, all naming one transfer. The
    first loads it; the others wait for it to land and take its blocks from the prefix cache. (The others used to
    wait for KV that was already taken until the transfer's deadline, then fail their loads.)"""
    decode = up_cluster.instance("kv_consumer")
    length = 300
    text = prompt("samples", length)
    reference = ids_and_logprobs(greedy(up_cluster.colocated, up_cluster.model, text))[0]
    loaded_before = metric(decode["metrics"], "p2pkv_bytes_loaded_total")
    failed_before = metric(decode["metrics"], LOAD_FAILED)
    samples, seconds = _samples(up_cluster.proxy, up_cluster.model, text, 3)
    assert samples == [reference] * 3
    assert seconds < TRANSFER_TIMEOUT_S
    per_block = kv_bytes_per_block_and_layer() * LAYERS
    assert metric(decode["metrics"], "p2pkv_bytes_loaded_total") - loaded_before == math.ceil(
        (length - 1) / BLOCK_SIZE) * per_block
    assert metric(decode["metrics"], LOAD_FAILED) == failed_before


def test_parallel_sampling_on_the_prefill_instance_too_sends_one_transfer(up_cluster: UpCluster) -> None:
    """A proxy that keeps `n` for the prefill request (vLLM's example proxies do): the prefill instance runs three
    requests with one transfer id. Only the first sends its blocks, and each answers with the same parameters."""
    prefill, decode = up_cluster.instance("kv_producer"), up_cluster.instance("kv_consumer")
    length = 300
    text = prompt("prefill-samples", length)
    reference = ids_and_logprobs(greedy(up_cluster.colocated, up_cluster.model, text))[0]
    sent_before = metric(prefill["metrics"], "p2pkv_bytes_sent_total" + SHM)
    failed_before = metric(decode["metrics"], LOAD_FAILED)
    params = PrefillParams(uuid.uuid4().hex, Address.parse(decode["kv"]))
    body = {"model": up_cluster.model, "prompt": text, "max_tokens": 1, "n": 3,
            "kv_transfer_params": params.to_dict()}
    returned = parse_transfer_params(complete(f"http://{prefill['http']}", body)["kv_transfer_params"])
    assert isinstance(returned, DecodeParams) and returned.transfer_id == params.transfer_id
    samples, seconds = _samples(f"http://{decode['http']}", up_cluster.model, text, 3, returned.to_dict())
    assert samples == [reference] * 3
    assert seconds < TRANSFER_TIMEOUT_S
    per_block = kv_bytes_per_block_and_layer() * LAYERS
    assert metric(prefill["metrics"], "p2pkv_bytes_sent_total" + SHM) - sent_before == math.ceil(
        length / BLOCK_SIZE) * per_block
    assert metric(decode["metrics"], LOAD_FAILED) == failed_before
    # No sample holds blocks afterwards (one that answered as a sender, without having sent, held them for good).
    deadline = time.monotonic() + 10
    while metric(prefill["http"], "vllm:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(prefill["http"], "vllm:kv_cache_usage_perc") == 0


def _batch(base: str, model: str, texts: list[str], params: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": texts, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "return_token_ids": True, "ignore_eos": True}
    if params is not None:
        body["kv_transfer_params"] = params
    return complete(base, body)


def _ids(answer: dict[str, Any]) -> list[list[int]]:
    return [c["token_ids"] for c in sorted(answer["choices"], key=lambda c: c["index"])]


def test_a_batch_of_prompts_through_the_proxy_goes_as_one_transfer_per_prompt(up_cluster: UpCluster) -> None:
    decode = up_cluster.instance("kv_consumer")
    length = 300
    texts = [prompt(f"batch-{i}", length) for i in range(3)]
    references = [ids_and_logprobs(greedy(up_cluster.colocated, up_cluster.model, t))[0] for t in texts]
    loaded_before = metric(decode["metrics"], "p2pkv_bytes_loaded_total")
    answer = _batch(up_cluster.proxy, up_cluster.model, texts)
    assert _ids(answer) == references
    assert answer["usage"]["prompt_tokens"] == 3 * length
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * (length - 1)
    per_block = kv_bytes_per_block_and_layer() * LAYERS
    assert metric(decode["metrics"], "p2pkv_bytes_loaded_total") - loaded_before == 3 * math.ceil(
        (length - 1) / BLOCK_SIZE) * per_block


def _streamed_batch(base: str, body: dict[str, Any]) -> tuple[dict[int, str], dict[str, Any], int]:
    """A streamed batch's text by choice index, its final usage, and how many times it said [DONE]."""
    import json

    texts: dict[int, str] = {}
    usage: dict[str, Any] = {}
    done = 0
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done += 1
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                for choice in event["choices"]:
                    texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return texts, usage, done


def test_a_streamed_batch_through_the_proxy_goes_as_one_transfer_per_prompt(up_cluster: UpCluster) -> None:
    """A streamed batch of three prompts, two samples each: through the proxy each prompt loads a transfer of its
    own, and the merged stream says what the colocated instance's stream of the whole batch says, choice by choice
    (prompt i's sample j is choice 2i + j)."""
    decode = up_cluster.instance("kv_consumer")
    length = 300
    body = {"model": up_cluster.model, "prompt": [prompt(f"stream-batch-{i}", length) for i in range(3)],
            "max_tokens": MAX_TOKENS, "temperature": 1.0, "top_k": 1, "n": 2, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    loaded_before = metric(decode["metrics"], "p2pkv_bytes_loaded_total")
    texts, usage, done = _streamed_batch(up_cluster.proxy, body)
    reference, reference_usage, _ = _streamed_batch(up_cluster.colocated, body)
    assert sorted(texts) == list(range(6)) and texts == reference and done == 1
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        reference_usage["prompt_tokens"], reference_usage["completion_tokens"]) == (3 * length, 6 * MAX_TOKENS)
    per_block = kv_bytes_per_block_and_layer() * LAYERS
    assert metric(decode["metrics"], "p2pkv_bytes_loaded_total") - loaded_before == 3 * math.ceil(
        (length - 1) / BLOCK_SIZE) * per_block


def test_a_batch_sent_as_one_transfer_loads_only_the_prompt_it_holds(up_cluster: UpCluster) -> None:
    """A proxy that sends a list of prompts as one request (vLLM's example proxies do): vLLM runs one request per
    prompt, all with the one transfer. Only the prompt whose digest the transfer carries loads it; the others (of
    the same length here) are computed on the decode instance. Every answer equals the colocated one."""
    prefill, decode = up_cluster.instance("kv_producer"), up_cluster.instance("kv_consumer")
    length = 300
    texts = [prompt(f"one-transfer-{i}", length) for i in range(3)]
    references = [ids_and_logprobs(greedy(up_cluster.colocated, up_cluster.model, t))[0] for t in texts]
    loaded_before = metric(decode["metrics"], "p2pkv_bytes_loaded_total")
    failed_before = metric(decode["metrics"], LOAD_FAILED)
    params = PrefillParams(uuid.uuid4().hex, Address.parse(decode["kv"]))
    pre = {"model": up_cluster.model, "prompt": texts, "max_tokens": 1, "kv_transfer_params": params.to_dict()}
    returned = complete(f"http://{prefill['http']}", pre)["kv_transfer_params"]
    started = time.monotonic()
    answer = _batch(f"http://{decode['http']}", up_cluster.model, texts, returned)
    assert time.monotonic() - started < TRANSFER_TIMEOUT_S
    assert _ids(answer) == references
    per_block = kv_bytes_per_block_and_layer() * LAYERS
    assert metric(decode["metrics"], "p2pkv_bytes_loaded_total") - loaded_before == math.ceil(
        (length - 1) / BLOCK_SIZE) * per_block
    assert metric(decode["metrics"], LOAD_FAILED) == failed_before


def test_prompt_logprobs_are_computed_by_the_decode_instance_alone(up_cluster: UpCluster) -> None:
    """vLLM computes a prompt whose logprobs are asked for whole, reading no transferred KV: the proxy sends such a
    request to the decode instance alone. The logprobs equal the colocated instance's."""
    prefill, decode = up_cluster.instance("kv_producer"), up_cluster.instance("kv_consumer")
    text = prompt("prompt-logprobs", 200)
    body = {"model": up_cluster.model, "prompt": text, "max_tokens": 4, "temperature": 0, "prompt_logprobs": 1}
    sent_before = metric(prefill["metrics"], "p2pkv_bytes_sent_total" + SHM)
    failed_before = metric(decode["metrics"], LOAD_FAILED)
    resp = httpx.post(f"{up_cluster.proxy}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.headers[PREFILL_HEADER] == "none"
    ours, reference = resp.json()["choices"][0], complete(up_cluster.colocated, body)["choices"][0]
    assert ours["text"] == reference["text"]
    assert len(ours["prompt_logprobs"]) == len(reference["prompt_logprobs"]) == 200
    for got, want in zip(ours["prompt_logprobs"][1:], reference["prompt_logprobs"][1:], strict=True):
        assert got.keys() == want.keys()
        assert all(got[k]["logprob"] == pytest.approx(want[k]["logprob"], abs=1e-4) for k in got)
    assert metric(prefill["metrics"], "p2pkv_bytes_sent_total" + SHM) == sent_before
    assert metric(decode["metrics"], LOAD_FAILED) == failed_before


def test_tokenize_detokenize_and_models_through_the_proxy(up_cluster: UpCluster) -> None:
    body = {"model": up_cluster.model, "prompt": "disaggregated"}
    ours = httpx.post(f"{up_cluster.proxy}/tokenize", json=body, timeout=30)
    assert ours.status_code == 200 and ours.json() == complete(up_cluster.colocated, body, "/tokenize")
    tokens = ours.json()["tokens"]
    back = httpx.post(f"{up_cluster.proxy}/detokenize", json={"model": up_cluster.model, "tokens": tokens}, timeout=30)
    assert back.status_code == 200 and back.json()["prompt"] == "disaggregated"
    assert httpx.get(f"{up_cluster.proxy}/v1/models", timeout=30).json()["data"][0]["id"] == up_cluster.model
    assert httpx.get(f"{up_cluster.proxy}/version", timeout=30).json()["version"]
    messages = {"model": up_cluster.model, "messages": [{"role": "user", "content": "disaggregated"}]}
    counted = httpx.post(f"{up_cluster.proxy}/v1/messages/count_tokens", json=messages, timeout=30)
    assert counted.status_code == 200
    assert counted.json() == complete(up_cluster.colocated, messages, "/v1/messages/count_tokens")


def test_put_mode_pushes_inline(up_cluster: UpCluster) -> None:
    """send_type PUT per request: the prefill step waits until the push is sent; output as colocated."""
    decode = up_cluster.instance("kv_consumer")
    received_before = metric(decode["metrics"], "p2pkv_bytes_received_total")
    length = 300
    text = prompt("put", length)
    params = PrefillParams(uuid.uuid4().hex, Address.parse(decode["kv"]), inline=True)
    assert params.to_dict()["send_type"] == "PUT"
    returned, answer = two_steps(up_cluster, text, params)
    assert not returned.pull
    reference = greedy(up_cluster.colocated, up_cluster.model, text)
    assert ids_and_logprobs(answer)[0] == ids_and_logprobs(reference)[0]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == length - 1
    per_block = kv_bytes_per_block_and_layer() * LAYERS
    assert metric(decode["metrics"], "p2pkv_bytes_received_total") - received_before == math.ceil(
        length / BLOCK_SIZE) * per_block


def test_vllm_serving_benchmark_through_the_proxy_the_standard_router_and_colocated(up_cluster: UpCluster) -> None:
    """`p2pkv bench serve`'s parts on the shared cluster: vLLM's benchmark completes every request through p2pkv's
    proxy, through a router of vLLM's standard protocol and colocated, in two rounds; the instances' metrics show
    one transfer per request each way (pushes timed by the prefill side, the router's pulls by the decode side);
    the tables and the breakdown of a request's time to first token come out of those runs."""
    from p2pkv.bench.serve import Endpoints, ServeSettings, breakdown_table, measure, table, verdicts

    prefill, decode = up_cluster.instance("kv_producer"), up_cluster.instance("kv_consumer")
    local = "http://{}/metrics".format
    kv = [local(prefill["metrics"]), local(decode["metrics"])]
    with router([f"http://{prefill['http']}"], [f"http://{decode['http']}"]) as standard:
        endpoints = Endpoints({"proxy": [f"{up_cluster.proxy}/metrics"], "prefill": [local(prefill["http"])],
                               "decode": [local(decode["http"])], "kv": kv,
                               "colocated": [f"{up_cluster.colocated}/metrics"]},
                              {"proxy": up_cluster.proxy, "router": standard}, up_cluster.colocated,
                              (f"http://{prefill['http']}", f"http://{decode['http']}", up_cluster.colocated))
        settings = ServeSettings(up_cluster.model, input_len=200, output_len=8, num_prompts=6,
                                 request_rate=float("inf"), rounds=2, warmups=0)
        runs = measure(settings, endpoints, ("proxy", "router"), say=lambda line: None)
    assert sorted(runs) == ["colocated", "proxy", "router"]
    for name, front_runs in runs.items():
        assert [result["completed"] for result, _ in front_runs] == [6, 6], name
    for front in ("proxy", "router"):
        for _, parts in runs[front]:
            assert parts["KV push (prefill side) or pull (decode side)"] > 0, front
            assert parts["decode instance: arrival to first token"] > 0, front
    assert all(parts["prefill request, as the proxy saw it"] > 0 for _, parts in runs["proxy"])
    lines = table(runs)
    assert "1P1D via proxy" in lines[0] and "1P1D via router" in lines[0] and lines[1].startswith("mean TTFT (ms)")
    assert any(line.startswith("decode instance: arrival to first token") for line in breakdown_table(runs))
    said, _ = verdicts(runs)
    assert sum("target" in line for line in said) == 6


def test_an_old_proxys_requests_move_their_kv(up_cluster: UpCluster) -> None:
    """What the old connector's proxy sent, by hand: no kv_transfer_params, and one `X-Request-Id` for both
    instances naming their KV addresses. vLLM adds its own suffixes to that id; the KV still moves, for one prompt,
    a batch of two (a transfer per prompt) and a chat request, and the answers equal the colocated instance's."""
    prefill, decode = up_cluster.instance("kv_producer"), up_cluster.instance("kv_consumer")
    base = {"model": up_cluster.model, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
    texts = [prompt(f"legacy-{i}", n) for i, n in enumerate([300, 200, 130])]
    per_block = kv_bytes_per_block_and_layer() * LAYERS

    def both(body: dict[str, Any], path: str) -> dict[str, Any]:
        headers = {"X-Request-Id": f"___prefill_addr_{prefill['kv']}___decode_addr_{decode['kv']}_{uuid.uuid4().hex}"}
        first = httpx.post(f"http://{prefill['http']}{path}", json={**body, "max_tokens": 1}, headers=headers,
                           timeout=120)
        assert first.status_code == 200, first.text
        answer = httpx.post(f"http://{decode['http']}{path}", json={**body, "max_tokens": MAX_TOKENS},
                            headers=headers, timeout=120)
        assert answer.status_code == 200, answer.text
        out: dict[str, Any] = answer.json()
        return out

    loaded_before = metric(decode["metrics"], "p2pkv_bytes_loaded_total")
    one = both({**base, "prompt": texts[0]}, "/v1/completions")
    assert one["usage"]["prompt_tokens_details"]["cached_tokens"] == 299
    assert _ids(one) == [ids_and_logprobs(greedy(up_cluster.colocated, up_cluster.model, texts[0]))[0]]
    batch = both({**base, "prompt": texts[1:]}, "/v1/completions")
    # vLLM's usage for a batch gives the last prompt's cached tokens alone; the bytes loaded count both.
    assert batch["usage"]["prompt_tokens_details"]["cached_tokens"] == 129
    assert _ids(batch) == [ids_and_logprobs(greedy(up_cluster.colocated, up_cluster.model, t))[0] for t in texts[1:]]
    expected = sum(math.ceil((len(t) - 1) / BLOCK_SIZE) for t in texts) * per_block
    assert metric(decode["metrics"], "p2pkv_bytes_loaded_total") - loaded_before == expected
    messages = [{"role": "user", "content": prompt("legacy-chat", 200)}]
    chat = both({**base, "messages": messages}, "/v1/chat/completions")
    colocated = complete(up_cluster.colocated, {**base, "messages": messages, "max_tokens": MAX_TOKENS},
                         "/v1/chat/completions")
    assert chat["choices"][0]["message"]["content"] == colocated["choices"][0]["message"]["content"]
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] == chat["usage"]["prompt_tokens"] - 1


def test_the_responses_and_anthropic_messages_apis_move_the_kv_too(up_cluster: UpCluster) -> None:
    """vLLM serves OpenAI's Responses API and Anthropic's Messages API, both with kv_transfer_params: through the
    proxy each is prefilled with one token and decoded with the transferred KV, plain and streamed, and answers
    as the colocated instance does."""
    model, text = up_cluster.model, prompt("apis", 300)
    responses = {"model": model, "input": text, "max_output_tokens": MAX_TOKENS, "temperature": 0}
    messages = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS,
                "temperature": 0}
    for path, body, answer_of, cached_of in [
        ("/v1/responses", responses, lambda a: a["output"][0]["content"][0]["text"],
         lambda a: (a["usage"]["input_tokens_details"]["cached_tokens"], a["usage"]["input_tokens"] - 1)),
        ("/v1/messages", messages, lambda a: a["content"][0]["text"],
         lambda a: (a["usage"]["cache_read_input_tokens"], a["usage"]["cache_read_input_tokens"] + a["usage"][
             "input_tokens"] - 1)),
    ]:
        disagg, local = complete(up_cluster.proxy, body, path), complete(up_cluster.colocated, body, path)
        assert answer_of(disagg) == answer_of(local), path
        loaded, expected = cached_of(disagg)
        assert loaded == expected and loaded > 250, (path, disagg["usage"])
        with httpx.stream("POST", f"{up_cluster.proxy}{path}", json={**body, "stream": True}, timeout=120) as resp:
            assert resp.status_code == 200
            events = "".join(resp.iter_text())
        assert ("response.completed" if path == "/v1/responses" else "message_stop") in events


def _pushed_and_held(up_cluster: UpCluster, tag: str) -> dict[str, DecodeParams]:
    """Two prompts prefilled by hand, their decode requests not sent: one pushed and staged on the decode instance,
    one held on the prefill instance for a pull. Their prompts and the parameters the prefill instance answered."""
    prefill, decode = up_cluster.instance("kv_producer"), up_cluster.instance("kv_consumer")
    returned = {}
    for pull in (False, True):
        text = prompt(f"{tag}-{pull}", 3 * BLOCK_SIZE)
        params = PrefillParams(uuid.uuid4().hex, None if pull else Address.parse(decode["kv"]), pull=pull)
        body = {"model": up_cluster.model, "prompt": text, "max_tokens": 1, "kv_transfer_params": params.to_dict()}
        answer = parse_transfer_params(complete(f"http://{prefill['http']}", body)["kv_transfer_params"])
        assert isinstance(answer, DecodeParams)
        returned[text] = answer
    assert _until(lambda: metric(decode["metrics"], "p2pkv_staging_bytes") > 0, 5)
    assert metric(prefill["http"], "vllm:kv_cache_usage_perc") > 0
    return returned


def _computed_on_decode(up_cluster: UpCluster, returned: dict[str, DecodeParams]) -> None:
    """Each decode request, sent now, loads nothing and answers at once (no wait for KV) as the colocated
    instance does."""
    decode = up_cluster.instance("kv_consumer")
    for text, params in returned.items():
        late = {"model": up_cluster.model, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
                "return_token_ids": True, "ignore_eos": True, "kv_transfer_params": params.to_dict()}
        started = time.monotonic()
        answer = complete(f"http://{decode['http']}", late)
        assert time.monotonic() - started < TRANSFER_TIMEOUT_S
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert ids_and_logprobs(answer)[0] == ids_and_logprobs(greedy(up_cluster.colocated, up_cluster.model, text))[0]


def test_kv_staged_or_held_before_a_cache_reset_is_not_loaded_after(up_cluster: UpCluster) -> None:
    """vLLM resets its caches after a weight update (`/pause` clears them; here `/reset_prefix_cache` with the
    connector's, which the cluster's dev mode serves): KV computed before must not be loaded after. On the decode
    instance a staged push is dropped at once; on the prefill instance blocks held for a pull stop being offered,
    so vLLM's reset, which fails while they are held, succeeds a step later instead of after the lease (30 s).
    Requests naming either transfer then compute their prompts on the decode instance, at once, and answer as the
    colocated instance does."""
    prefill, decode = up_cluster.instance("kv_producer"), up_cluster.instance("kv_consumer")
    returned = _pushed_and_held(up_cluster, "reset")

    def reset(address: str) -> bool:
        resp = httpx.post(f"http://{address}/reset_prefix_cache", params={"reset_external": "true"}, timeout=30)
        assert resp.status_code == 200, resp.text
        return bool(resp.json()["success"])

    assert reset(decode["http"])
    assert _until(lambda: metric(decode["metrics"], "p2pkv_staging_bytes") == 0, 5)
    started = time.monotonic()
    assert not reset(prefill["http"])  # the blocks held for the pull: freed at the next step
    assert _until(lambda: reset(prefill["http"]), 5)
    assert time.monotonic() - started < 10
    assert metric(prefill["http"], "vllm:kv_cache_usage_perc") == 0
    _computed_on_decode(up_cluster, returned)
    # The cluster serves on, moving KV as before.
    after = prompt("after-reset", 300)
    answer = greedy(up_cluster.proxy, up_cluster.model, after)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 299


def test_a_pause_through_the_proxy_does_not_wait_for_pulls_and_drops_what_predates_it(up_cluster: UpCluster) -> None:
    """An RL trainer pauses the cluster through the proxy to update the weights (`POST /pause`, vLLM's default
    mode=abort with the caches cleared), then resumes it. A prefill instance holding blocks for a pull would pause
    only once they were pulled or their lease (30 s) ran out: the proxy has it drop them first, and the pause
    returns in seconds. What was staged on the decode instance before the pause is not loaded after it."""
    prefill, decode = up_cluster.instance("kv_producer"), up_cluster.instance("kv_consumer")
    returned = _pushed_and_held(up_cluster, "pause")
    started = time.monotonic()
    resp = httpx.post(f"{up_cluster.proxy}/pause", timeout=120)
    assert resp.status_code == 200, resp.text
    assert time.monotonic() - started < 10
    assert sorted(a["role"] for a in resp.json()["instances"]) == ["decode", "prefill"]
    assert httpx.get(f"{up_cluster.proxy}/is_paused", timeout=30).json()["is_paused"] is True
    assert _until(lambda: metric(decode["metrics"], "p2pkv_staging_bytes") == 0, 5)
    assert metric(prefill["http"], "vllm:kv_cache_usage_perc") == 0
    # A request that comes while paused waits at the proxy, and goes through once the cluster resumes.
    waiting: list[dict[str, Any]] = []
    client = threading.Thread(target=lambda: waiting.append(greedy(up_cluster.proxy, up_cluster.model,
                                                                   prompt("during-pause", 300))))
    client.start()
    time.sleep(2)
    assert not waiting
    resp = httpx.post(f"{up_cluster.proxy}/resume", timeout=30)
    assert resp.status_code == 200 and resp.json()["status"] == "resumed", resp.text
    client.join(120)
    assert waiting and waiting[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 299
    _computed_on_decode(up_cluster, returned)


def _update_weights(up_cluster: UpCluster, weights: str) -> None:
    """An RL trainer's update, through the proxy, by `examples/rl_weight_update.py`: pause (mode=abort, caches
    cleared), every instance reloads its weights from `weights` (vLLM's `reload_weights`, run on each worker),
    resume. The colocated instance (the oracle) gets the same by hand."""
    run = subprocess.run([sys.executable, str(EXAMPLES / "rl_weight_update.py"), "--proxy", up_cluster.proxy,
                          "--weights", weights], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert [line.split(":")[0] for line in run.stdout.splitlines() if not line.startswith(" ")] == [
        "pause", "reload", "resume"]
    reloaded = run.stdout.split("reload:")[1].split("resume:")[0]
    assert sorted(line.split()[0] for line in reloaded.splitlines()[1:]) == ["decode", "prefill"]
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": weights}}
    assert httpx.post(f"{up_cluster.colocated}/collective_rpc", json=rpc, timeout=300).status_code == 200
    assert httpx.post(f"{up_cluster.colocated}/reset_prefix_cache", timeout=30).json()["success"]


def test_a_weight_update_that_fails_on_the_decode_instance_only_leaves_the_pair_unused(
        up_cluster: UpCluster, tmp_path: Path) -> None:
    """An RL trainer's update through a proxy (`examples/rl_weight_update.py`) whose reload fails on the decode
    instance only, as where that host cannot read the checkpoint (a relay in front of the decode instance answers
    the reload with a 500, as vLLM answers a worker method that raised): the prefill instance now runs the new
    weights, the decode instance the old ones. Loaded into the decode instance, the prefill instance's KV would make
    it answer as neither model does, without an error. The proxy passes the prefill instance over instead, and the
    decode instance computes each prompt itself, answering as the old weights do. The prefill instance then gets
    the old weights back, and the module's cluster answers as before."""
    new_weights = str(write_tiny_model(tmp_path / "step-2", TinyModelSpec(seed=4321)))
    model = up_cluster.model
    prefill, decode = up_cluster.instance("kv_producer"), up_cluster.instance("kv_consumer")
    failed: list[str] = []
    with serve(failing_relay(decode["http"], "/collective_rpc", failed)) as relay:
        config = ProxyConfig(prefill=(Instance.parse(prefill["http"]),),
                             decode=(Instance.parse(f"{relay}@{decode['kv']}"),), discovery_port=0)
        with serve(create_app(config)) as proxy:
            paired = greedy(f"http://{proxy}", model, prompt("split-before", 200))
            assert paired["usage"]["prompt_tokens_details"]["cached_tokens"] == 199  # the pair is used: KV moved
            try:
                run = subprocess.run([sys.executable, str(EXAMPLES / "rl_weight_update.py"), "--proxy",
                                      f"http://{proxy}", "--weights", new_weights],
                                     capture_output=True, text=True, timeout=600)
                assert run.returncode == 1 and failed == ["/collective_rpc"], run.stdout + run.stderr
                reloaded = run.stdout.split("reload:")[1].split("resume:")[0].splitlines()[1:]
                assert sorted((line.split()[0], line.split()[2]) for line in reloaded) == [
                    ("decode", "500"), ("prefill", "200")], run.stdout
                loaded = metric(decode["metrics"], "p2pkv_bytes_loaded_total")
                for k in range(2):
                    text = prompt(f"split-{k}", 200)
                    answer = greedy(f"http://{proxy}", model, text)
                    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed there alone
                    old = ids_and_logprobs(greedy(up_cluster.colocated, model, text))[0]
                    assert ids_and_logprobs(answer)[0] == old
                    # The prefill instance does run other weights: its own answer differs.
                    assert ids_and_logprobs(greedy(f"http://{prefill['http']}", model, text))[0] != old
                assert metric(decode["metrics"], "p2pkv_bytes_loaded_total") == loaded
                assert metric(proxy, "p2pkv_proxy_pairs_passed_over_total") == 2
            finally:
                rpc = {"method": "reload_weights", "kwargs": {"weights_path": model}}
                back = httpx.post(f"http://{prefill['http']}/collective_rpc", json=rpc, timeout=300)
                assert back.status_code == 200, back.text
                assert httpx.post(f"http://{prefill['http']}/reset_prefix_cache", timeout=30).json()["success"]
    text = prompt("split-after", 200)
    answer = greedy(up_cluster.proxy, model, text)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 199
    assert ids_and_logprobs(answer)[0] == ids_and_logprobs(greedy(up_cluster.colocated, model, text))[0]


def test_after_a_weight_update_through_the_proxy_the_cluster_answers_with_the_new_weights(
        up_cluster: UpCluster, tmp_path: Path) -> None:
    """The RL loop on a real weight change: a new checkpoint (the tiny model with other random weights) is loaded
    into every instance through the proxy between a pause and a resume. Nothing computed with the old weights is
    loaded after: not the prefix caches of either instance, not a push staged on the decode instance, not blocks
    held for a pull. So the cluster answers token for token as the colocated instance with the new weights does,
    and those differ from the old ones. Last in this module: it changes the weights of the module's cluster and of
    the oracle every module shares, and puts the old ones back."""
    new_weights = str(write_tiny_model(tmp_path / "step-2", TinyModelSpec(seed=4321)))
    model = up_cluster.model
    warm = prompt("update-warm", 300)
    old = ids_and_logprobs(greedy(up_cluster.proxy, model, warm))[0]  # now in both instances' prefix caches
    returned = _pushed_and_held(up_cluster, "update")
    try:  # an update that fails part way still ends with the old weights everywhere
        _update_weights(up_cluster, new_weights)
        oracle = ids_and_logprobs(greedy(up_cluster.colocated, model, warm))[0]
        assert oracle != old  # the weights did change
        again = greedy(up_cluster.proxy, model, warm)
        assert ids_and_logprobs(again)[0] == oracle
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 299  # moved again, computed anew
        _computed_on_decode(up_cluster, returned)
        fresh = prompt("update-fresh", 200)
        answer = greedy(up_cluster.proxy, model, fresh)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 199
        assert ids_and_logprobs(answer)[0] == ids_and_logprobs(greedy(up_cluster.colocated, model, fresh))[0]
    finally:
        _update_weights(up_cluster, model)
    # The old weights are back, in the cluster and in the oracle the later modules share.
    assert ids_and_logprobs(greedy(up_cluster.proxy, model, warm))[0] == old
    assert ids_and_logprobs(greedy(up_cluster.colocated, model, warm))[0] == old
