"""What a KV cache's values depend on beyond its shape, read from vLLM's model config, for the layout digest
(`LayoutDigest.model`): two instances whose blocks have the same shape but were computed with another positional
encoding (RoPE base or scaling, say through `--hf-overrides`), another architecture, sliding window or weight
quantization would exchange KV the decode side would not have computed itself, and answer wrongly without an error.
Peers compare these factors at their hello and refuse each other, naming the factor, as for any layout difference."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Keys of the model's (text) config that shape the KV's values; each named in a refusal as `model.<key>`.
_CONFIG_KEYS = ("hidden_size", "num_attention_heads", "head_dim", "rope_parameters", "rope_theta", "rope_scaling",
                "partial_rotary_factor", "sliding_window", "attention_chunk_size")


def _text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def model_factors(vllm_config: VllmConfig) -> str:
    """`key=value` pairs, ';'-separated, sorted: the architecture, the config keys above that are set, and the
    weights' quantization."""
    model = vllm_config.model_config
    config = getattr(model, "hf_text_config", None) or model.hf_config
    architectures = getattr(model.hf_config, "architectures", None) or []
    factors = {"architecture": architectures[0] if architectures else "",
               "quantization": str(getattr(model, "quantization", None) or "none")}
    for key in _CONFIG_KEYS:
        value = getattr(config, key, None)
        # transformers 5 answers `rope_scaling` with `rope_parameters`: named once
        if value is not None and not (key == "rope_scaling" and _text(value) == factors.get("rope_parameters")):
            factors[key] = _text(value)
    return ";".join(f"{k}={v}" for k, v in sorted(factors.items()))
