"""The only package that imports vLLM. vLLM loads `P2pNcclConnector` from here (`kv_connector_module_path`
"p2pkv.vllm", or by name through the plugin in `p2pkv.vllm.plugin`). The connector is imported on first use, so
that loading the plugin in every vLLM process costs nothing."""

from __future__ import annotations

from typing import Any

__all__ = ["P2pNcclConnector"]


def __getattr__(name: str) -> Any:
    if name == "P2pNcclConnector":
        from p2pkv.vllm.connector import P2pNcclConnector

        return P2pNcclConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
