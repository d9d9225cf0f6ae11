#!/usr/bin/env python3
"""Where a receive-only launch spends its time (issue #19, the receive launch's fixed cost), on each rank.

Hook mode, the kernels' diagnostic timeline on (LLEP_KERNEL_TRACE=1). For a send launch and a receive launch of each
op it prints, per trace point, the median / max (@ the CTA) over CTAs of µs since the first CTA entered the kernel
('entered' is stamped before the call state is read), and the profiler's duration of the same receive kernel launched
~25 µs after its send (ll_side_by_side.py's h_dra / h_cra; --spin-cycles sets the gap), so the part of the launch no
CTA stamps (ramp-up before the first CTA, teardown after the last) shows as the difference. The profiled loop's last
receives are printed too: in that loop (queued ahead, as ll_side_by_side.py's) the ranks drift apart and a rank's
receive can still find a peer's signal missing however long the gap (bench/RESULTS.md session 44), which its own
timeline then shows (`signals` late).

--ranks R (default 1) runs R ranks, one per GPU (round-robin if fewer GPUs: then not a timing), and prints every rank's
lines: at EP4 the dispatch receive is 1.2-1.8x DeepEP's where at one rank nothing crosses NVLink (bench/RESULTS.md
session 30). Each traced launch runs after all ranks finished the one before (synchronise, then a barrier), so a
receive's timeline is its own work with every message there, as in a hook called late.

The fused launches (no hook: what a captured graph replays, the receive phase after the send phase in one launch) are
traced and profiled too, after a few untraced ones (a kernel's first run fetches its code from memory: traced cold,
the fused dispatch's receive phase looked 2.5 µs longer, bench/RESULTS.md session 56).

  LLEP_KERNEL_TRACE is set by this script. Usage: PYTHONPATH=build-gpu/python python3 bench/recv_trace.py --tokens 1 8
  [--ranks 4]   (LLEP_METRICS=0 in the environment traces the kernels without their metrics)
"""
import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_times import gpu_ahead, kernel_times, settle  # bench/kernel_times.py
from ll_side_by_side import ARRIVAL_SPIN_CYCLES  # bench/ll_side_by_side.py (h_dra / h_cra)
from local_group import buffer_tokens, free_port, init_gloo  # bench/local_group.py

H, E, K = 7168, 256, 8
# kernels/cuda/ll_kernels.h TracePoint, in its order
POINTS = ['send_start', 'counted', 'planned', 'stored', 'counter_done', 'published', 'recv_start', 'signals',
          'recv_planned', 'recv_end', 'encoded', 'fenced', 'entered', 'opened', 'call_read', 'polled']
# In time order; a point the tree does not stamp is left out ('opened', the call state known, is newer than the rest).
LAUNCH_SPREAD_NS = 20_000  # a launch's CTAs enter within a few µs of each other
RECV = ['entered', 'recv_start', 'call_read', 'opened', 'recv_planned', 'signals', 'recv_end']


SEND = ['entered', 'send_start', 'call_read', 'opened', 'counted', 'planned', 'encoded', 'stored', 'fenced',
        'counter_done', 'polled', 'published']
# A fused launch (no hook: the launch a graph replays) stamps both: its receive phase after its send phase.
FUSED = SEND + ['recv_start', 'recv_planned', 'signals', 'recv_end']


def timeline(buf, op, points):
    """The newest launch of op (a send or a receive launch: `points`, SEND or RECV, are the ones it stamps)."""
    tr = buf.runtime.kernel_trace()
    G, P = buf.runtime.num_ctas, 16
    col = {name: [tr[(b * 2 + op) * P + POINTS.index(name)] for b in range(G)] for name in points}
    # A hook's receive runs fewer CTAs than the buffer's grid (ReceiveOnlyCtas): the others keep an older launch's
    # stamps. This launch's CTAs are those that entered within LAUNCH_SPREAD_NS of the newest entry (traced launches are
    # a synchronise and a barrier apart, far more than that); the rest are dropped.
    newest = max(col['entered'])
    ran = {b for b in range(G) if col['entered'][b] and col['entered'][b] >= newest - LAUNCH_SPREAD_NS}
    col = {name: [vs[b] if b in ran else 0 for b in range(G)] for name, vs in col.items()}
    # Points are kept from older launches when a launch does not pass them: only this launch's (>= its entry) count.
    t0 = min(col['entered'][b] for b in ran)
    cells = []
    for name in points:
        vs = sorted(((v - t0) / 1000, b) for b, v in enumerate(col[name]) if v >= t0)
        if vs:
            cells.append(f'{name} {statistics.median(v for v, _ in vs):.2f}/{vs[-1][0]:.2f}@{vs[-1][1]}')
    # CTA 0 holds the first token / message, the last CTA the handle and the count check, the one before it the
    # metrics binning (BinningCta: both take the dispatch receive's table path), and the three CTAs that stamped the
    # launch's last point last (the launch's tail; a near tie shows which CTAs a change must shorten together, as in
    # session 57's fused combine, bench/RESULTS.md): their own timelines.
    lasts = sorted(ran, key=lambda b: col[points[-1]][b])[-3:]
    for b in sorted({0, max(ran) - 1, max(ran), *lasts} & ran):
        pts = ' '.join(f'{name} {(col[name][b] - t0) / 1000:.2f}' for name in points if col[name][b] >= t0)
        cells.append(f'[CTA {b}: {pts}]')
    return ', '.join(cells)


def _worker(rank, R, port, tokens, iters, spin):
    os.environ['LLEP_KERNEL_TRACE'] = '1'
    import llep
    init_gloo(rank, R, port, 120)
    dev = torch.device('cuda', rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    E_loc = E // R
    T_top = buffer_tokens(max(tokens), R)  # so `--tokens 1` runs instead of being refused
    buf = llep.Buffer(dist.group.WORLD, num_rdma_bytes=llep.Buffer.get_low_latency_rdma_size_hint(T_top, H, R, E),
                      low_latency_mode=True, explicitly_destroy=True)
    out = []
    for T in tokens:
        g = torch.Generator(device=dev).manual_seed(1000 * T + rank)
        x = torch.randn((T, H), generator=g, device=dev).to(torch.bfloat16)
        topk = torch.topk(torch.rand((T, E), generator=g, device=dev), K, dim=-1).indices.to(torch.int64)
        w = torch.rand((T, K), generator=g, device=dev)
        state = {}

        y = torch.zeros((E_loc, R * T_top, H), dtype=torch.bfloat16, device=dev)  # the local experts' outputs

        def round_trip(spin=0):
            # spin: GPU cycles between each send and its receive (ll_side_by_side.py's h_dra / h_cra), so that the
            # profiler times a receive launched once every peer's data is there, as the timelines below are. Without
            # it a receive queued behind its send also waits for the slowest rank (20-48 us at EP4, session 43).
            state['d'] = buf.low_latency_dispatch(x, topk, T_top, E, return_recv_hook=True)
            if spin:
                torch.cuda._sleep(spin)
            state['d'][-1]()
            handle = state['d'][2]
            _, _, ch = buf.low_latency_combine(y, topk, w, handle, return_recv_hook=True)
            if spin:
                torch.cuda._sleep(spin)
            ch()

        for _ in range(5):
            round_trip()
        settle()
        # One more round, stopped after each launch to read that launch's timeline ('entered', 'call_read' and
        # 'opened' are stamped by send and receive launches alike, so each is read before the next launch).
        lines = {}
        d = buf.low_latency_dispatch(x, topk, T_top, E, return_recv_hook=True)
        settle()
        lines['ds'] = timeline(buf, 0, SEND)
        d[-1]()
        settle()
        lines['dr'] = timeline(buf, 0, RECV)
        _, _, ch = buf.low_latency_combine(y, topk, w, d[2], return_recv_hook=True)
        settle()
        lines['cs'] = timeline(buf, 1, SEND)
        ch()
        settle()
        lines['cr'] = timeline(buf, 1, RECV)
        # The fused launches (no hooks), as a graph replays them: the send phase, then the receive phase in the same
        # CTAs, on the whole grid. Run a few times first: a kernel's first run fetches its code from memory.
        def fused_round():
            buf.low_latency_combine(y, topk, w, buf.low_latency_dispatch(x, topk, T_top, E)[2])

        for _ in range(5):
            fused_round()
        settle()
        fd = buf.low_latency_dispatch(x, topk, T_top, E)
        settle()
        lines['fd'] = timeline(buf, 0, FUSED)
        buf.low_latency_combine(y, topk, w, fd[2])
        settle()
        lines['fc'] = timeline(buf, 1, FUSED)
        ks = kernel_times(lambda: round_trip(spin), iters, gpu_ahead)
        settle()
        # The profiled loop's last receives (each op's newest launch): a rank whose profiler times sit in a slow mode
        # shows here whether that time is inside the CTAs' stamps. Read before the fused launches below restamp them.
        lines['dr_last'], lines['cr_last'] = timeline(buf, 0, RECV), timeline(buf, 1, RECV)
        kf = kernel_times(fused_round, iters, gpu_ahead)
        settle()
        med = {f'{op}_{ph}': statistics.median(ks[op][i::2]) for op in ks for i, ph in ((0, 'send'), (1, 'recv'))}
        who = f'T={T}' + (f' rank {rank}' if R > 1 else '')
        med.update({f'{op}_fused': statistics.median(kf[op]) for op in kf})
        out += [f'{who}: profiler kernel durations (µs, median): ' + ', '.join(f'{k} {v:.2f}' for k, v in med.items()),
                f'{who}: dispatch send launch, µs since the first CTA entered (median/max over CTAs): {lines["ds"]}',
                f'{who}: dispatch receive launch: {lines["dr"]}',
                f'{who}: combine send launch: {lines["cs"]}',
                f'{who}: combine receive launch: {lines["cr"]}',
                f'{who}: the profiled loop\'s last dispatch receive: {lines["dr_last"]}',
                f'{who}: the profiled loop\'s last combine receive: {lines["cr_last"]}',
                f'{who}: fused dispatch launch: {lines["fd"]}',
                f'{who}: fused combine launch: {lines["fc"]}']
    buf.destroy()
    every = [None] * R
    dist.all_gather_object(every, out)
    if rank == 0:  # rank by rank, per T
        per_t = len(out) // len(tokens)  # _worker's lines per T (the same for every T and rank)
        for i in range(0, len(out), per_t):
            for r in range(R):
                print('\n'.join(every[r][i:i + per_t]), flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--tokens', type=int, nargs='+', default=[1, 8, 32, 128])
    ap.add_argument('--iters', type=int, default=100)
    ap.add_argument('--ranks', type=int, default=1, help='ranks, one per GPU (default 1)')
    ap.add_argument('--spin-cycles', type=int, default=ARRIVAL_SPIN_CYCLES,
                    help='GPU cycles between each profiled send and its receive (default: ll_side_by_side.py\'s)')
    args = ap.parse_args()
    if args.ranks < 1 or E % args.ranks:
        ap.error(f'--ranks must divide the {E} experts')
    if torch.cuda.device_count() < args.ranks:
        print(f'WARNING: {args.ranks} ranks share {torch.cuda.device_count()} GPUs: the timelines are not timings')
    port = free_port()
    if args.ranks == 1:
        _worker(0, 1, port, args.tokens, args.iters, args.spin_cycles)
    else:
        import torch.multiprocessing as mp
        mp.spawn(_worker, args=(args.ranks, port, args.tokens, args.iters, args.spin_cycles), nprocs=args.ranks,
                 join=True)


if __name__ == '__main__':
    main()
