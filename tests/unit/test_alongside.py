"""The decode request sent alongside its prefill: the proxy sends both at once and cancels one when the other fails;
the decode side's scheduler loads a transfer whose prompt it does not know yet, and its worker lands a push only
once the push says the request's own prompt."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

pytest.importorskip("vllm", reason="the scheduler and worker sides import vLLM's connector base class")

from p2pkv.config import parse_connector_config
from p2pkv.engine.store import StageState
from p2pkv.errors import ConfigError
from p2pkv.params import Address, DecodeParams, PrefillParams, parse_transfer_params, prompt_digest
from p2pkv.protocol import PushBlocks
from p2pkv.vllm.metadata import LoadSpec, P2pkvMetadata
from p2pkv.vllm.scheduler import SchedulerSide
from p2pkv.vllm.worker import WorkerSide
from tests.helpers.servers import serve
from tests.helpers.unit import BS, Blocks, Req, metric, proxy_with, step
from tests.unit.test_overlap import LAYERS, bytes_of, cache, decode_and_sender, wait_for

OWN = prompt_digest(range(300))
OTHER = prompt_digest([1] * 300)


# Parameters and the decode side's scheduler.

def test_alongside_params_need_no_prompt_length_and_take_only_a_push() -> None:
    params = DecodeParams("t1", 0, Address("127.0.0.1", 21001), alongside_s=120.0)
    raw = params.to_dict()
    assert raw["alongside_s"] == 120.0 and parse_transfer_params(raw) == params
    del raw["num_prompt_tokens"]
    assert parse_transfer_params(raw) == params
    with pytest.raises(ConfigError, match="num_prompt_tokens"):  # without alongside_s the length is required
        parse_transfer_params(DecodeParams("t1", 0, None).to_dict())
    with pytest.raises(ConfigError, match="alongside_s"):
        parse_transfer_params({**params.to_dict(), "send_type": "GET"})
    with pytest.raises(ConfigError, match="alongside_s"):
        parse_transfer_params({**params.to_dict(), "alongside_s": float("nan")})


def decode_side(tp: int = 1) -> SchedulerSide:
    return SchedulerSide(parse_connector_config("kv_consumer", 23001, "recompute", {"kv_host": "127.0.0.1"}), BS, tp)


def test_a_request_sent_alongside_loads_its_prompt_and_tells_the_worker_its_digest() -> None:
    s = decode_side()
    params = DecodeParams("t1", 0, Address("127.0.0.1", 21001), alongside_s=90.0).to_dict()
    req = Req("cmpl-a", list(range(300)), params)
    assert s.get_num_new_matched_tokens(req, 0) == (299, True)
    s.update_state_after_alloc(req, Blocks([5, 6, 7]), 299)
    (load,) = s.build_connector_meta(step()).loads
    assert (load.transfer_id, load.block_ids, load.prompt, load.wait_s) == ("t1", (5, 6, 7), OWN, 90.0)
    assert load.pull_from is None and load.fallback_from == Address("127.0.0.1", 21001)
    # A load named by the prefill's answer carries no digest to check: its params were checked already.
    answered = Req("cmpl-b", list(range(300)), DecodeParams("t2", 300, None, prompt=OWN).to_dict())
    s.get_num_new_matched_tokens(answered, 0)
    s.update_state_after_alloc(answered, Blocks([1, 2, 3]), 299)
    (load,) = s.build_connector_meta(step()).loads
    assert (load.prompt, load.wait_s) == ("", 0.0)


def test_a_request_sent_alongside_whose_kv_would_be_pulled_computes_its_prompt_here() -> None:
    """A pull says nothing of its prompt: from a prefill instance of another parallel size (pulls by heads), the
    decode side cannot check that the KV is its request's, so it takes none of it."""
    s = decode_side(tp=2)
    params = DecodeParams("t1", 0, Address("127.0.0.1", 21001), prefill_tp=1, alongside_s=90.0).to_dict()
    req = Req("cmpl-a", list(range(300)), params)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, Blocks([5, 6, 7]), 0)
    assert s.build_connector_meta(step()).loads == []


def test_the_prefill_side_tells_its_workers_the_prompt_it_pushes() -> None:
    s = SchedulerSide(parse_connector_config("kv_producer", 21001, "recompute", {"kv_host": "127.0.0.1"}), BS)
    req = Req("p", list(range(300)), PrefillParams("t9", Address("127.0.0.1", 22001)).to_dict())
    s.update_state_after_alloc(req, Blocks([1, 2, 3]), 0)
    new = SimpleNamespace(req_id="p", block_ids=([1, 2, 3],), num_computed_tokens=0)
    (save,) = s.build_connector_meta(step([new], scheduled={"p": 300})).saves
    assert save.prompt == OWN


# The decode side's worker: a push lands only once it says the request's prompt.

def push_all(sender: Any, peer: Address, tid: str, data: list[np.ndarray], prompt: str, blocks: int = 2) -> None:
    deadline = time.monotonic() + 10
    for layer in range(LAYERS):
        sender.push_layer(tid, peer, layer, blocks, (data[layer].data,), deadline, prompt=prompt)


def layers_of(seed: int) -> tuple[list[str], list[np.ndarray]]:
    src = cache(seed)
    return list(src), [np.ascontiguousarray(src[name].numpy()[[0, 1]]).reshape(-1) for name in src]


def test_a_push_of_the_requests_prompt_lands(sides: list[WorkerSide]) -> None:
    with decode_and_sender(sides) as (decode, d_kv, sender, peer):
        names, data = layers_of(11)
        dst = (3, 1)
        decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="r", transfer_id="A1", first_block=0, block_ids=dst,
                                                   prompt=OWN, wait_s=5.0)]))
        push_all(sender, peer, "A1", data, OWN)
        assert wait_for(lambda: "r" in (decode.get_finished(set())[1] or set()), lambda: None), "not reported"
        assert decode.take_load_errors() == set()
        for name, expected in zip(names, data, strict=True):
            assert bytes_of(d_kv[name][list(dst)]) == expected.tobytes(), name


@pytest.mark.parametrize("said", [OTHER, ""])
def test_a_push_of_another_prompt_or_of_none_is_not_landed(sides: list[WorkerSide], said: str) -> None:
    """The decode request went out before the prefill answered, so only the push can say which prompt its KV is
    for: another prompt's KV (the two instances tokenized the request differently), or KV that does not say, is a
    failed load (vLLM computes the prompt), and not a byte of it is written into the blocks."""
    with decode_and_sender(sides) as (decode, d_kv, sender, peer):
        _, data = layers_of(12)
        decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="r", transfer_id="A2", first_block=0, block_ids=(3, 1),
                                                   prompt=OWN, wait_s=5.0)]))
        push_all(sender, peer, "A2", data, said)
        assert wait_for(lambda: decode.take_load_errors() == {3, 1}, lambda: decode.get_finished(set())), \
            "the load did not fail"
        assert not any(t.any() for t in d_kv.values()), "bytes of the push were written into the blocks"
        # What was staged of it is freed.
        assert wait_for(lambda: decode.engine.store.bytes_in_use == 0, lambda: decode.get_finished(set()))


def test_a_load_sent_alongside_waits_for_its_push_to_begin_past_a_transfers_deadline(sides: list[WorkerSide],
                                                                                     ) -> None:
    """The prefill runs while the decode request waits: its push may begin later than a transfer's deadline
    (`transfer_timeout_s`, 10 s here), up to `wait_s`."""
    with decode_and_sender(sides) as (decode, _, sender, peer):
        _, data = layers_of(13)
        decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="r", transfer_id="A3", first_block=0, block_ids=(0,),
                                                   prompt=OWN, wait_s=30.0)]))
        (load,) = decode.loading._loads.values()
        assert load.deadline - time.monotonic() > 25
        push_all(sender, peer, "A3", [d[: d.size // 2] for d in data], OWN, blocks=1)
        assert wait_for(lambda: "r" in (decode.get_finished(set())[1] or set()), lambda: None), "not reported"
        assert decode.take_load_errors() == set()


def test_the_store_keeps_what_a_push_says_of_its_prompt() -> None:
    from p2pkv.engine.metrics import EngineMetrics
    from p2pkv.engine.store import ReceiveStore

    store = ReceiveStore(1 << 20, 60, 64, 2, EngineMetrics())
    push = PushBlocks("s1", 0, 0, 1, 1, 2, prompt=OWN)
    view, ack = store.begin_chunk(push, 64, "peer")
    assert view is not None and ack is not None and ack.accepted
    store.end_chunk(push, True)
    assert store.prompt("s1") == OWN and store.prompt("nothing") is None
    store.refer("s2", "pulled over a device path", "peer", OTHER)
    assert store.prompt("s2") == OTHER and store.state("s2") is StageState.FAILED
    # A prompt's digest is 16 characters: a longer one makes the chunk invalid.
    view, _ = store.begin_chunk(PushBlocks("s3", 0, 0, 1, 1, 2, prompt="x" * 17), 64, "peer")
    assert view is None and store.state("s3") is StageState.FAILED


# The proxy.

class Backend:
    """A stub instance that records what it is asked and when; each request waits until `release` is set (the
    proxy's probes excepted, answered with parallel sizes 1 unless not `sizes`), then answers as `answers` say; one
    whose client went away first is noted as cancelled."""

    def __init__(self, answers: list[str], sizes: bool = True) -> None:
        # one per request: "ok", "get" (a prefill answer holding the KV for a pull), "500", "400", or "wait" (until
        # the client goes away)
        self.answers = answers
        self.sizes = sizes
        self.seen: list[dict[str, Any]] = []
        self.cancelled: list[int] = []
        self.probes = 0
        self.release = threading.Event()
        self.app = self._app()

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"data": [{"id": "tiny"}]}

        @app.post("/v1/completions")
        async def complete(request: Request) -> Any:
            body = await request.json()
            params = body.get("kv_transfer_params") or {}
            if params.get("probe"):
                self.probes += 1
                sizes = {"tp_size": 1, "pp_size": 1} if self.sizes else {}
                return {"choices": [{"text": ""}], "kv_transfer_params": {"p2pkv": 1, "kv_port": 23456,
                                                                          "kv_host": "", **sizes}}
            index = len(self.seen)
            self.seen.append(body)
            if params.get("discard_transfer"):
                return {"choices": [{"text": ""}]}
            asked = sum(not (b.get("kv_transfer_params") or {}).get("discard_transfer") for b in self.seen) - 1
            how = self.answers[asked] if asked < len(self.answers) else "ok"
            deadline = time.monotonic() + 10
            while how == "wait" or not self.release.is_set():
                if await request.is_disconnected():
                    self.cancelled.append(index)
                    return JSONResponse({}, status_code=499)
                if time.monotonic() > deadline:
                    return JSONResponse({"error": {"message": "the stub waited too long"}}, status_code=504)
                await asyncio.sleep(0.01)
            if how in ("500", "400"):
                return JSONResponse({"error": {"message": how, "code": int(how)}}, status_code=int(how))
            if params.get("do_remote_decode"):
                held = {"send_type": "GET", "prefill_kv_address": "127.0.0.1:21001"} if how == "get" else {}
                return {"choices": [{"text": "x"}], "kv_transfer_params": {
                    "p2pkv": 1, "transfer_id": params["transfer_id"], "load_remote_kv": True,
                    "num_prompt_tokens": 5, **held}}
            return {"choices": [{"text": "abc"}]}

        return app


@contextmanager
def cluster(prefill: Backend, decode: Backend, prefill_kv: bool = True, **options: Any) -> Iterator[str]:
    """The two stubs, named with their KV addresses, behind a proxy that has probed both (the probes say their
    parallel sizes, which must be known to be equal for a decode request to go alongside)."""
    with ExitStack() as stack:
        p = stack.enter_context(serve(prefill.app)) + ("@127.0.0.1:21001" if prefill_kv else "")
        d = stack.enter_context(serve(decode.app)) + "@127.0.0.1:23456"
        proxy = stack.enter_context(serve(proxy_with([p], d, **options)))
        assert wait_for(lambda: prefill.probes > 0 and decode.probes > 0, lambda: time.sleep(0.01))
        time.sleep(0.2)  # what the probes said is taken in
        yield proxy


def ask(proxy: str) -> httpx.Response:
    return httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)


def test_the_decode_request_goes_out_before_the_prefill_answers() -> None:
    """The prefill instance answers only once the decode instance has the request: without the decode request sent
    alongside, the prefill would wait out its 10 s and fail."""
    prefill, decode = Backend(["ok"]), Backend(["ok"])
    decode.release.set()
    with cluster(prefill, decode, prefill_timeout_s=30) as proxy:

        def release_once_decode_has_it() -> None:
            deadline = time.monotonic() + 10
            while not decode.seen and time.monotonic() < deadline:
                time.sleep(0.005)
            prefill.release.set()

        threading.Thread(target=release_once_decode_has_it, daemon=True).start()
        answer = ask(proxy)
        assert metric(proxy, 'p2pkv_proxy_decode_alongside_total{outcome="answered"}') == 1
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "abc"
    (sent,) = decode.seen
    params = sent["kv_transfer_params"]
    assert params["transfer_id"] == prefill.seen[0]["kv_transfer_params"]["transfer_id"]
    assert params["alongside_s"] == 30 and params["num_prompt_tokens"] == 0
    assert params["prefill_kv_address"] == "127.0.0.1:21001" and "send_type" not in params
    assert answer.headers["x-p2pkv-prefill"] != "none"
    assert answer.headers["x-p2pkv-transfer-id"] == params["transfer_id"]


def test_a_failed_prefill_cancels_the_decode_request_and_the_request_goes_again() -> None:
    """The decode request waits for KV that will not come: it is cancelled (vLLM aborts it), and the request goes
    the other way as a new transfer; with no other prefill instance, to the decode instance alone."""
    prefill, decode = Backend(["500"]), Backend(["wait"])
    prefill.release.set()
    decode.release.set()
    with cluster(prefill, decode) as proxy:
        answer = ask(proxy)
        assert metric(proxy, 'p2pkv_proxy_decode_alongside_total{outcome="prefill_failed"}') == 1
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "abc"
    assert decode.cancelled == [0], "the decode request sent alongside was not cancelled"
    first = decode.seen[0]["kv_transfer_params"]
    asked = [b for b in decode.seen[1:] if "discard_transfer" not in (b.get("kv_transfer_params") or {})]
    assert [b.get("kv_transfer_params") for b in asked] == [None]  # computed there alone
    assert answer.headers["x-p2pkv-transfer-id"] != first["transfer_id"]
    assert answer.headers["x-p2pkv-prefill"] == "none"


def test_a_failed_decode_cancels_the_prefill_and_the_request_goes_again() -> None:
    prefill, decode = Backend(["wait"]), Backend(["500", "ok"])
    prefill.release.set()
    decode.release.set()
    with cluster(prefill, decode) as proxy:
        answer = ask(proxy)
        assert metric(proxy, 'p2pkv_proxy_decode_alongside_total{outcome="decode_failed"}') == 1
        assert metric(proxy, "p2pkv_proxy_reroutes_total") == 1
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "abc"
    assert wait_for(lambda: prefill.cancelled == [0], lambda: None), "the prefill was not cancelled"
    # The cancelled prefill is discarded there; the only prefill instance was tried, so the request goes to the
    # decode instance alone.
    assert [b["kv_transfer_params"].get("discard_transfer", False) for b in prefill.seen] == [False, True]
    assert len(decode.seen) == 2 and decode.seen[1].get("kv_transfer_params") is None


def test_a_prefill_that_rejects_the_request_is_the_answer_and_the_decode_request_is_cancelled() -> None:
    prefill, decode = Backend(["400"]), Backend(["wait"])
    prefill.release.set()
    decode.release.set()
    with cluster(prefill, decode) as proxy:
        answer = ask(proxy)
    assert answer.status_code == 400
    assert decode.cancelled == [0]


def test_a_prefill_instance_that_holds_its_kv_for_pulls_is_prefilled_first_from_then_on() -> None:
    """Its own send_type GET, which the proxy learns from its answer: the decode request sent alongside waits for
    a push that will not come, so it is cancelled and the request goes again, prefilled first; so do the next."""
    prefill, decode = Backend(["get", "get", "get"]), Backend(["wait", "ok", "ok"])
    prefill.release.set()
    decode.release.set()
    with cluster(prefill, decode) as proxy:
        first, second = ask(proxy), ask(proxy)
        assert metric(proxy, 'p2pkv_proxy_decode_alongside_total{outcome="unsuited"}') == 2
    assert first.status_code == second.status_code == 200
    assert decode.cancelled == [0]
    asked = [b["kv_transfer_params"] for b in decode.seen if not b["kv_transfer_params"].get("discard_transfer")]
    assert [p.get("send_type") for p in asked] == [None, "GET", "GET"]
    assert "alongside_s" in asked[0] and not any("alongside_s" in p for p in asked[1:])
    assert len([b for b in prefill.seen if not b["kv_transfer_params"].get("discard_transfer")]) == 3


def test_a_decode_answer_before_the_prefills_is_passed_on_without_waiting_for_it() -> None:
    """The decode instance answered before the prefill did (its KV landed and the prefill instance is slow to
    answer, or it held the prompt): the answer goes to the client at once, naming the prefill instance asked, and
    the prefill ends on its own."""
    prefill, decode = Backend(["ok"]), Backend(["ok"])
    decode.release.set()
    with cluster(prefill, decode) as proxy:
        started = time.monotonic()
        answer = ask(proxy)
        elapsed = time.monotonic() - started
        prefill.release.set()
        assert wait_for(lambda: metric(proxy, "p2pkv_proxy_prefill_seconds_count") == 1, lambda: None)
    assert answer.status_code == 200 and answer.headers["x-p2pkv-prefill"] != "none"
    assert elapsed < 5, "the answer waited for the prefill"
    assert prefill.cancelled == []


@pytest.mark.parametrize(("why", "prefill_sizes", "options", "unsuited"), [
    # a static prefill instance named without its KV address: the decode request could not say where the KV is
    ("no KV address", True, {"prefill_kv": False}, 1),
    # its probe answers without its parallel sizes: another size would hold the KV for a pull, which says nothing
    # of its prompt
    ("sizes not known", False, {}, 1),
    ("--decode-alongside off", True, {"decode_alongside": False}, 0),
])
def test_the_decode_request_goes_once_the_prefill_answered_where_it_cannot_go_alongside(
        why: str, prefill_sizes: bool, options: dict[str, Any], unsuited: int) -> None:
    prefill, decode = Backend(["ok"], sizes=prefill_sizes), Backend(["ok"])
    prefill.release.set()
    decode.release.set()
    with cluster(prefill, decode, **options) as proxy:
        assert ask(proxy).status_code == 200
        assert metric(proxy, 'p2pkv_proxy_decode_alongside_total{outcome="unsuited"}') == unsuited, why
        assert metric(proxy, 'p2pkv_proxy_decode_alongside_total{outcome="answered"}') == 0, why
    # The prefill's own params, from its answer.
    assert decode.seen[0]["kv_transfer_params"]["num_prompt_tokens"] == 5, why
    assert "alongside_s" not in decode.seen[0]["kv_transfer_params"], why
