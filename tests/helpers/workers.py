"""Connector worker sides driven as vLLM drives them (bind, save_layer, wait_for_save, get_finished), without vLLM's
processes: each with a real transfer engine on real sockets."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import torch

from p2pkv.config import parse_connector_config
from p2pkv.kv.device_copy import DeviceOps
from p2pkv.params import Address
from p2pkv.vllm.groups import CacheGroups
from p2pkv.vllm.metadata import LoadSpec, P2pkvMetadata, SaveSpec
from p2pkv.vllm.worker import WorkerSide

LOCAL = "127.0.0.1"


def worker_side(role: str, port: int, kv: Mapping[str, torch.Tensor], block_size: int, *, rank: int = 0,
                tp_size: int = 1, total_heads: int = 0, num_blocks: int = 0, total_layers: int = 0,
                keys: Mapping[str, object] | None = None, device_ops: DeviceOps | None = None,
                model: str = "", groups: CacheGroups | None = None) -> WorkerSide:
    """A PP 1 worker (tensor-parallel `rank` of `tp_size`) of `role` whose instance's KV port is `port`, its cache
    `kv` registered; `model`: what its KV's values depend on (`p2pkv.vllm.model_factors`)."""
    extra: dict[str, object] = {"kv_host": LOCAL, "transfer_timeout_s": 10, "metrics_port": 0, **(keys or {})}
    config = parse_connector_config(role, port, "recompute", extra, "")
    side = WorkerSide(config, rank=rank, block_size=block_size, tp_size=tp_size, total_heads=total_heads,
                      total_layers=total_layers, num_blocks=num_blocks, device_ops=device_ops, model=model,
                      groups=groups)
    side.register_kv_caches(dict(kv))
    return side


def settle(side: WorkerSide, req: str, sending: bool, timeout_s: float = 10,
           also: Iterable[WorkerSide] = ()) -> None:
    """Step `side` (and `also`, as their vLLM would keep stepping) until `req` is reported sent or loaded."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for other in also:
            other.get_finished(set())
        sent, loaded = side.get_finished({req} if sending else set())
        if req in ((sent if sending else loaded) or ()):
            return
        time.sleep(0.005)
    raise AssertionError(f"{req} did not finish")


def push_once(prefill: WorkerSide, decode: WorkerSide, save: SaveSpec, load: LoadSpec,
              layer_names: Iterable[str] = ()) -> None:
    """The decode worker's load bound; the prefill worker's forward saves `layer_names`, then `wait_for_save`; both
    step until the load is reported, loaded or failed (the caller checks which)."""
    decode.bind(P2pkvMetadata(loads=[load]))
    prefill.bind(P2pkvMetadata(saves=[save]))
    for name in layer_names:
        prefill.save_layer(name)
    prefill.wait_for_save()
    settle(decode, load.req_id, sending=False, also=[prefill])


def offer_and_pull(prefill: WorkerSide, decode: WorkerSide, tid: str, src: tuple[int, ...], dst: tuple[int, ...],
                   p_port: int) -> None:
    """GET: the prefill worker offers blocks `src` once its forward is done; the decode worker pulls them into
    `dst`. Both settle, with no load errors."""
    prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id=tid, peer=None, block_ids=src)]))
    prefill.wait_for_save()
    decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id=tid, first_block=0, block_ids=dst,
                                              pull_from=Address(LOCAL, p_port))]))
    settle(decode, "d-req", sending=False)
    assert decode.take_load_errors() == set()
    settle(prefill, "p-req", sending=True)


def push_and_load(prefill: WorkerSide, decode: WorkerSide, tid: str, src: tuple[int, ...], dst: tuple[int, ...],
                  layer_names: Iterable[str], p_port: int, d_port: int) -> None:
    """PUT_ASYNC: the decode worker's load is bound; the prefill worker's forward saves layer after layer, then
    `wait_for_save`; both step until the load is reported, with no load errors."""
    decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id=tid, first_block=0, block_ids=dst,
                                              fallback_from=Address(LOCAL, p_port))]))
    prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id=tid, peer=Address(LOCAL, d_port),
                                               block_ids=src)]))
    for name in layer_names:
        prefill.save_layer(name)
    prefill.wait_for_save()
    settle(decode, "d-req", sending=False, also=[prefill])
    assert decode.take_load_errors() == set()
    settle(prefill, "p-req", sending=True)
