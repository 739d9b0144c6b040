"""Service discovery: instances announce themselves to the proxy with heartbeats over ZMQ."""

from p2pkv.discovery.announcement import Announcement, parse_announcement
from p2pkv.discovery.heartbeat import HeartbeatSender

__all__ = ["Announcement", "HeartbeatSender", "parse_announcement"]
