"""1P1D with speculative decoding (vLLM's ngram proposer) on the decode instance, on real vLLM (CPU, tiny model,
float32), against a colocated instance with the same speculative decoding: the decode instance loads the prompt's
KV by transfer and decodes several tokens a step, and its answers equal the colocated instance's; a stream cut off
after events of several tokens goes on with the same text."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.integration.conftest import (
    TRANSFER_TIMEOUT_S,
    complete,
    cut_stream,
    instance_of,
    metric,
    up_with_colocated,
)
from tests.integration.test_disagg import prompt

pytestmark = pytest.mark.vllm
SPECULATIVE = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                          "prompt_lookup_max": 4})
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def spec_cluster(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Speculative decoding on the decode instance only (`p2pkv up --decode-vllm-args`), as deployed."""
    up_args = ("--decode-vllm-args", f"--speculative-config {shlex.quote(SPECULATIVE)}")
    with up_with_colocated(tiny_model, tmp_path_factory.mktemp("spec"), {"transfer_timeout_s": TRANSFER_TIMEOUT_S},
                           [], up_args, colocated_args=("--speculative-config", SPECULATIVE)) as (_, info, colocated):
        info.update(model=tiny_model, colocated=colocated)
        yield info


def _accepted(http: str) -> float:
    """Draft tokens vLLM's verification accepted on the instance serving `http` (its own metrics)."""
    text = httpx.get(f"http://{http}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:spec_decode_num_accepted_tokens_total{"))


def _body(info: dict[str, Any], tag: str, length: int) -> dict[str, Any]:
    return {"model": info["model"], "prompt": prompt(tag, length), "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}


def test_greedy_answers_with_speculative_decoding_equal_a_colocated_instances(spec_cluster: dict[str, Any]) -> None:
    decode = instance_of(spec_cluster, "kv_consumer")
    loaded, accepted = metric(decode["metrics"], "p2pkv_bytes_loaded_total"), _accepted(decode["http"])
    for i, length in enumerate((150, 290, 333)):
        body = _body(spec_cluster, f"spec-{i}", length)
        answer = complete(spec_cluster["proxy"], body)
        assert answer["choices"][0]["text"] == complete(spec_cluster["colocated"], body)["choices"][0]["text"], i
        assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    assert metric(decode["metrics"], "p2pkv_bytes_loaded_total") > loaded, "the KV came by transfer"
    assert _accepted(decode["http"]) > accepted, "the decode instance decoded several tokens a step"
    assert _accepted(instance_of(spec_cluster, "kv_producer")["http"]) == 0, "no speculative decoding on prefill"


def test_a_stream_cut_off_after_events_of_several_tokens_goes_on_with_the_same_text(
        spec_cluster: dict[str, Any]) -> None:
    """Cut after 6 events, the last of several tokens (this prompt's stream; the proxy before resumes learned where
    such an event's text ended did not resume it)."""
    body = _body(spec_cluster, "cutspec-2", 200)
    events, metrics = cut_stream(spec_cluster, "/v1/completions", {**body, "stream": True}, events=6)
    assert not [e for e in events if "error" in e], events
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == complete(spec_cluster["colocated"], body)["choices"][0]["text"]
    assert "p2pkv_proxy_stream_resumes_total 1.0" in metrics
