"""One transfer engine per vLLM worker: control socket, sender, receive staging, metrics."""

from p2pkv.engine.engine import EngineSettings, TransferEngine

__all__ = ["EngineSettings", "TransferEngine"]
