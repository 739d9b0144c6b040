"""Attacks on real engines and proxies on loopback: each bounded in count and time, each asserting what must hold."""
