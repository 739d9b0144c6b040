"""The weights' fingerprint (`p2pkv.weights`) on real model files: the tiny model written with two seeds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from p2pkv.tinymodel import TinyModelSpec, write_tiny_model
from p2pkv.weights import BYTES_PER_SAMPLE, MIN_SAMPLES, SAMPLE_BYTES, fingerprint, sample_offsets, weight_files


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weights")
    return {"a": write_tiny_model(root / "a"), "a again": write_tiny_model(root / "a-again"),
            "b": write_tiny_model(root / "b", TinyModelSpec(seed=4321))}


def test_copies_of_one_model_match_and_other_weights_of_the_same_config_do_not(models: dict[str, Path]) -> None:
    a, again, b = (fingerprint(models[k]) for k in ("a", "a again", "b"))
    assert len(a) == 16 and int(a, 16) >= 0
    assert a == again, "written twice, in another directory: the same weights"
    assert (models["a"] / "config.json").read_text() == (models["b"] / "config.json").read_text()
    assert a != b, "the same config, other weights"


def test_a_tensor_changed_deep_in_the_file_changes_it(models: dict[str, Path], tmp_path: Path) -> None:
    """A fine-tune changes tensors, not the header: one layer's weights rewritten in place (same size, same
    header) is seen."""
    copy = Path(shutil.copytree(models["a"], tmp_path / "tuned"))
    path = copy / "model.safetensors"
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    tensors = json.loads(data[8:header])
    begin, end = tensors["model.layers.1.self_attn.q_proj.weight"]["data_offsets"]
    data[header + begin : header + end] = bytes(reversed(data[header + begin : header + end]))
    path.write_bytes(bytes(data))
    assert fingerprint(copy) != fingerprint(models["a"])


def test_only_the_files_that_hold_the_weights_count(models: dict[str, Path], tmp_path: Path) -> None:
    copy = Path(shutil.copytree(models["a"], tmp_path / "more"))
    (copy / "README.md").write_text("a model card")
    (copy / "optimizer.pt").write_bytes(b"state the loader does not read")
    assert fingerprint(copy) == fingerprint(models["a"])
    # With an index, the files it names; a consolidated file beside them is not loaded, nor counted.
    (copy / "model.safetensors").rename(copy / "model-00001-of-00001.safetensors")
    (copy / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00001-of-00001.safetensors"}}))
    shutil.copy(models["b"] / "model.safetensors", copy / "consolidated.safetensors")
    assert weight_files(copy) == [copy / "model-00001-of-00001.safetensors"]
    assert fingerprint(copy) == fingerprint(models["a"])


def test_a_directory_without_weight_files_has_none(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert weight_files(tmp_path) == [] and fingerprint(tmp_path) == ""
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x01" * 1000)
    assert weight_files(tmp_path) == [tmp_path / "pytorch_model.bin"] and fingerprint(tmp_path) != ""


def test_samples_cover_a_file_from_start_to_end_more_of_them_in_a_larger_file() -> None:
    assert sample_offsets(1000) == list(range(0, 1000, SAMPLE_BYTES)), "a small file is read whole"
    size = 100 * BYTES_PER_SAMPLE + 12345
    offsets = sample_offsets(size)
    assert len(offsets) == 100 and offsets[0] == 0 and offsets[-1] == size - SAMPLE_BYTES
    assert offsets == sorted(set(offsets))
    assert len(sample_offsets(5 * BYTES_PER_SAMPLE)) == MIN_SAMPLES


def test_a_model_in_one_file_is_fingerprinted_from_that_file(models: dict[str, Path], tmp_path: Path) -> None:
    """A GGUF model is loaded from its one file (`--model model.gguf`): that file is fingerprinted as the one weight
    file of a directory would be, and a directory of GGUF files counts them."""
    for key in ("a", "b"):
        one = tmp_path / key
        one.mkdir()
        shutil.copy(models[key] / "model.safetensors", one / "model-Q8_0.gguf")
        assert fingerprint(one / "model-Q8_0.gguf") == fingerprint(models[key]) == fingerprint(one)
        assert weight_files(one) == [one / "model-Q8_0.gguf"]
    assert fingerprint(tmp_path / "a" / "model-Q8_0.gguf") != fingerprint(tmp_path / "b" / "model-Q8_0.gguf")
