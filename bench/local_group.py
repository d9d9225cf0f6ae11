"""Loopback process groups for the GPU benchmarks: a free port (llep.utils) and a gloo group, for every script."""
import datetime

import torch.distributed as dist
from llep.utils import free_port  # noqa: F401  (re-exported: the scripts import it from here)


def init_gloo(rank: int, world_size: int, port: int, timeout_s: float) -> None:
    """Joins the default gloo group of world_size ranks meeting on 127.0.0.1:port."""
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
