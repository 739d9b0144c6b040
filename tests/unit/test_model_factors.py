"""What the KV's values depend on beyond its shape, read from a vLLM config (a stand-in object with the attributes
`model_factors` reads: vLLM's own would need a model to load)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from p2pkv.tinymodel import write_tiny_model
from p2pkv.vllm.model_factors import model_factors, weights_factor
from p2pkv.weights import fingerprint


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


def test_the_weights_factor_is_the_fingerprint_of_the_files_the_model_was_loaded_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = write_tiny_model(tmp_path / "tiny")
    loaded = SimpleNamespace(model_config=SimpleNamespace(model=str(model), revision=None),
                             load_config=SimpleNamespace(download_dir=None))
    assert weights_factor(loaded) == f"weights={fingerprint(model)}"
    # A model loaded from its one file (GGUF): that file.
    one_file = SimpleNamespace(model_config=SimpleNamespace(model=str(model / "model.safetensors"), revision=None),
                               load_config=SimpleNamespace(download_dir=None))
    assert weights_factor(one_file) == f"weights={fingerprint(model)}"
    # vLLM's dummy load format fills the weights with seeded random values, whatever the files hold.
    dummy = SimpleNamespace(model_config=loaded.model_config,
                            load_config=SimpleNamespace(download_dir=None, load_format="dummy"))
    assert weights_factor(dummy) == "weights=dummy"
    # A name that is neither a directory nor a model in the (empty) Hugging Face cache: not known.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    elsewhere = SimpleNamespace(model_config=SimpleNamespace(model="someone/some-model", revision=None),
                                load_config=SimpleNamespace(download_dir=None))
    assert weights_factor(elsewhere) == ""


def test_a_model_in_the_hugging_face_cache_is_found_there(tmp_path: Path) -> None:
    """The cache's layout: `models--OWNER--NAME/snapshots/<commit>/`, named by `refs/main`."""
    repo = tmp_path / "hub" / "models--someone--some-model"
    snapshot = repo / "snapshots" / ("c0ffee" * 6 + "c0ff")
    write_tiny_model(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    cached = SimpleNamespace(model_config=SimpleNamespace(model="someone/some-model", revision=None),
                             load_config=SimpleNamespace(download_dir=str(tmp_path / "hub")))
    assert weights_factor(cached) == f"weights={fingerprint(snapshot)}"
