"""Profiler kernel times of the low-latency kernels, shared by the GPU benchmarks (ll_gpu_bench.py,
ll_side_by_side.py): the durations DeepEP's bench_kineto and shared/reference/anchors.md report."""
from typing import Callable, Dict, List

import torch


def settle() -> None:
    """This GPU idle, then the ranks met (torch.distributed, when initialised): what every rank launched so far has
    finished everywhere."""
    import torch.distributed as dist
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()


def gpu_ahead() -> None:
    """settle(), then keep this GPU busy ~50 ms so the host queues what follows: the measured launches then run back to
    back, the ranks started together, and a kernel's time holds no Python launch overhead and no host skew between
    ranks (recv_trace.py timed with a plain synchronise instead: the host-paced receives of 3 ranks out of 4 waited
    ~40 µs for the slowest rank's send, bench/RESULTS.md session 44)."""
    settle()
    torch.cuda._sleep(100_000_000)


def kernel_times(fn: Callable[[], None], iters: int, gpu_ahead: Callable[[], None]) -> Dict[str, List[float]]:
    """Runs fn iters times under the profiler after gpu_ahead() (which keeps the GPU busy so the host queues the
    launches ahead) and returns the kineto durations (µs) of the kernels whose names hold '::dispatch' and
    '::combine' (llep's and DeepEP's), in launch order: {'dispatch': [...], 'combine': [...]}."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gpu_ahead()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out: Dict[str, List[float]] = {'dispatch': [], 'combine': []}
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    for e in evs:
        for op in out:
            if f'::{op}' in e.name:
                out[op].append(e.time_range.elapsed_us())
    return out
