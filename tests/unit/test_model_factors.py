"""What the KV's values depend on beyond its shape, read from a vLLM config (a stand-in object with the attributes
`model_factors` reads: vLLM's own would need a model to load)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from p2pkv.vllm.model_factors import model_factors


def config(quantization: str | None = None, **text: Any) -> Any:
    hf = SimpleNamespace(architectures=["LlamaForCausalLM"])
    text_config = SimpleNamespace(hidden_size=256, num_attention_heads=4, head_dim=64,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **text)
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=hf, hf_text_config=text_config,
                                                        quantization=quantization))


def test_the_factors_name_the_architecture_the_positional_encoding_and_the_quantization() -> None:
    assert model_factors(config()) == (
        "architecture=LlamaForCausalLM;head_dim=64;hidden_size=256;num_attention_heads=4;quantization=none;"
        'rope_parameters={"rope_theta":10000.0,"rope_type":"default"}')
    assert "quantization=fp8" in model_factors(config("fp8"))
    assert "sliding_window=4096" in model_factors(config(sliding_window=4096))
    # The same settings give the same text, whatever order the config's dict was written in.
    a = config(rope_scaling={"type": "yarn", "factor": 4.0})
    b = config(rope_scaling={"factor": 4.0, "type": "yarn"})
    assert model_factors(a) == model_factors(b)


def test_rope_scaling_that_only_repeats_rope_parameters_is_named_once() -> None:
    """transformers 5 answers `rope_scaling` with the `rope_parameters` dict."""
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    assert "rope_scaling" not in model_factors(config(rope_scaling=rope))
    assert 'rope_scaling={"factor":4.0}' in model_factors(config(rope_scaling={"factor": 4.0}))
