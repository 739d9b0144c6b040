"""A vLLM plugin for the tests only: async scheduling with vLLM's CPU build.

vLLM turns async scheduling on by default on GPUs, and its CPU build turns it off. On a PYTHONPATH with this folder
(which holds the plugin's entry point), vLLM's processes keep it as vLLM chose before the CPU build's override: on,
unless `--no-async-scheduling` says otherwise, as on a GPU. The engine core then steps
with a queue of two batches, scheduling the next step while the last one runs, and its scheduler is vLLM's
AsyncScheduler. The model runner's CUDA streams and events, which only order device copies, become no-ops on the
CPU. Each engine core writes MARKER to its log once it steps that way, so a test can tell that it did."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

MARKER = "p2pkv test plugin: the engine core steps with a batch queue (async scheduling)"


class _Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import torch

        self.device = torch.device("cpu")

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


def register() -> None:
    import torch
    from vllm.platforms import cpu
    from vllm.v1.engine.core import EngineCore

    platform = cpu.CpuPlatform
    if getattr(platform, "_p2pkv_async", False):
        return
    original = platform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def keep_async(cls: Any, vllm_config: Any) -> None:
        wanted = vllm_config.scheduler_config.async_scheduling
        original(cls, vllm_config)
        if wanted:
            vllm_config.scheduler_config.async_scheduling = True

    platform.check_and_update_config = classmethod(keep_async)  # type: ignore[method-assign, assignment]
    platform._p2pkv_async = True  # type: ignore[attr-defined]
    torch.cuda.Stream = _Stream  # type: ignore[misc, assignment]
    torch.cuda.Event = _Event  # type: ignore[misc, assignment]
    torch.Event = _Event  # type: ignore[misc, assignment]
    torch.cuda.current_stream = lambda *args, **kwargs: _Stream()  # type: ignore[assignment]
    torch.cuda.stream = lambda stream: contextlib.nullcontext()  # type: ignore[assignment]

    stepping = EngineCore.step_with_batch_queue
    told = []

    def step_with_batch_queue(self: Any) -> Any:
        if not told:
            told.append(True)
            print(MARKER, file=sys.stderr, flush=True)
        return stepping(self)

    EngineCore.step_with_batch_queue = step_with_batch_queue  # type: ignore[method-assign]
