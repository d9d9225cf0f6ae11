"""Helpers the multi-process Python tests share (tests/python is on their PYTHONPATH)."""
import socket


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a gloo rendezvous or an exporter)."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]
