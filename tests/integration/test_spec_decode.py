"""1P1D with speculative decoding on real vLLM (CPU, tiny model, float32), against a colocated instance with the
same speculative decoding. vLLM's ngram proposer on the decode instance only: the decode instance loads the
prompt's KV by transfer and decodes several tokens a step, and its answers equal the colocated instance's; a stream
cut off after events of several tokens goes on with the same text. An EAGLE draft head (the project's own, random
weights) on both instances: its draft layer's KV moves with the model's, and the answers equal the colocated
instance's."""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from p2pkv.tinymodel import TinyModelSpec, write_tiny_eagle
from tests.integration.conftest import (
    BLOCK_SIZE,
    TRANSFER_TIMEOUT_S,
    complete,
    cut_stream,
    described_cluster,
    instance_of,
    kv_bytes_per_block_and_layer,
    metric,
    prompt,
)

pytestmark = pytest.mark.vllm
SPECULATIVE = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                          "prompt_lookup_max": 4})
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def spec_cluster(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Speculative decoding on the decode instance only (`p2pkv up --decode-vllm-args`), as deployed."""
    up_args = ("--decode-vllm-args", f"--speculative-config {shlex.quote(SPECULATIVE)}")
    with described_cluster(tiny_model, tmp_path_factory.mktemp("spec"), {"transfer_timeout_s": TRANSFER_TIMEOUT_S},
                           [], up_args, ("--speculative-config", SPECULATIVE)) as info:
        yield info


def _spec_tokens(http: str, kind: str) -> float:
    """Draft tokens (`kind` "draft": proposed, "accepted": kept by vLLM's verification) on the instance serving
    `http` (its own metrics)."""
    text = httpx.get(f"http://{http}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"vllm:spec_decode_num_{kind}_tokens_total{{"))


def _accepted(http: str) -> float:
    return _spec_tokens(http, "accepted")


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


@pytest.fixture(scope="module")
def eagle_cluster(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The same EAGLE head on every instance (`p2pkv up -- --speculative-config ...`), as docs/troubleshooting.md
    says to."""
    head = write_tiny_eagle(tmp_path_factory.mktemp("eagle-head"))
    spec = json.dumps({"method": "eagle", "model": str(head), "num_speculative_tokens": 3})
    with described_cluster(tiny_model, tmp_path_factory.mktemp("eagle"), {"transfer_timeout_s": TRANSFER_TIMEOUT_S},
                           ["--speculative-config", spec], colocated_args=("--speculative-config", spec)) as info:
        yield info


def test_an_eagle_heads_draft_layer_moves_with_the_model_and_answers_equal_a_colocated_instances(
        eagle_cluster: dict[str, Any]) -> None:
    decode = instance_of(eagle_cluster, "kv_consumer")
    loaded, drafted = metric(decode["metrics"], "p2pkv_bytes_loaded_total"), _spec_tokens(decode["http"], "draft")
    lengths = (150, 290, 333)
    for i, length in enumerate(lengths):
        body = _body(eagle_cluster, f"eagle-{i}", length)
        answer = complete(eagle_cluster["proxy"], body)
        assert answer["choices"][0]["text"] == complete(eagle_cluster["colocated"], body)["choices"][0]["text"], i
        assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    # Every block of each prompt but its last token, in each of the model's layers and the head's one.
    blocks = sum(math.ceil((n - 1) / BLOCK_SIZE) for n in lengths)
    layers = TinyModelSpec().num_layers + 1
    moved = metric(decode["metrics"], "p2pkv_bytes_loaded_total") - loaded
    assert moved == blocks * layers * kv_bytes_per_block_and_layer()
    assert _spec_tokens(decode["http"], "draft") > drafted, "the decode instance drafted with the head"
