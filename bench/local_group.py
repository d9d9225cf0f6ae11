"""Loopback process groups for the GPU benchmarks: a free port (llep.utils) and a gloo group, for every script; and
the buffer size they all derive from T."""
import datetime

import torch.distributed as dist
from llep.utils import free_port  # noqa: F401  (re-exported: the scripts import it from here)


def init_gloo(rank: int, world_size: int, port: int, timeout_s: float) -> None:
    """Joins the default gloo group of world_size ranks meeting on 127.0.0.1:port."""
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def buffer_tokens(T: int, R: int) -> int:
    """num_max_dispatch_tokens_per_rank for T tokens on R ranks: the smallest T_max >= T with R * T_max a multiple of 4
    (the column-major scale tensor stays 16-byte aligned; llep and DeepEP both refuse other sizes), so e.g. T=1 on 2
    ranks runs in a buffer sized for 2."""
    t = T
    while (R * t) % 4:
        t += 1
    return t
