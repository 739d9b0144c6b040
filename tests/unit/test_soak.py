"""The soak benchmark's driver, against a stub HTTP server (its own logic only; the benchmark itself runs a real
cluster): failures are counted, whatever the body, and the memory mark is taken while requests still run, or not
at all when the run ends before it, without hanging."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from p2pkv.bench.cluster import Process, wait_for_huge_pages
from p2pkv.bench.soak import SoakResult, _drive, _noting_mark


class _Handler(BaseHTTPRequestHandler):
    """Reads a JSON body and answers 200 with `answer(body)`."""

    def answer(self, body: dict[str, object]) -> bytes:
        raise NotImplementedError

    def do_POST(self) -> None:
        reply = self.answer(json.loads(self.rfile.read(int(self.headers["content-length"]))))
        self.send_response(200)
        self.send_header("content-length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: object) -> None:
        pass


class _Stub(_Handler):
    """Answers a completion whose prompt starts with an even number, and garbage (not JSON) to the others."""

    def answer(self, body: dict[str, object]) -> bytes:
        number = int(str(body["prompt"]).split()[0])
        return json.dumps({"choices": [{"text": "x"}]}).encode() if number % 2 == 0 else b"<html>oops"


@pytest.fixture
def stub() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join(5)


def test_drive_counts_bodies_that_are_not_json_as_failures_and_reaches_the_mark(stub: str) -> None:
    result = SoakResult(10, 0, 0.0)
    marked = asyncio.Event()
    asyncio.run(asyncio.wait_for(_drive(stub, "m", 10, 3, 5, marked, result), 30))
    assert result.failures == 5
    assert marked.is_set()


def test_the_mark_is_taken_while_the_run_goes_on() -> None:
    marked, noted = asyncio.Event(), asyncio.Event()

    async def drive() -> None:
        marked.set()
        await noted.wait()  # the rest of the run needs the mark to have been taken

    asyncio.run(asyncio.wait_for(_noting_mark(drive(), marked, noted.set), 5))
    assert noted.is_set()


def test_a_run_that_fails_before_the_mark_ends_without_it() -> None:
    marked = asyncio.Event()
    taken: list[bool] = []

    async def drive() -> None:
        await asyncio.sleep(0.01)
        raise RuntimeError("the client broke")

    with pytest.raises(RuntimeError, match="the client broke"):
        asyncio.run(asyncio.wait_for(_noting_mark(drive(), marked, lambda: taken.append(True)), 5))
    assert not taken


def test_a_digest_mismatch_fails_the_soak() -> None:
    clean = SoakResult(10, 0, 1.0, digests={'p2pkv_digests_total{direction="receive",outcome="ok"}': 10.0})
    assert clean.ok
    damaged = SoakResult(10, 0, 1.0, digests={'p2pkv_digests_total{direction="receive",outcome="ok"}': 9.0,
                                              'p2pkv_digests_total{direction="receive",outcome="mismatch"}': 1.0})
    assert not damaged.ok


class _Server(ThreadingHTTPServer):
    request_queue_size = 64  # the default 5 resets connections beyond it: every request of a run at once fits


def _mixed_run(handler: type[_Handler], requests: int, concurrency: int) -> SoakResult:
    """A mixed soak's requests against a stub server that answers with `handler`."""
    server = _Server(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        result = SoakResult(requests, 0, 0.0)
        url = f"http://127.0.0.1:{server.server_address[1]}"
        asyncio.run(asyncio.wait_for(_drive(url, "m", requests, concurrency, requests // 2, asyncio.Event(), result,
                                            mixed=True), 30))
    finally:
        server.shutdown()
        thread.join(5)
    return result


class _ShapesStub(_Handler):
    """Records each body and answers it in full: a stream to its end, a choice per prompt and sample."""

    bodies: list[dict[str, object]] = []

    def answer(self, body: dict[str, object]) -> bytes:
        _ShapesStub.bodies.append(body)
        return _in_full(body)


def _in_full(body: dict[str, object]) -> bytes:
    prompts = len(body["prompt"]) if isinstance(body["prompt"], list) else 1
    if body.get("stream"):
        return b'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n\n'
    samples = body.get("n", 1)
    choices = prompts * (samples if isinstance(samples, int) else 1)
    return json.dumps({"choices": [{"text": "x"}] * choices}).encode()


def test_a_mixed_soak_sends_every_shape_and_checks_each_answer_whole() -> None:
    from p2pkv.bench.soak import SHAPES

    result = _mixed_run(_ShapesStub, 2 * len(SHAPES), 3)
    assert result.failures == 0
    bodies = _ShapesStub.bodies
    assert len(bodies) == 2 * len(SHAPES)
    assert sum(b.get("n") == 3 for b in bodies) == 2 and sum(bool(b.get("stream")) for b in bodies) == 4
    assert sum(isinstance(b["prompt"], list) for b in bodies) == 4 and sum(b["prompt"] == "x" for b in bodies) == 2
    assert sum(isinstance(b["prompt"], list) and b.get("stream") is True for b in bodies) == 2
    assert sum("prompt_logprobs" in b for b in bodies) == 2
    whole = [b["prompt"] for b in bodies if isinstance(b["prompt"], str) and b["prompt"].startswith("whole")]
    assert len(whole) == 2 and len(whole[0]) == 257
    assert sum(b.get("max_tokens") == 64 and b.get("ignore_eos") is True for b in bodies) == 2  # "leave"
    assert result.left == 0  # answered at once here: nobody had to leave


class _SlowStub(_Handler):
    """Answers every request in full after 1 s."""

    def answer(self, body: dict[str, object]) -> bytes:
        import time

        time.sleep(1.0)
        return _in_full(body)


def test_clients_that_leave_on_purpose_are_counted_apart_from_failures() -> None:
    from p2pkv.bench.soak import SHAPES, leave_after

    result = _mixed_run(_SlowStub, 2 * len(SHAPES), 2 * len(SHAPES))
    assert result.left == 2 and result.failures == 0
    waits = [w for i in range(7 * len(SHAPES)) if (w := leave_after(i, True)) is not None]
    assert len(set(waits)) == 7 and 0.05 <= min(waits) and max(waits) <= 0.5
    assert leave_after(SHAPES.index("leave"), False) is None


def test_kv_held_at_the_end_fails_the_soak() -> None:
    assert SoakResult(10, 0, 1.0, kv_usage={"prefill": 0.0, "decode": 0.0}).ok
    assert not SoakResult(10, 0, 1.0, kv_usage={"prefill": 0.0, "decode": 0.002}).ok


def test_an_answer_short_of_a_choice_or_a_stream_cut_short_is_a_failure() -> None:
    import httpx

    from p2pkv.bench.soak import answered

    batch = {"prompt": ["a", "b"], "n": 2}
    assert answered(batch, httpx.Response(200, json={"choices": [{}] * 4}))
    assert not answered(batch, httpx.Response(200, json={"choices": [{}] * 3}))
    stream = {"prompt": "a", "stream": True}
    assert answered(stream, httpx.Response(200, text='data: {}\n\ndata: [DONE]\n\n'))
    assert not answered(stream, httpx.Response(200, text='data: {}\n\n'))
    assert not answered({"prompt": "a"}, httpx.Response(500, json={"choices": [{}]}))


class _PausingStub(_Handler):
    """Answers completions in full, every third cut short by a pause (finish_reason "abort"); counts pauses and
    resumes, the pauses answering `pause_status`."""

    pause_status = 200
    rpc_status = 200
    calls: list[str] = []
    rpc_bodies: list[object] = []

    def answer(self, body: dict[str, object]) -> bytes:
        number = int(str(body["prompt"]).split()[0])
        reason = "abort" if number % 3 == 0 else "length"
        return json.dumps({"choices": [{"text": "x", "finish_reason": reason}]}).encode()

    def do_POST(self) -> None:
        if self.path in ("/pause", "/resume", "/collective_rpc"):
            _PausingStub.calls.append(self.path)
            status = {"/pause": _PausingStub.pause_status, "/collective_rpc": _PausingStub.rpc_status}.get(self.path,
                                                                                                          200)
            if self.path == "/collective_rpc":
                _PausingStub.rpc_bodies.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(status)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")
            return
        super().do_POST()


@pytest.mark.parametrize("pause_status", [200, 500])
def test_a_soak_with_pauses_counts_aborted_requests_apart_and_fails_on_a_failed_pause(pause_status: int) -> None:
    """`--pause-every`: the cluster is paused and resumed through the proxy while requests go; those a pause cut
    short (vLLM's finish_reason "abort") are counted apart, not as failures; a pause that fails fails the soak."""
    from p2pkv.bench.soak import _with_pauses

    _PausingStub.pause_status, _PausingStub.calls = pause_status, []
    server = _Server(("127.0.0.1", 0), _PausingStub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    async def slow_drive(url: str, result: SoakResult) -> None:
        await asyncio.sleep(0.5)  # long enough for a pause every 0.1 s to come
        await _drive(url, "m", 30, 4, 15, asyncio.Event(), result)

    try:
        result = SoakResult(30, 0, 0.0)
        url = f"http://127.0.0.1:{server.server_address[1]}"
        asyncio.run(asyncio.wait_for(_with_pauses(slow_drive(url, result), url, 0.1, result), 30))
    finally:
        server.shutdown()
        thread.join(5)
    assert result.failures == 0 and result.aborted == 10
    assert result.pauses and _PausingStub.calls[:2] == ["/pause", "/resume"]
    assert result.pause_failures == (0 if pause_status == 200 else len(result.pauses))
    result.rss_mark_mb = result.rss_end_mb = {}
    assert result.ok is (pause_status == 200)


@pytest.mark.parametrize("rpc_status", [200, 500])
def test_a_soak_that_reloads_weights_reloads_them_in_each_pause_and_fails_on_a_failed_reload(rpc_status: int) -> None:
    """`--reload-weights`: in each pause every instance reloads its weights from the model directory, through the
    proxy's `/collective_rpc`, before the resume; a reload that fails fails the soak."""
    from p2pkv.bench.soak import _with_pauses

    _PausingStub.pause_status, _PausingStub.rpc_status = 200, rpc_status
    _PausingStub.calls, _PausingStub.rpc_bodies = [], []
    server = _Server(("127.0.0.1", 0), _PausingStub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    async def slow_drive(url: str, result: SoakResult) -> None:
        await asyncio.sleep(0.5)
        await _drive(url, "m", 30, 4, 15, asyncio.Event(), result)

    try:
        result = SoakResult(30, 0, 0.0)
        url = f"http://127.0.0.1:{server.server_address[1]}"
        asyncio.run(asyncio.wait_for(_with_pauses(slow_drive(url, result), url, 0.1, result, "/models/m"), 30))
    finally:
        server.shutdown()
        thread.join(5)
    assert result.failures == 0 and result.pauses
    assert _PausingStub.calls[:3] == ["/pause", "/collective_rpc", "/resume"]
    assert len(result.reloads) == len(result.pauses) == _PausingStub.calls.count("/collective_rpc")
    assert all(b == {"method": "reload_weights", "kwargs": {"weights_path": "/models/m"}}
               for b in _PausingStub.rpc_bodies)
    assert result.pause_failures == (0 if rpc_status == 200 else len(result.pauses))
    result.rss_mark_mb = result.rss_end_mb = {}
    assert result.ok is (rpc_status == 200)


def test_the_soak_waits_until_each_kv_cache_handed_back_is_faulted_in_again(tmp_path: Path) -> None:
    """Resident memory is noted only once every worker that handed its KV cache back to be faulted in again in
    huge pages has done so (its log says when): a mark taken meanwhile counts the rest of the fault-in as growth,
    and a short soak failed on it (prefill worker 41.8%, decode worker 22.8%, 400 requests)."""
    advised = ("INFO [p2pkv.memory.huge] KV cache: 1022 MiB advised for 2 MiB pages, 1022 MiB of it handed back "
               "(0.14 s), to be faulted in again as such on a thread of its own (THP: madvise)\n")
    done = "INFO [p2pkv.memory.huge] KV cache: 1022 MiB faulted in again, 1022 MiB now in huge pages (20.55 s)\n"
    procs = [Process(name, [], tmp_path / f"{name}.log", {}, "") for name in ("prefill", "decode")]
    procs[0].log_path.write_text("starting\n" + advised)
    procs[1].log_path.write_text("INFO KV cache: left in its pages (THP: never)\n")  # nothing handed back
    said: list[str] = []
    assert not wait_for_huge_pages(procs, timeout_s=0.5, progress=said.append)
    assert said == ["prefill: its KV cache was not faulted in again within 0 s; going on"]

    def finish() -> None:
        time.sleep(0.6)
        with procs[0].log_path.open("a") as log:
            log.write(done)

    writer = threading.Thread(target=finish)
    started = time.monotonic()
    writer.start()
    assert wait_for_huge_pages(procs, timeout_s=30, progress=said.append)
    assert 0.5 < time.monotonic() - started < 5
    writer.join()
    procs[1].log_path.write_text(advised + "ERROR KV cache: faulting in huge pages failed\n")
    assert wait_for_huge_pages(procs[1:], timeout_s=0.5, progress=said.append), "failed: nothing more to wait for"
