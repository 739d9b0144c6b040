"""The only package that imports vLLM. vLLM loads `P2pNcclConnector` from here."""

from p2pkv.vllm.connector import P2pNcclConnector

__all__ = ["P2pNcclConnector"]
