"""1P1D on real vLLM with the GPU path's logic (`P2PKV_STAGE_KV=1`) in GET mode: the decode instance opens the
prefill instance's exported cache and copies the blocks it needs straight into its own (cuda_ipc's protocol, with
process_vm_readv standing in for CUDA IPC): no host buffer on either side, output equal to a colocated instance."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

from p2pkv.staging import STAGE_ENV
from tests.integration.conftest import BLOCK_SIZE, kv_bytes_per_block_and_layer, metric, up_with_colocated
from tests.integration.test_disagg import LAYERS, greedy, ids_and_logprobs, prompt

pytestmark = pytest.mark.vllm
BY_REFERENCE = '{transport="host_ipc"}'


@pytest.fixture(scope="module")
def staged_get(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    extra = {"send_type": "GET", "transfer_timeout_s": 5.0}
    with up_with_colocated(tiny_model, tmp_path_factory.mktemp("staged"), extra, [], (),
                           {STAGE_ENV: "1"}) as (_, info, colocated):
        info.update(model=tiny_model, colocated=colocated)
        yield info


def served_like_colocated(info: dict[str, Any], tag: str, length: int) -> int:
    """One greedy request through the proxy, checked against the colocated instance and for its prompt's KV
    loaded from the transfer; the bytes that transfer moved."""
    text = prompt(tag, length)
    answer = greedy(info["proxy"], info["model"], text)
    reference = greedy(info["colocated"], info["model"], text)
    assert ids_and_logprobs(answer)[0] == ids_and_logprobs(reference)[0]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == length - 1
    return math.ceil((length - 1) / BLOCK_SIZE) * kv_bytes_per_block_and_layer() * LAYERS


def test_get_pulls_copy_cache_to_cache_and_match_colocated(staged_get: dict[str, Any]) -> None:
    prefill = next(i for i in staged_get["instances"] if i["role"] == "kv_producer")
    decode = next(i for i in staged_get["instances"] if i["role"] == "kv_consumer")
    expected = 0
    for i, length in enumerate([60, 129, 300]):
        expected += served_like_colocated(staged_get, f"staged{i}", length)
    assert metric(decode["metrics"], "p2pkv_bytes_received_total" + BY_REFERENCE) == expected
    assert metric(prefill["metrics"], "p2pkv_bytes_sent_total" + BY_REFERENCE) == expected
    assert metric(decode["metrics"], "p2pkv_bytes_loaded_total") == expected
    for instance in (prefill, decode):  # nothing went through a host buffer
        for direction in ("to_host", "to_device"):
            series = f'p2pkv_device_copy_bytes_total{{direction="{direction}"}}'
            assert metric(instance["metrics"], series) == 0
