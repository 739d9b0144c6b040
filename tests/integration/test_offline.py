"""The offline example: producer and consumer `LLM` processes, params in SamplingParams.extra_args."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import ROOT

pytestmark = pytest.mark.vllm


def test_offline_example_matches_colocated(tiny_model: str, tmp_path: Path) -> None:
    out = tmp_path / "offline.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "offline_1p1d.py"), "--model", tiny_model,
                          "--json", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert len(data["results"]) == 3
    for reference, result in zip(data["reference"], data["results"], strict=True):
        assert result["token_ids"] == reference
        assert len(reference) == 16
        assert result["cached_tokens"] == result["prompt_tokens"] - 1
