"""What a KV cache's values depend on beyond its shape, read from vLLM's model config, for the layout digest
(`LayoutDigest.model`): two instances whose blocks have the same shape but were computed with another positional
encoding (RoPE base or scaling, say through `--hf-overrides`), another architecture, sliding window or weight
quantization would exchange KV the decode side would not have computed itself, and answer wrongly without an error.
Peers compare these factors at their hello and refuse each other, naming the factor, as for any layout difference.
The weights themselves are one more factor, `weights` (`p2pkv.weights`), read from the model's files once they are
loaded."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2pkv.weights import fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)

# Keys of the model's (text) config that shape the KV's values; each named in a refusal as `model.<key>`.
_CONFIG_KEYS = ("hidden_size", "num_attention_heads", "head_dim", "rope_parameters", "rope_theta", "rope_scaling",
                "partial_rotary_factor", "sliding_window", "attention_chunk_size")


def _text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


# Cache dtypes that name one format twice: vLLM reads `fp8` as e4m3 (CUDA 11.8+, ROCm).
_SAME_FORMAT = {"fp8": "fp8_e4m3"}


def kv_cache_dtype(vllm_config: VllmConfig) -> str:
    """The KV cache's quantized format (`--kv-cache-dtype`), or "" where the cache holds the model's dtype (the
    tensors' dtype tells that). Quantized formats share one storage dtype (`fp8`, `fp8_e4m3` and `fp8_e5m2` are all
    uint8), and the same byte means another value in each: 0x3C is 1.5 in e4m3, 1.0 in e5m2."""
    name = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto") or "auto")
    if name in ("auto", "float16", "bfloat16", "float32", "half", "float"):
        return ""
    return _SAME_FORMAT.get(name, name)


def model_factors(vllm_config: VllmConfig) -> str:
    """`key=value` pairs, ';'-separated, sorted: the architecture, the config keys above that are set, the
    weights' quantization and the KV cache's (`kv_cache_dtype`)."""
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
    if cache_dtype := kv_cache_dtype(vllm_config):
        factors["kv_cache_dtype"] = cache_dtype
    return ";".join(f"{k}={v}" for k, v in sorted(factors.items()))


def weights_factor(vllm_config: VllmConfig) -> str:
    """`weights=<fingerprint>` of the files the model was loaded from: its directory (or its one file, a GGUF
    model's), or its snapshot in the Hugging Face cache (looked up without the network); "" where neither holds
    weight files (another loader, say): not known, and not compared with a peer's. vLLM's `dummy` load format
    (seeded random weights) is `weights=dummy`."""
    model, load = vllm_config.model_config, getattr(vllm_config, "load_config", None)
    if str(getattr(load, "load_format", "")) == "dummy":  # seeded random weights, whatever the files hold
        return "weights=dummy"
    started = time.monotonic()
    location = _weights_location(str(model.model), getattr(model, "revision", None),
                                 getattr(load, "download_dir", None))
    found = fingerprint(location) if location is not None else ""
    log.info("weights of %s: %s (%.2f s)", model.model, f"fingerprint {found}" if found
             else "no weight files found, not compared with peers", time.monotonic() - started)
    return f"weights={found}" if found else ""


def _weights_location(name: str, revision: str | None, cache_dir: str | None) -> Path | None:
    if os.path.isdir(name) or os.path.isfile(name):
        return Path(name)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, revision=revision, cache_dir=cache_dir, local_files_only=True))
    except Exception as exc:  # not a hub model, or not in the cache: the loader took its weights elsewhere
        log.debug("no local snapshot of %s: %r", name, exc)
        return None
