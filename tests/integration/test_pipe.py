"""1P1D on real vLLM with pulls by pipe (the nccl transport's engine protocol), over gloo pipes between the
instances' host caches (`P2PKV_PIPE=gloo`, `P2PKV_STAGE_KV=1`): the decode worker makes a communicator with the
prefill worker off the request path, pulls carry bytes until it is ready, then go through it. The instances run
PUT_ASYNC: both make pipes, so the decode side asks for pulls instead of pushes (`pull_over_device`); a GET request
goes the same way. Output equals a colocated instance throughout. NCCL itself is checked on a GPU
(scripts/gpu_check.sh)."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from p2pkv.kv.pipes import PIPE_ENV
from p2pkv.kv.staging import STAGE_ENV
from p2pkv.params import PrefillParams
from tests.integration.conftest import (
    BLOCK_SIZE,
    LAYERS,
    LEFT,
    Oracle,
    UpCluster,
    greedy,
    ids_and_logprobs,
    kv_bytes_per_block_and_layer,
    metric,
    prompt,
    served_like_colocated,
    two_steps,
    up_with_colocated,
)

pytestmark = pytest.mark.vllm
BY_PIPE = '{transport="gloo"}'


@pytest.fixture(scope="module")
def piped(tiny_model: str, tmp_path_factory: pytest.TempPathFactory, oracle: Oracle) -> Iterator[dict[str, Any]]:
    extra = {"transport": "nccl", "transfer_timeout_s": 5.0}
    with up_with_colocated(tiny_model, tmp_path_factory.mktemp("pipe"), extra, [], (),
                           {STAGE_ENV: "1", PIPE_ENV: "gloo"}, shared=oracle) as (proc, info, colocated):
        info.update(model=tiny_model, colocated=colocated, up=proc)
        yield info


def test_pushes_are_left_for_pulls_that_go_by_pipe_once_it_is_made(piped: dict[str, Any]) -> None:
    prefill = next(i for i in piped["instances"] if i["role"] == "kv_producer")
    decode = next(i for i in piped["instances"] if i["role"] == "kv_consumer")
    expected, by_pipe, pipe_pulls, served = 0, 0.0, 0, 0
    deadline = time.monotonic() + 120
    for i in range(12):  # the first pulls carry bytes while the pipe is made; then 3 go by pipe
        expected += served_like_colocated(piped, f"pipe{i}", (60, 129, 300)[i % 3])
        served += 1
        previous, by_pipe = by_pipe, metric(decode["metrics"], "p2pkv_bytes_received_total" + BY_PIPE)
        pipe_pulls += by_pipe > previous
        if pipe_pulls == 3:
            break
        assert time.monotonic() < deadline
    assert pipe_pulls == 3, f"{pipe_pulls} of 12 pulls went by pipe"
    assert metric(prefill["metrics"], "p2pkv_bytes_sent_total" + BY_PIPE) == by_pipe
    assert metric(decode["metrics"], "p2pkv_bytes_loaded_total") == expected
    # The pulls by pipe landed in the cache directly: the only copies into the decode cache are the bytes pulls'.
    into_cache = metric(decode["metrics"], 'p2pkv_device_copy_bytes_total{direction="to_device"}')
    assert into_cache == expected - by_pipe
    assert metric(prefill["metrics"], LEFT) == served, "every PUT_ASYNC transfer was left for a pull"
    assert metric(prefill["metrics"], 'p2pkv_transfers_total{direction="send",outcome="ok"}') == 0, "none pushed"


def test_a_get_request_goes_by_pipe(piped: dict[str, Any]) -> None:
    cluster = UpCluster(piped["up"], piped, piped["colocated"], piped["model"])
    decode = cluster.instance("kv_consumer")
    before = metric(decode["metrics"], "p2pkv_bytes_received_total" + BY_PIPE)
    length = 200
    text = prompt("pipe-get", length)
    returned, answer = two_steps(cluster, text, PrefillParams(uuid.uuid4().hex, None, pull=True))
    assert returned.pull
    assert ids_and_logprobs(answer)[0] == ids_and_logprobs(greedy(cluster.colocated, cluster.model, text))[0]
    moved = metric(decode["metrics"], "p2pkv_bytes_received_total" + BY_PIPE) - before
    assert moved == math.ceil((length - 1) / BLOCK_SIZE) * kv_bytes_per_block_and_layer() * LAYERS
