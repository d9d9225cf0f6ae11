"""Loopback process groups for the GPU benchmarks: a free port and a gloo group, defined once for every script."""
import datetime
import socket

import torch.distributed as dist


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int, timeout_s: float) -> None:
    """Joins the default gloo group of world_size ranks meeting on 127.0.0.1:port."""
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
