"""1P1D on real vLLM (CPU) whose instances run two models of one config: the decode instance loads the tiny model
written with another seed (served under the same name), as a deployment that rolled a new fine-tune out to one side
only. Their KV has the same shape and the same model settings; exchanged, the prefill instance's KV would make the
decode instance answer as neither model does, without an error. The weights' fingerprints (`p2pkv.weights`) differ,
so the decode instance refuses the prefill worker at its hello, naming them, and each request is answered as a
colocated instance of the decode instance's weights answers it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from p2pkv.tinymodel import TinyModelSpec, write_tiny_model
from p2pkv.weights import fingerprint
from tests.integration.conftest import Oracle, answers_like, described_cluster, instance_of, metric, prompt

pytestmark = pytest.mark.vllm
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("other-weights"), TinyModelSpec(seed=4321)))


@pytest.fixture(scope="module")
def two_models(tiny_model: str, other_weights: str, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[dict[str, Any]]:
    loads_other = ("--model", other_weights, "--served-model-name", tiny_model)
    up_args = ("--decode-vllm-args", " ".join(loads_other))
    with described_cluster(tiny_model, tmp_path_factory.mktemp("weights"), {"transfer_timeout_s": DEADLINE_S},
                           [], up_args, loads_other) as info:
        yield info


def test_a_prefill_instance_with_other_weights_is_refused_and_requests_are_answered_by_the_decode_weights(
        two_models: dict[str, Any], other_weights: str, tiny_model: str, oracle: Oracle) -> None:
    decode = instance_of(two_models, "kv_consumer")
    refused = metric(decode["metrics"], "p2pkv_refused_peers_total")
    for i, length in enumerate((150, 290)):
        body = {"model": two_models["model"], "prompt": prompt(f"weights-{i}", length), "max_tokens": 16,
                "temperature": 0, "ignore_eos": True, "logprobs": 1}
        answers_like(two_models["proxy"], body, two_models["colocated"], oracle.url(), "the weights change it")
    assert metric(decode["metrics"], "p2pkv_refused_peers_total") >= refused + 1
    assert metric(decode["metrics"], "p2pkv_bytes_loaded_total") == 0
    text = (Path(two_models["log_dir"]) / "decode0.log").read_text()
    reason = f"KV layout mismatch: model.weights: ours {fingerprint(other_weights)}, peer {fingerprint(tiny_model)}"
    assert reason in text
    assert "model.rope" not in text and "model.hidden_size" not in text, "only the weights differ"
