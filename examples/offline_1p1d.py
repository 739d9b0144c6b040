"""Offline 1P1D with vLLM's `LLM` class: a producer process prefills, p2pkv pushes the KV to a consumer process.

    python examples/offline_1p1d.py [--model DIR] [--json OUT]

Each side binds its own KV port, and each request names its transfer and the consumer's KV address in
`SamplingParams(extra_args={"kv_transfer_params": ...})`, so nothing depends on vLLM's request ids. The producer
also generates every prompt the ordinary way (a request without p2pkv params is not transferred), which is the
colocated reference the consumer's output must equal. With no --model, the tiny test model is used.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import uuid
from multiprocessing.connection import Connection
from typing import Any

from p2pkv.bench.cluster import free_ports
from p2pkv.params import Address, PrefillParams

PROMPTS = [
    "The KV cache of a prompt is computed once, on the prefill instance.",
    "Short prompt.",
    "Disaggregated serving splits prefill and decode onto different instances so that each can be sized and "
    "scheduled for its own kind of work: prefill is compute bound, decode is memory bound, and mixing them on "
    "one instance makes the long prefills stall the short decode steps of every other request in the batch.",
]
MAX_TOKENS = 16
TIMEOUT_S = 600


def make_llm(model: str, role: str, kv_port: int) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(kv_connector="P2pNcclConnector", kv_connector_module_path="p2pkv.vllm",
                              kv_role=role, kv_port=kv_port,
                              kv_connector_extra_config={"kv_host": "127.0.0.1"})
    return LLM(model=model, dtype="float32", kv_transfer_config=config, enforce_eager=True)


def close_llm(llm: Any) -> None:
    # Stop vLLM's engine process now; otherwise this process waits on it at exit.
    llm.llm_engine.engine_core.shutdown()


def producer(model: str, kv_port: int, consumer_kv: str, conn: Connection) -> None:
    from vllm import SamplingParams

    llm = make_llm(model, "kv_producer", kv_port)
    if not conn.poll(TIMEOUT_S):
        raise TimeoutError("the consumer never became ready")
    conn.recv()
    prefill = [SamplingParams(max_tokens=1, temperature=0, extra_args={"kv_transfer_params": PrefillParams(
        uuid.uuid4().hex, Address.parse(consumer_kv)).to_dict()}) for _ in PROMPTS]
    outputs = llm.generate(PROMPTS, prefill)
    conn.send([out.kv_transfer_params for out in outputs])
    reference = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    conn.send([list(out.outputs[0].token_ids) for out in reference])
    close_llm(llm)


def consumer(model: str, kv_port: int, conn: Connection) -> None:
    from vllm import SamplingParams

    llm = make_llm(model, "kv_consumer", kv_port)
    conn.send("ready")
    if not conn.poll(TIMEOUT_S):
        raise TimeoutError("the producer never sent kv_transfer_params")
    params = conn.recv()
    decode = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                             extra_args={"kv_transfer_params": p}) for p in params]
    outputs = llm.generate(PROMPTS, decode)
    conn.send([{"token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text,
                "prompt_tokens": len(o.prompt_token_ids or []), "cached_tokens": o.num_cached_tokens}
               for o in outputs])
    close_llm(llm)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from p2pkv.cli.up import default_model_dir
        from p2pkv.tinymodel import write_tiny_model

        model = str(write_tiny_model(default_model_dir()))
    producer_port, consumer_port = free_ports(2)
    ctx = mp.get_context("spawn")
    p_here, p_there = ctx.Pipe()
    c_here, c_there = ctx.Pipe()
    procs = [ctx.Process(target=consumer, args=(model, consumer_port, c_there), name="consumer"),
             ctx.Process(target=producer, args=(model, producer_port, f"127.0.0.1:{consumer_port}", p_there),
                         name="producer")]
    for proc in procs:
        proc.start()
    try:
        if not c_here.poll(TIMEOUT_S):
            raise TimeoutError("consumer did not start")
        p_here.send(c_here.recv())
        if not p_here.poll(TIMEOUT_S):
            raise TimeoutError("producer did not prefill")
        c_here.send(p_here.recv())
        if not p_here.poll(TIMEOUT_S) or not c_here.poll(TIMEOUT_S):
            raise TimeoutError("no results")
        reference, results = p_here.recv(), c_here.recv()
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    ok = True
    for prompt, ref, got in zip(PROMPTS, reference, results, strict=True):
        same = ref == got["token_ids"]
        ok = ok and same and got["cached_tokens"] == got["prompt_tokens"] - 1
        print(f"{'OK ' if same else 'BAD'} cached={got['cached_tokens']}/{got['prompt_tokens']} "
              f"prompt={prompt[:40]!r} output={got['text']!r}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"reference": reference, "results": results}, f)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
