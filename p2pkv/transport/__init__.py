"""Data planes behind one small interface. TCP works on any host; faster ones plug in behind `Connection`."""

from p2pkv.transport.base import Connection, Listener
from p2pkv.transport.tcp import TcpConnection, TcpListener

__all__ = ["Connection", "Listener", "TcpConnection", "TcpListener"]
