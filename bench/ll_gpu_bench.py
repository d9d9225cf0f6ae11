#!/usr/bin/env python3
"""GPU low-latency benchmark (issue #3): llep's NVLink kernels vs torch all_to_all_single at equal bytes, and
DeepEP V1 when it is importable, at the DeepSeek-V3 decode shape (hidden 7168, top-8, 256 experts, FP8
dispatch, BF16 combine) for T in {1, 32, 64, 128, 256} tokens per rank.

Method: one process per GPU (spawn), a gloo group for bootstrap and barriers (an NCCL group only for the
all_to_all_single baseline, created after llep's numbers are in); per T a fresh layout and 20 warm-up round
trips. Two measurements, each over N iterations, medians, then the maximum over ranks (the slowest rank bounds
the step):
  kernel  CUDA kernel durations from the profiler (kineto), as DeepEP's bench_kineto and the anchors report
          them: dispatch and combine in one launch each, and in hook mode the send and receive launches apart.
  events  [dispatch, combine] back to back bracketed by CUDA events, queued behind a GPU sleep so the host is
          ahead and the gaps are GPU time, not Python time. Results are checked once per T (recv_count equals the routed
counts) so a broken kernel cannot produce a fast number. Prints a table last; --json writes all numbers.
"""
import argparse
import faulthandler
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import llep
from kernel_times import kernel_times
from local_group import buffer_tokens, free_port, init_gloo  # bench/local_group.py

H, E, K = 7168, 256, 8



def _time(fn, iters, n_events):
    """Runs fn(events) iters times; fn records n_events events; returns per-gap median lists (µs)."""
    evs = [[torch.cuda.Event(enable_timing=True) for _ in range(n_events)] for _ in range(iters)]
    for i in range(iters):
        fn(evs[i])
    torch.cuda.synchronize()
    gaps = []
    for j in range(n_events - 1):
        gaps.append(statistics.median(evs[i][j].elapsed_time(evs[i][j + 1]) * 1000 for i in range(iters)))
    return gaps


_ALIGN = {}


def _gpu_ahead():
    """Makes every rank's GPU busy for ~50 ms and then meet the others in an NCCL all_reduce, so the host queues
    the measured iterations meanwhile and all ranks start them together: kernel times then hold GPU work and
    peer waits only, not Python launch overhead or host skew between ranks (as DeepEP's bench_kineto does with a
    large GEMM and an all_reduce)."""
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda._sleep(100_000_000)
    dist.all_reduce(_ALIGN['one'], group=_ALIGN['nccl'])


def _time_gpu_bound(fn, iters, n_events):
    """As _time, behind _gpu_ahead()."""
    _gpu_ahead()
    return _time(fn, iters, n_events)


def _kernel_times(fn, iters):
    return kernel_times(fn, iters, _gpu_ahead)


def _inputs(rank, T, dev):
    g = torch.Generator(device=dev).manual_seed(rank + 17)
    x = torch.randn((T, H), generator=g, device=dev).to(torch.bfloat16)
    scores = torch.rand((T, E), generator=g, device=dev)
    topk = torch.topk(scores, K, dim=-1).indices.to(torch.int64)
    w = torch.rand((T, K), generator=g, device=dev)
    return x, topk, w


def _bench_llep(buf, rank, R, T, dev, iters):
    x, topk, w = _inputs(rank, T, dev)
    T_max = buffer_tokens(T, R)
    # Correctness gate: counts must equal the routed counts.
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, topk, T_max, E)
    all_topk = [torch.empty_like(topk.cpu()) for _ in range(R)]
    dist.all_gather(all_topk, topk.cpu())
    E_loc = E // R
    want = torch.stack([(torch.cat(all_topk) == rank * E_loc + i).sum() for i in range(E_loc)]).to(torch.int32)
    assert torch.equal(count.cpu(), want), 'recv_count wrong: benchmark refuses to time a broken kernel'
    y = torch.randn((E_loc, R * T_max, H), device=dev).to(torch.bfloat16)
    out = torch.empty((T, H), dtype=torch.bfloat16, device=dev)

    def round_trip(ev):
        ev[0].record()
        _, _, hd, _, _ = buf.low_latency_dispatch(x, topk, T_max, E)
        ev[1].record()
        buf.low_latency_combine(y, topk, w, hd, out=out)
        ev[2].record()

    def hooks(ev):
        ev[0].record()
        _, _, hd, _, hook = buf.low_latency_dispatch(x, topk, T_max, E, return_recv_hook=True)
        ev[1].record()
        hook()
        ev[2].record()
        _, _, chook = buf.low_latency_combine(y, topk, w, hd, out=out, return_recv_hook=True)
        ev[3].record()
        chook()
        ev[4].record()

    def plain():
        _, _, hd, _, _ = buf.low_latency_dispatch(x, topk, T_max, E)
        buf.low_latency_combine(y, topk, w, hd, out=out)

    def hooked():
        _, _, hd, _, hook = buf.low_latency_dispatch(x, topk, T_max, E, return_recv_hook=True)
        hook()
        _, _, chook = buf.low_latency_combine(y, topk, w, hd, out=out, return_recv_hook=True)
        chook()

    for _ in range(20):
        plain()
    torch.cuda.synchronize()
    buf.check_errors()
    dist.barrier()
    k = _kernel_times(plain, iters)
    dist.barrier()
    kh = _kernel_times(hooked, iters)
    med = statistics.median
    kd, kc = med(k['dispatch']), med(k['combine'])
    kds, kdr = med(kh['dispatch'][0::2]), med(kh['dispatch'][1::2])
    kcs, kcr = med(kh['combine'][0::2]), med(kh['combine'][1::2])
    d, c = _time_gpu_bound(round_trip, iters, 3)
    ds, dr, cs, cr = _time_gpu_bound(hooks, iters, 5)
    torch.cuda.synchronize()
    buf.check_errors()
    # Bytes this rank writes to other ranks (what NVLink carries): dispatch messages + combine rows.
    dst = topk // E_loc
    msgs = sum(int(((dst == r).any(dim=1)).sum()) for r in range(R) if r != rank)
    rows = sum(int((dst == r).sum()) for r in range(R) if r != rank)
    d_bytes = msgs * (H + H // 128 * 4 + 80)
    c_bytes = rows * H * 2
    return {'dispatch_us': kd, 'combine_us': kc, 'dispatch_send_us': kds, 'dispatch_recv_us': kdr,
            'trace': (_trace_line(buf, x, topk, w, y, out, T_max, E)
                      if os.environ.get('LLEP_KERNEL_TRACE') == '1' else []),
            'combine_send_us': kcs, 'combine_recv_us': kcr, 'ev_dispatch_us': d, 'ev_combine_us': c,
            'ev_round_trip_us': d + c, 'ev_hook_dispatch_send_us': ds, 'ev_hook_dispatch_recv_us': dr,
            'ev_hook_combine_send_us': cs, 'ev_hook_combine_recv_us': cr,
            'dispatch_remote_bytes': d_bytes, 'combine_remote_bytes': c_bytes}


TRACE_POINTS = ['send_start', 'counted', 'planned', 'stored', 'counter_done', 'published', 'recv_start', 'signals',
                'recv_planned', 'recv_end', 'encoded', 'fenced', 'entered']  # kernels/cuda/ll_kernels.h TracePoint


def _trace_line(buf, x, topk, w, y, out, T, E):
    """One more round trip with the kernels' diagnostic timeline on (LLEP_KERNEL_TRACE=1); per operation and
    point, median/max over CTAs of µs since the first CTA started (points a CTA did not pass are left out)."""
    _, _, hd, _, _ = buf.low_latency_dispatch(x, topk, T, E)
    buf.low_latency_combine(y, topk, w, hd, out=out)
    tr = buf.runtime.kernel_trace()
    G, P = buf.runtime.num_ctas, 16
    parts = []
    for op, name in enumerate(('dispatch', 'combine')):
        stamps = [[tr[(b * 2 + op) * P + q] for b in range(G)] for q in range(len(TRACE_POINTS))]
        t0 = min((v for v in stamps[0] if v), default=0)
        cells = []
        for q, label in enumerate(TRACE_POINTS):
            vs = sorted((v - t0) / 1000 for v in stamps[q] if v >= t0 > 0)
            if vs:
                cells.append(f'{label} {statistics.median(vs):.1f}/{vs[-1]:.1f}')
        parts.append(f'{name}: ' + ', '.join(cells))
    return parts


def _bench_a2a(nccl, R, nbytes, dev, iters):
    n = max(R, (nbytes // R) * R)
    inp = torch.empty(n, dtype=torch.uint8, device=dev)
    outp = torch.empty_like(inp)

    def a2a(ev):
        ev[0].record()
        dist.all_to_all_single(outp, inp, group=nccl)
        ev[1].record()

    for _ in range(10):
        dist.all_to_all_single(outp, inp, group=nccl)
    torch.cuda.synchronize()
    dist.barrier()
    return _time(a2a, iters, 2)[0]


def _bench_deepep(group, rank, R, T, dev, iters):
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        return None
    num_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
    buf = deep_ep.Buffer(group, 0, num_bytes, low_latency_mode=True, num_qps_per_rank=E // R)
    x, topk, w = _inputs(rank, T, dev)
    y = torch.randn((E // R, R * T, H), device=dev).to(torch.bfloat16)

    def rt(ev):
        ev[0].record()
        _, _, hd, _, _ = buf.low_latency_dispatch(x, topk, T, E)
        ev[1].record()
        buf.low_latency_combine(y, topk, w, hd)
        ev[2].record()

    def plain():
        _, _, hd, _, _ = buf.low_latency_dispatch(x, topk, T, E)
        buf.low_latency_combine(y, topk, w, hd)

    for _ in range(20):
        plain()
    k = _kernel_times(plain, iters)
    d, c = _time_gpu_bound(rt, iters, 3)
    return {'dispatch_us': statistics.median(k['dispatch']), 'combine_us': statistics.median(k['combine']),
            'ev_round_trip_us': d + c}


def _max_over_ranks(v):
    t = torch.tensor([float(v)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _worker(rank, R, port, Ts, iters, json_path, num_ctas, baselines, proxy):
    # A stuck rank prints every thread's stack and exits instead of holding the GPUs until an outer timeout.
    faulthandler.dump_traceback_later(float(os.environ.get('LLEP_BENCH_WATCHDOG_S', '240')), exit=True)
    torch.cuda.set_device(rank)
    dev = torch.device('cuda', rank)
    init_gloo(rank, R, port, 120)
    group = dist.group.WORLD

    def say(msg):
        if rank == 0:
            print(f'[{time.strftime("%H:%M:%S")}] {msg}', flush=True)

    _ALIGN['nccl'] = dist.new_group(backend='nccl')
    _ALIGN['one'] = torch.ones(1, device=dev)
    dist.all_reduce(_ALIGN['one'], group=_ALIGN['nccl'])
    buf = llep.Buffer(group, low_latency_mode=True, explicitly_destroy=True)
    buf.backend = 'cuda'
    buf._options['num_ctas'] = num_ctas  # 0 = one CTA per SM
    rows = []
    for T in Ts:
        buf.clean_low_latency_buffer(buffer_tokens(T, R), H, E)
        r = _bench_llep(buf, rank, R, T, dev, iters)
        for line in r.pop('trace'):
            print(f'[rank {rank}] trace T={T} {line} (µs: median/max over CTAs)', flush=True)
        r = {k: _max_over_ranks(v) for k, v in r.items()}
        say(f'llep T={T}: ' + ', '.join(f'{k} {v:.1f}' for k, v in r.items() if k.endswith('_us')))
        r['T'] = T
        r['buffer_bytes'] = buf.runtime.buffer_bytes
        r['num_ctas'] = buf.runtime.num_ctas
        rows.append(r)
    buf.destroy()
    if proxy:
        # The inter-node path on the same GPUs: every peer through the CPU proxy (DeepEP's
        # allow_nvlink_for_low_latency_mode=False), libfabric per LLEP_FABRIC_PROVIDER (default shm, host-staged).
        say('llep over NVLink done; the proxy path next')
        pbuf = llep.Buffer(group, low_latency_mode=True, explicitly_destroy=True,
                           allow_nvlink_for_low_latency_mode=False)
        pbuf.backend = 'cuda'
        pbuf._options['num_ctas'] = num_ctas
        for r in rows:
            T = r['T']
            pbuf.clean_low_latency_buffer(buffer_tokens(T, R), H, E)
            pr = _bench_llep(pbuf, rank, R, T, dev, max(20, iters // 4))
            pr.pop('trace')
            pr = {k: _max_over_ranks(v) for k, v in pr.items() if k.endswith('_us')}
            say(f'llep proxy T={T}: ' + ', '.join(f'{k} {v:.1f}' for k, v in pr.items()))
            r.update({f'proxy_{k}': v for k, v in pr.items()})
        r0 = rows[0]
        r0['proxy_transport'] = pbuf.runtime.proxy_stats()['transport']
        pbuf.destroy()
    nccl = _ALIGN['nccl']
    if baselines:
        say('llep done; NCCL all_to_all_single baseline next')
    for r in rows if baselines else []:
        a = _bench_a2a(nccl, R, int(r['dispatch_remote_bytes']) * R // max(R - 1, 1), dev, iters)
        b = _bench_a2a(nccl, R, int(r['combine_remote_bytes']) * R // max(R - 1, 1), dev, iters)
        r['a2a_dispatch_bytes_us'], r['a2a_combine_bytes_us'] = _max_over_ranks(a), _max_over_ranks(b)
        de = _bench_deepep(nccl, rank, R, r['T'], dev, iters)
        if de is not None:
            r.update({f'deepep_{k}': _max_over_ranks(v) for k, v in de.items()})
    if rank == 0:
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        print(f'\nllep GPU low-latency benchmark: {R} x {torch.cuda.get_device_name(dev)}, hidden {H}, top-{K}, '
              f'{E} experts, FP8 dispatch / BF16 combine; medians of {iters} iterations, max over ranks (µs)')
        ref = max(rows, key=lambda r: (r['T'] == 128, r['T']))  # report the buffer at T=128 when measured
        print(f'buffer {ref["buffer_bytes"] / 2**30:.2f} GiB per rank at T={ref["T"]} '
              f'(DeepEP V1 hint {llep._llep.deepep_v1_size_hint(ref["T"], H, E) / 2**30:.2f} GiB); '
              f'{ref["num_ctas"]} of {sms} SMs per launch; DeepEP: '
              f'{"measured" if "deepep_dispatch_us" in ref else "not importable"}')
        print('kernel = kineto kernel time (DeepEP-comparable); events = CUDA-event gaps with the host queued ahead; '
              'hook columns: send/recv launches')
        hdr = (f'{"T":>4} | {"dispatch":>8} {"combine":>8} {"sum":>7} | {"d.send":>6} {"d.recv":>6} {"c.send":>6} '
               f'{"c.recv":>6} | {"ev.disp":>7} {"ev.comb":>7} {"ev.rt":>7} | {"a2a(d)":>6} {"a2a(c)":>6} | '
               f'{"DeepEP d/c":>11} | {"proxy d/c":>11} {"proxy rt":>8}')
        print(hdr)
        for r in rows:
            dd = (f'{r["deepep_dispatch_us"]:.1f}/{r["deepep_combine_us"]:.1f}' if 'deepep_dispatch_us' in r
                  else '-')
            pd = (f'{r["proxy_dispatch_us"]:.1f}/{r["proxy_combine_us"]:.1f}' if 'proxy_dispatch_us' in r else '-')
            print(f'{r["T"]:>4} | {r["dispatch_us"]:>8.1f} {r["combine_us"]:>8.1f} '
                  f'{r["dispatch_us"] + r["combine_us"]:>7.1f} | {r["dispatch_send_us"]:>6.1f} '
                  f'{r["dispatch_recv_us"]:>6.1f} {r["combine_send_us"]:>6.1f} {r["combine_recv_us"]:>6.1f} | '
                  f'{r["ev_dispatch_us"]:>7.1f} {r["ev_combine_us"]:>7.1f} {r["ev_round_trip_us"]:>7.1f} | '
                  f'{r.get("a2a_dispatch_bytes_us", float("nan")):>6.1f} '
                  f'{r.get("a2a_combine_bytes_us", float("nan")):>6.1f} | {dd:>11} | '
                  f'{pd:>11} {r.get("proxy_ev_round_trip_us", float("nan")):>8.1f}', flush=True)
        if proxy:
            print(f'proxy = every peer through the CPU proxy ({rows[0].get("proxy_transport", "?")}, host-staged): '
                  'kernel dispatch/combine and event round trip, the inter-node path on these GPUs')
        if json_path:
            with open(json_path, 'w') as f:
                json.dump({'ranks': R, 'gpu': torch.cuda.get_device_name(dev), 'hidden': H, 'experts': E,
                           'topk': K, 'iters': iters, 'rows': rows}, f, indent=1)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--ranks', type=int, default=0, help='GPUs (default: all visible, at most 8)')
    ap.add_argument('--tokens', type=int, nargs='*', default=[1, 32, 64, 128, 256])
    ap.add_argument('--iters', type=int, default=200)
    ap.add_argument('--json', default='')
    ap.add_argument('--num-ctas', type=int, default=int(os.environ.get('LLEP_NUM_CTAS', '0')))
    ap.add_argument('--no-baselines', action='store_true', help='llep alone (no NCCL all_to_all, no DeepEP)')
    ap.add_argument('--trace', action='store_true', help="print the kernels' diagnostic timeline per T")
    ap.add_argument('--no-proxy', action='store_true', help='skip the proxy-path (inter-node) measurement')
    args = ap.parse_args()
    if not torch.cuda.is_available() or not getattr(llep._llep, 'HAVE_CUDA', False):
        print('ll_gpu_bench: no CUDA device (or llep built without CUDA)')
        return 1
    if args.trace:
        os.environ['LLEP_KERNEL_TRACE'] = '1'  # inherited by the spawned ranks
    R = args.ranks or min(torch.cuda.device_count(), 8)
    if R < 2:
        print(f'll_gpu_bench: needs at least 2 GPUs, found {torch.cuda.device_count()}')
        return 1
    mp.spawn(_worker, args=(R, free_port(), args.tokens, args.iters, args.json, args.num_ctas,
                            not args.no_baselines, not args.no_proxy), nprocs=R, join=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
