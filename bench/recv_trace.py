#!/usr/bin/env python3
"""Where a receive-only launch spends its time (issue #19, receive-launch fixed cost): one rank, hook mode, the
kernels' diagnostic timeline on (LLEP_KERNEL_TRACE=1). For a send launch and a receive launch of each op it prints, per
trace point, the median / max (@ the CTA) over CTAs of µs since the first CTA entered the kernel ('entered' is stamped
before the call state is read), and the profiler's duration of the same receive kernel, so the part of the launch no
CTA stamps (ramp-up before the first CTA, teardown after the last) shows as the difference.

  LLEP_KERNEL_TRACE is set by this script. Usage: PYTHONPATH=build-gpu/python python3 bench/recv_trace.py --tokens 1 8
"""
import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_times import kernel_times  # bench/kernel_times.py
from local_group import buffer_tokens, free_port, init_gloo  # bench/local_group.py

H, E, K = 7168, 256, 8
# kernels/cuda/ll_kernels.h TracePoint, in its order
POINTS = ['send_start', 'counted', 'planned', 'stored', 'counter_done', 'published', 'recv_start', 'signals',
          'recv_planned', 'recv_end', 'encoded', 'fenced', 'entered', 'opened', 'call_read', 'polled']
# In time order; a point the tree does not stamp is left out ('opened', the call state known, is newer than the rest).
RECV = ['entered', 'recv_start', 'call_read', 'opened', 'recv_planned', 'signals', 'recv_end']


SEND = ['entered', 'send_start', 'call_read', 'opened', 'counted', 'planned', 'encoded', 'stored', 'fenced',
        'counter_done', 'polled', 'published']


def timeline(buf, op, points):
    """The newest launch of op (a send or a receive launch: `points`, SEND or RECV, are the ones it stamps)."""
    tr = buf.runtime.kernel_trace()
    G, P = buf.runtime.num_ctas, 16
    col = {name: [tr[(op * G + b) * P + POINTS.index(name)] for b in range(G)] for name in points}
    # Points are kept from older launches when a launch does not pass them: only this launch's (>= its entry) count.
    t0 = min(v for v in col['entered'] if v)
    cells = []
    for name in points:
        vs = sorted(((v - t0) / 1000, b) for b, v in enumerate(col[name]) if v >= t0)
        if vs:
            cells.append(f'{name} {statistics.median(v for v, _ in vs):.2f}/{vs[-1][0]:.2f}@{vs[-1][1]}')
    # CTA 0 holds the first token / message, the last CTA the handle and the count check: their own timelines.
    for b in (0, G - 1):
        pts = ' '.join(f'{name} {(col[name][b] - t0) / 1000:.2f}' for name in points if col[name][b] >= t0)
        cells.append(f'[CTA {b}: {pts}]')
    return ', '.join(cells)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--tokens', type=int, nargs='*', default=[1, 8, 32, 128])
    ap.add_argument('--iters', type=int, default=100)
    args = ap.parse_args()
    os.environ['LLEP_KERNEL_TRACE'] = '1'
    import llep
    init_gloo(0, 1, free_port(), 60)
    dev = torch.device('cuda', 0)
    torch.cuda.set_device(dev)
    T_top = buffer_tokens(max(args.tokens), 1)  # so `--tokens 1` runs instead of being refused
    buf = llep.Buffer(dist.group.WORLD, num_rdma_bytes=llep.Buffer.get_low_latency_rdma_size_hint(T_top, H, 1, E),
                      low_latency_mode=True, explicitly_destroy=True)
    for T in args.tokens:
        g = torch.Generator(device=dev).manual_seed(T)
        x = torch.randn((T, H), generator=g, device=dev).to(torch.bfloat16)
        topk = torch.topk(torch.rand((T, E), generator=g, device=dev), K, dim=-1).indices.to(torch.int64)
        w = torch.rand((T, K), generator=g, device=dev)
        state = {}

        y = torch.zeros((E, T_top, H), dtype=torch.bfloat16, device=dev)  # the experts' outputs (1 rank: E local)

        def round_trip():
            state['d'] = buf.low_latency_dispatch(x, topk, T_top, E, return_recv_hook=True)
            state['d'][-1]()
            handle = state['d'][2]
            _, _, ch = buf.low_latency_combine(y, topk, w, handle, return_recv_hook=True)
            ch()

        for _ in range(5):
            round_trip()
        # One more round, stopped after each launch to read that launch's timeline ('entered', 'call_read' and
        # 'opened' are stamped by send and receive launches alike, so each is read before the next launch).
        lines = {}
        d = buf.low_latency_dispatch(x, topk, T_top, E, return_recv_hook=True)
        torch.cuda.synchronize()
        lines['ds'] = timeline(buf, 0, SEND)
        d[-1]()
        torch.cuda.synchronize()
        lines['dr'] = timeline(buf, 0, RECV)
        _, _, ch = buf.low_latency_combine(y, topk, w, d[2], return_recv_hook=True)
        torch.cuda.synchronize()
        lines['cs'] = timeline(buf, 1, SEND)
        ch()
        torch.cuda.synchronize()
        lines['cr'] = timeline(buf, 1, RECV)
        ks = kernel_times(round_trip, args.iters, torch.cuda.synchronize)
        med = {f'{op}_{ph}': statistics.median(ks[op][i::2]) for op in ks for i, ph in ((0, 'send'), (1, 'recv'))}
        print(f'T={T}: profiler kernel durations (µs, median): ' + ', '.join(f'{k} {v:.2f}' for k, v in med.items()),
              flush=True)
        print(f'T={T}: dispatch send launch, µs since the first CTA entered (median/max over CTAs): {lines["ds"]}')
        print(f'T={T}: dispatch receive launch: {lines["dr"]}')
        print(f'T={T}: combine send launch: {lines["cs"]}')
        print(f'T={T}: combine receive launch: {lines["cr"]}', flush=True)
    buf.destroy()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
