"""`p2pkv up --decode-extra-config '{"send_type": "GET"}'` on real vLLM (CPU, tiny model): the decode instance
pulls its KV while the prefill instance's own send_type is PUT_ASYNC (push or pull chosen per decode instance). The
decode instance says so in its heartbeats, the proxy asks the prefill instance to hold each transfer for a pull, and
answers equal a colocated instance's. Then the prefill instance is killed and started again: the decode instance
pulls from its new start over new connections, and no load fails."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.conftest import (
    Oracle,
    greedy,
    ids_and_logprobs,
    instance_of,
    metric,
    prompt,
    record_starts,
    started_again,
    up_with_colocated,
)

pytestmark = pytest.mark.vllm
PULLS = 'p2pkv_transfers_total{direction="pull",outcome="ok"}'
SENDS = 'p2pkv_transfers_total{direction="send",outcome="ok"}'
FAILED_LOADS = 'p2pkv_transfers_total{direction="load",outcome="failed"}'


@pytest.fixture(scope="module")
def pulling(tiny_model: str, tmp_path_factory: pytest.TempPathFactory, oracle: Oracle) -> Iterator[dict[str, Any]]:
    up_args = ("--send-type", "PUT_ASYNC", "--decode-extra-config", '{"send_type": "GET"}')
    with up_with_colocated(tiny_model, tmp_path_factory.mktemp("pulling"), {}, [], up_args, shared=oracle
                           ) as (_, info, colocated):
        info.update(model=tiny_model, colocated=colocated)
        record_starts(info)
        yield info


def test_a_decode_instance_that_pulls_gets_its_kv_by_pulls_from_a_pushing_prefill_instance(
        pulling: dict[str, Any]) -> None:
    prefill, decode = instance_of(pulling, "kv_producer"), instance_of(pulling, "kv_consumer")
    pulled, sent = metric(decode["metrics"], PULLS), metric(prefill["metrics"], SENDS)
    for i, length in enumerate((150, 333)):
        text = prompt(f"pulling-{i}", length)
        answer, reference = greedy(pulling["proxy"], pulling["model"], text), greedy(pulling["colocated"],
                                                                                       pulling["model"], text)
        assert ids_and_logprobs(answer)[0] == ids_and_logprobs(reference)[0]
        assert metric(decode["metrics"], PULLS) == pulled + i + 1, "the decode instance pulled the KV"
    assert metric(prefill["metrics"], SENDS) == sent, "nothing was pushed"
    assert metric(decode["metrics"], "p2pkv_bytes_loaded_total") > 0


def test_the_decode_instance_pulls_from_a_prefill_instance_started_again(pulling: dict[str, Any]) -> None:
    """The prefill instance is killed and started again from its command line (the same ports, a new start). The
    decode worker's connection to the old one is dead; its pulls from the new one go over new connections: both
    requests' KV is pulled, no load fails, and the answers are the colocated instance's."""
    prefill, decode = instance_of(pulling, "kv_producer"), instance_of(pulling, "kv_consumer")
    index = pulling["instances"].index(prefill)
    with started_again(pulling, index, "prefill-restarted"):
        pulled, failed = metric(decode["metrics"], PULLS), metric(decode["metrics"], FAILED_LOADS)
        for i, length in enumerate((180, 260)):
            text = prompt(f"pulling-again-{i}", length)
            answer = greedy(pulling["proxy"], pulling["model"], text)
            reference = greedy(pulling["colocated"], pulling["model"], text)
            assert ids_and_logprobs(answer)[0] == ids_and_logprobs(reference)[0]
            assert metric(decode["metrics"], PULLS) == pulled + i + 1, "pulled from the new start"
        assert metric(decode["metrics"], FAILED_LOADS) == failed
        assert metric(prefill["metrics"], SENDS) == 0, "nothing was pushed"
