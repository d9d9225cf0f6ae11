#!/usr/bin/env python3
"""llep and DeepEP V1 side by side, as a user sees them (issue #19): the same processes, inputs and Python calls,
the DeepSeek-V3 decode shape (hidden 7168, top-8, 256 experts, FP8 dispatch, BF16 combine), per T tokens per rank.

Columns, per system (medians of --iters, then the maximum over ranks: the slowest rank bounds a step):
  k.disp / k.comb     profiler (kineto) kernel times, one launch per op; the GPU is kept busy ahead (a GPU sleep
                      and a barrier) so the host is queued ahead, as DeepEP's bench_kineto does
  h.ds h.dr h.cs h.cr hook mode: send and receive launches of dispatch and combine apart (kernel times). The receive
                      is launched right behind its own send, so it also waits for the peers' sends: a send that ends
                      sooner can move time into its receive (bench/RESULTS.md session 42)
  h.dra h.cra         the same receives launched ~25 µs after their sends (a GPU spin between), as in an engine that
                      overlaps the receive with compute. Not always after the data arrived: in the queued loop the
                      ranks drift apart by its slack, and the fastest rank's receives still wait for a peer's send
                      (bench/RESULTS.md session 44)
  h.drs h.crs         the receives launched once every rank's send finished (synchronise and barrier between, per
                      iteration): the receive launch's own cost, no rank waiting for another
  h.drc h.crc         the same, with a 256 MiB fill between (its time not counted): the receive with L2 holding
                      none of its code or data, as after an engine's compute between a hook's send and its receive.
                      Unlike h.drs it does not move with where the code and data land (bench/RESULTS.md session 55)
  eager               host-inclusive round trip: stream synchronised and ranks met (barrier), then one CUDA event,
                      low_latency_dispatch + low_latency_combine from Python, one CUDA event. No GPU sleep: the
                      host's cost per call is in the number, as in an engine that does not capture graphs
  graph               the same two calls captured in one CUDA graph; the gap around one replay
  graph16             per round trip, in one CUDA graph of 16 round trips back to back (an engine's captured decode
                      step without its compute): no barrier exit or launch gap in it, so closest to the transport
  cpu.d / cpu.c       host CPU µs inside each Python call (perf_counter around it) while the GPU is kept busy ahead,
                      so no call waits for the device; *_dd: the same after torch.set_default_device('cuda'), which
                      DeepEP's test and some engines set (it sends every Python-level tensor call through a hook)
Ratios llep / DeepEP are printed per column. The systems are measured one after the other (the buffer of the one
measured first stays allocated, idle, for the paired phase), so the host-inclusive columns (eager, cpu) also carry
whatever the host did meanwhile: this benchmark's hosts switch between speed modes within a run. With both systems a
paired phase follows (both buffers alive, the two systems' calls alternating every iteration, the order swapped each
time): eager, graph (each system's graph of one round trip captured there) and cpu.d / cpu.c again, each cell with
the median over iterations of the per-iteration ratio llep / DeepEP, which such drift hits on both sides. Each T
runs with num_max_dispatch_tokens_per_rank = T when DeepEP accepts it (it needs R * T_max % 4 == 0), else the next
T_max that it accepts, for both systems; the refusal is reported. Before timing, both systems pass a correctness
gate at that T (BF16 dispatch, identity experts: combine must return sum_k w[t, k] * x[t] over the valid slots;
recv_count must equal the routed counts), so a broken kernel cannot produce a fast number.

Placement: where the buffers and outputs land in device memory moves a small-T launch with its code unchanged
(bench/RESULTS.md session 54: the settled dispatch receive at T = 8 / 32 0.93-0.95x / 1.02-1.11x of its time with 2-20
MiB held before the buffers, one rank), and one process measures one placement. LLEP_PLACEMENT_PAD_MB=N holds N MiB
of device memory from before the buffers on (both systems' allocations move; recorded in the JSON as
placement_pad_mb), so runs can sample placements (scripts/gpu_sbs_rounds.sh's LLEP_SBS_PLACEMENTS: one per round;
bench/placement_sweep.py: many in one process).

--expert-side (or LLEP_SBS_EXPERT_SIDE=1): llep's dispatch carries combine_weights, so its combine is reduced at the
expert side (kernels/EXPERT_SIDE_COMBINE.md); DeepEP's calls are unchanged.

Ranks: one process per GPU (--ranks defaults to the visible GPUs). --ranks larger than the GPU count makes ranks
share GPUs: the protocol runs, the times do not mean anything (the table says so). Output: a table last,
--json PATH (all numbers; each column of the main table also per rank, <system>_<column>_ranks) and a PNG plot of
eager and graph round trips vs T beside it (PATH with .png).
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

from kernel_times import gpu_ahead, kernel_times, settle  # bench/kernel_times.py
from local_group import buffer_tokens, free_port, init_gloo  # bench/local_group.py

H, E, K = 7168, 256, 8
SYSTEMS = ('llep', 'deepep')
COLUMNS = ('k_disp', 'k_comb', 'h_ds', 'h_dr', 'h_cs', 'h_cr', 'h_dra', 'h_cra', 'h_drs', 'h_crs', 'h_drc', 'h_crc',
           'eager', 'graph', 'graph16', 'cpu_d', 'cpu_c', 'cpu_d_dd', 'cpu_c_dd')
GRAPH_ROUND_TRIPS = 16
ARRIVAL_SPIN_CYCLES = 50_000  # h.dra / h.cra: ~25 µs at H100 / H200 clocks, past the ranks' skew at these sizes
COLD_FLUSH_MB = 256  # h.drc / h.crc: 5x an H100 / H200 L2 (50 MiB)



def _inputs(rank, T, dev):
    g = torch.Generator(device=dev).manual_seed(rank + 17)
    x = torch.randn((T, H), generator=g, device=dev).to(torch.bfloat16)
    topk = torch.topk(torch.rand((T, E), generator=g, device=dev), K, dim=-1).indices.to(torch.int64)
    if T > 1:
        topk[T // 2, K - 1] = -1  # a skipped slot, as engines send for padded or masked selections
    w = torch.rand((T, K), generator=g, device=dev)
    return x, topk, w


def _kernel_times(fn, iters):
    return kernel_times(fn, iters, gpu_ahead)


def _eager_samples(fns, iters, order):
    """Host-inclusive samples of each callable of fns ({name: fn}), those of iteration i called in the order order(i)
    names: per call an idle, aligned GPU (synchronised, ranks met), then CUDA events around the Python call.
    {name: [µs per iteration]}."""
    ev = {n: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
          for n in fns}
    for i in range(iters):
        for n in order(i):
            settle()
            ev[n][i][0].record()
            fns[n]()
            ev[n][i][1].record()
    torch.cuda.synchronize()
    return {n: [a.elapsed_time(b) * 1000 for a, b in ev[n]] for n in fns}


def _eager_times(fn, iters):
    """Host-inclusive time of fn (_eager_samples), median of iters."""
    return statistics.median(_eager_samples({'': fn}, iters, lambda i: ('',))[''])


def _captured(round_trip, n):
    """A CUDA graph holding n round trips (warmed up on the capture stream first), replayed 10 times."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        round_trip()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    settle()
    with torch.cuda.graph(g):
        for _ in range(n):
            round_trip()
    settle()
    for _ in range(10):
        g.replay()
    return g


def _graph_time(round_trip, n, iters):
    """_eager_times of one replay of a CUDA graph holding n round trips (_captured)."""
    g = _captured(round_trip, n)
    t = _eager_times(g.replay, iters)
    del g
    return t


CPU_CHUNK = 25  # iterations per gpu_ahead(): the launches they queue never fill the launch queue nor outlast the sleep


def _cpu_samples(calls, iters, order):
    """Host CPU µs inside each dispatch and its combine of each system of calls ({name: (dispatch, combine)}: dispatch()
    returns the handle combine takes), those of iteration i called in the order order(i) names, with the GPU kept busy
    ahead (re-armed every CPU_CHUNK iterations) so no call waits for the device. {name: ([dispatch µs], [combine µs])}."""
    out = {n: ([], []) for n in calls}
    for i0 in range(0, iters, CPU_CHUNK):
        gpu_ahead()
        for i in range(i0, min(i0 + CPU_CHUNK, iters)):
            for n in order(i):
                dispatch, combine = calls[n]
                t0 = time.perf_counter_ns()
                h = dispatch()
                t1 = time.perf_counter_ns()
                combine(h)
                t2 = time.perf_counter_ns()
                out[n][0].append((t1 - t0) / 1000)
                out[n][1].append((t2 - t1) / 1000)
        torch.cuda.synchronize()
    return out


def _cpu_times(dispatch, combine, iters):
    """Host CPU µs inside each call (_cpu_samples), medians of iters."""
    d, c = _cpu_samples({'': (dispatch, combine)}, iters, lambda i: ('',))['']
    return statistics.median(d), statistics.median(c)


class _System:
    """One system's buffer and calls, through the DeepEP V1 Python API both implement."""

    def __init__(self, name, group, R, T_top, expert_side=False):
        self.name = name
        # --expert-side: llep's dispatch carries the combine's weights (combine_weights=, kernels/EXPERT_SIDE_COMBINE.md)
        self.expert_side = expert_side and name == 'llep'
        if name == 'llep':
            import llep
            self.buf = llep.Buffer(group, num_rdma_bytes=llep.Buffer.get_low_latency_rdma_size_hint(T_top, H, R, E),
                                   low_latency_mode=True, explicitly_destroy=True)
            self.buf.backend = 'cuda'
        else:
            import deep_ep
            self.buf = deep_ep.Buffer(group, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(T_top, H, R, E),
                                      low_latency_mode=True, num_qps_per_rank=max(1, E // R),
                                      explicitly_destroy=True)

    def dispatch(self, x, topk, w, T_max, **kw):
        if self.expert_side:
            kw['combine_weights'] = w
        return self.buf.low_latency_dispatch(x, topk, T_max, E, **kw)

    def combine(self, y, topk, w, handle, **kw):
        return self.buf.low_latency_combine(y, topk, w, handle, **kw)


def _gate(sysm, rank, R, T, T_max, dev):
    """Correctness at this T (BF16 dispatch, identity experts), exact counts, combine within BF16 tolerance."""
    x, topk, w = _inputs(rank, T, dev)
    recv_x, count, handle, _, _ = sysm.dispatch(x, topk, w, T_max, use_fp8=False)
    combined, _, _ = sysm.combine(recv_x, topk, w, handle)
    torch.cuda.synchronize()
    all_topk = [torch.empty_like(topk.cpu()) for _ in range(R)]
    dist.all_gather(all_topk, topk.cpu())
    E_loc = E // R
    routed = torch.cat(all_topk)
    want = torch.stack([(routed == rank * E_loc + i).sum() for i in range(E_loc)]).to(torch.int32)
    if not torch.equal(count.cpu(), want):
        raise AssertionError(f'{sysm.name} T={T}: recv_count differs from the routed counts')
    ref = (x.float() * (w * (topk >= 0)).sum(1, keepdim=True)).to(torch.bfloat16).float()
    err = ((combined.float() - ref).norm() / ref.norm()).item()
    if not err < 2e-2:  # BF16 rows summed in fp32 then rounded: ~4e-3 expected; NaN fails too
        raise AssertionError(f'{sysm.name} T={T}: combine differs from sum_k w x by {err:.3g} (relative)')


def _round_trip_inputs(rank, R, T, T_max, dev):
    """(x, topk, w, y, out) of a measured round trip: the tokens, their routing and weights (_inputs), the expert
    outputs combine sends back, and combine's output."""
    x, topk, w = _inputs(rank, T, dev)
    y = torch.randn((E // R, R * T_max, H), device=dev).to(torch.bfloat16)
    out = torch.empty((T, H), dtype=torch.bfloat16, device=dev)
    return x, topk, w, y, out


def _calls(sysm, inputs, T_max):
    """(dispatch, combine) of one system on these inputs: dispatch() returns the handle combine(handle) takes."""
    x, topk, w, y, out = inputs
    return (lambda: sysm.dispatch(x, topk, w, T_max)[2], lambda hd: sysm.combine(y, topk, w, hd, out=out))


def _hook_round(sysm, inputs, T_max, spin=0, wait_all=False, before_recv=None):
    """One hook-mode round trip: dispatch send, its receive, combine send, its receive (four launches). spin: GPU
    cycles between each send and its receive; wait_all: every rank's send finished before each receive (settle);
    before_recv: called last before each receive is launched (e.g. work that evicts the caches, as an engine's compute
    between a hook's send and its receive does)."""
    x, topk, w, y, out = inputs

    def between():  # what runs between a send and its receive, the same for both ops
        if spin:
            torch.cuda._sleep(spin)
        if wait_all:
            settle()
        if before_recv is not None:
            before_recv()

    _, _, hd, _, hook = sysm.dispatch(x, topk, w, T_max, return_recv_hook=True)
    between()
    hook()
    _, _, chook = sysm.combine(y, topk, w, hd, out=out, return_recv_hook=True)
    between()
    chook()


def cache_flusher(mb, dev):
    """A fill of mb MiB on dev (made once), to call before a receive so that it finds L2 holding none of its code or
    data; None for mb <= 0."""
    if mb <= 0:
        return None
    scratch = torch.empty(mb << 20, dtype=torch.uint8, device=dev)
    return lambda: scratch.fill_(1)


_flushers = {}  # {device: cache_flusher} for h_drc / h_crc, made at its first use (_measure)


def _settled_receives(sysm, inputs, T_max, iters, before_recv=None):
    """h_drs / h_crs (module doc): each receive launched once every rank's send finished (a synchronise and a barrier
    between), so no rank waits for another: the launch's own cost, medians of iters. In the queued loops (h_dr, h_dra)
    the ranks drift apart by the loop's slack, so the fastest rank's receives wait for a peer's send however long the
    spin (RESULTS s44). before_recv: _hook_round's (its kernels are not the receives: not counted)."""
    ks = kernel_times(lambda: _hook_round(sysm, inputs, T_max, wait_all=True, before_recv=before_recv), iters, settle)
    return statistics.median(ks['dispatch'][1::2]), statistics.median(ks['combine'][1::2])


def _measure(sysm, rank, R, T, T_max, dev, iters):
    inputs = _round_trip_inputs(rank, R, T, T_max, dev)
    d, c = _calls(sysm, inputs, T_max)

    def plain():
        c(d())

    def hooked(spin=0):
        _hook_round(sysm, inputs, T_max, spin)

    for _ in range(20):
        plain()
        hooked()
    torch.cuda.synchronize()
    r = {}
    med = statistics.median
    k = _kernel_times(plain, iters)
    r['k_disp'], r['k_comb'] = med(k['dispatch']), med(k['combine'])
    kh = _kernel_times(hooked, iters)
    r['h_ds'], r['h_dr'] = med(kh['dispatch'][0::2]), med(kh['dispatch'][1::2])
    r['h_cs'], r['h_cr'] = med(kh['combine'][0::2]), med(kh['combine'][1::2])
    ka = _kernel_times(lambda: hooked(ARRIVAL_SPIN_CYCLES), iters)
    r['h_dra'], r['h_cra'] = med(ka['dispatch'][1::2]), med(ka['combine'][1::2])
    r['h_drs'], r['h_crs'] = _settled_receives(sysm, inputs, T_max, iters)
    # One scratch per process, made here, after the first system's buffer and outputs and the columns above: the
    # placement session 55 measured with (a scratch made earlier would move them).
    if dev not in _flushers:
        _flushers[dev] = cache_flusher(COLD_FLUSH_MB, dev)
    r['h_drc'], r['h_crc'] = _settled_receives(sysm, inputs, T_max, iters, before_recv=_flushers[dev])
    r['eager'] = _eager_times(plain, iters)
    r['graph'] = _graph_time(plain, 1, iters)
    r['graph16'] = _graph_time(plain, GRAPH_ROUND_TRIPS, iters) / GRAPH_ROUND_TRIPS
    r['cpu_d'], r['cpu_c'] = _cpu_times(d, c, iters)
    torch.set_default_device(dev)
    try:
        r['cpu_d_dd'], r['cpu_c_dd'] = _cpu_times(d, c, iters)
    finally:
        torch.set_default_device(None)
    torch.cuda.synchronize()
    return r


def _paired_host(objs, rank, R, T, T_max, dev, iters):
    """The paired phase (module doc): {name: {column: µs}} medians and {column: r}, the medians of the per-iteration
    ratios llep / DeepEP, for the columns PAIRED: the eager round trip, one replay of a graph of one round trip (each
    system's captured here, both alive), host CPU per dispatch and per combine."""
    inputs = _round_trip_inputs(rank, R, T, T_max, dev)
    names = ('llep', 'deepep')
    calls = {name: _calls(objs[name], inputs, T_max) for name in names}
    for _ in range(20):
        for name in names:
            d, c = calls[name]
            c(d())
    torch.cuda.synchronize()

    def order(i):
        return names if i % 2 == 0 else names[::-1]

    eager = _eager_samples({n: (lambda d=d, c=c: c(d())) for n, (d, c) in calls.items()}, iters, order)
    cpu = _cpu_samples(calls, iters, order)
    graphs = {n: _captured(lambda d=d, c=c: c(d()), 1) for n, (d, c) in calls.items()}
    graph = _eager_samples({n: g.replay for n, g in graphs.items()}, iters, order)
    del graphs
    samples = {'eager_p': eager, 'graph_p': graph, 'cpu_d_p': {n: v[0] for n, v in cpu.items()},
               'cpu_c_p': {n: v[1] for n, v in cpu.items()}}
    med = statistics.median
    per = {n: {col: med(v[n]) for col, v in samples.items()} for n in names}
    ratio = {col: med(a / b for a, b in zip(v['llep'], v['deepep'])) for col, v in samples.items()}
    return per, ratio


def _every_rank(v):
    """v of every rank, in rank order (the JSON's <system>_<column>_ranks: which rank set the maximum)."""
    t = torch.tensor([float(v)], dtype=torch.float64)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [x.item() for x in out]


def _max_over_ranks(v):
    return max(_every_rank(v))


def _placement_pad_mb():
    """MiB of device memory held from before the buffers on (LLEP_PLACEMENT_PAD_MB, module doc)."""
    return int(os.environ.get('LLEP_PLACEMENT_PAD_MB', '0'))


def _worker(rank, R, port, Ts, iters, systems, json_path, expert_side):
    faulthandler.dump_traceback_later(float(os.environ.get('LLEP_BENCH_WATCHDOG_S', '500')), exit=True)
    ngpu = torch.cuda.device_count()
    torch.cuda.set_device(rank % ngpu)
    dev = torch.device('cuda', rank % ngpu)
    init_gloo(rank, R, port, 300)
    group = dist.group.WORLD
    # The placement (module doc): memory held from before the buffers on, so every later allocation lands elsewhere.
    placement_pad = torch.empty(_placement_pad_mb() << 20, dtype=torch.uint8, device=dev)
    T_top = max(buffer_tokens(T, R) for T in Ts)
    rows = {T: {'T': T, 'T_max': buffer_tokens(T, R), 'deepep_refuses_T': buffer_tokens(T, R) != T} for T in Ts}
    notes = {}
    objs = {}
    for name in systems:
        try:
            sysm = _System(name, group, R, T_top, expert_side)
        except Exception as e:  # DeepEP not built / NVSHMEM refused: say so, measure the rest
            notes[name] = f'unavailable: {type(e).__name__}: {e}'
            if rank == 0:
                print(f'{name}: {notes[name]}', flush=True)
            continue
        for T in Ts:
            T_max = rows[T]['T_max']
            sysm.buf.clean_low_latency_buffer(T_max, H, E)
            try:
                _gate(sysm, rank, R, T, T_max, dev)
                r = _measure(sysm, rank, R, T, T_max, dev, iters)
            except Exception as e:
                notes[f'{name} T={T}'] = f'{type(e).__name__}: {e}'
                print(f'[rank {rank}] {name} T={T}: {type(e).__name__}: {e}', flush=True)
                raise
            every = {k: _every_rank(v) for k, v in r.items()}
            r = {k: max(vs) for k, vs in every.items()}
            rows[T].update({f'{name}_{k}': v for k, v in r.items()})
            rows[T].update({f'{name}_{k}_ranks': vs for k, vs in every.items()})
            if rank == 0:
                print(f'[{time.strftime("%H:%M:%S")}] {name} T={T} (T_max {T_max}): ' +
                      ', '.join(f'{k} {v:.1f}' for k, v in r.items()), flush=True)
        dist.barrier()
        objs[name] = sysm  # kept for the paired phase: destroyed at the end
    if rank == 0:
        if expert_side:
            notes['llep'] = 'combine_weights at dispatch (--expert-side): the combine reduced at the expert side'
        _report(R, ngpu, dev, iters, [rows[T] for T in Ts], notes, json_path)
    if len(objs) == len(SYSTEMS):
        for T in Ts:  # after the report: whatever happens here, the main table is out
            T_max = rows[T]['T_max']
            for sysm in objs.values():
                sysm.buf.clean_low_latency_buffer(T_max, H, E)
            per, ratio = _paired_host(objs, rank, R, T, T_max, dev, iters)
            for name, cols in per.items():
                rows[T].update({f'{name}_{k}': _max_over_ranks(v) for k, v in cols.items()})
            rows[T].update({f'ratio_{k}': _max_over_ranks(v) for k, v in ratio.items()})
        if rank == 0:
            _report_paired(iters, [rows[T] for T in Ts], json_path)
    for sysm in objs.values():
        sysm.buf.destroy()
    torch.cuda.synchronize()
    del placement_pad  # held until here
    dist.destroy_process_group()


def _report(R, ngpu, dev, iters, rows, notes, json_path):
    gpu = torch.cuda.get_device_name(dev)
    shared = R > ngpu
    print(f'\nllep vs DeepEP V1, low latency: {R} ranks on {ngpu} x {gpu}, hidden {H}, top-{K}, {E} experts, FP8 '
          f'dispatch / BF16 combine; medians of {iters}, max over ranks (µs); ratio = llep / DeepEP')
    if shared:
        print('WARNING: ranks share GPUs: protocol check only, these times are not performance numbers')
    for k, v in notes.items():
        print(f'note: {k}: {v}')
    hdr = f'{"T":>4} {"Tmax":>4} | ' + ' '.join(f'{c:>17}' for c in COLUMNS)
    print(hdr)
    for r in rows:
        cells = []
        for c in COLUMNS:
            a, b = r.get(f'llep_{c}'), r.get(f'deepep_{c}')
            if a is None:
                cells.append(f'{"-":>17}')
            elif b is None:
                cells.append(f'{a:>7.1f}/{"-":>5}{"":>4}')
            else:
                cells.append(f'{a:>6.1f}/{b:>5.1f} {a / b:>4.2f}')
        print(f'{r["T"]:>4} {r["T_max"]:>4} | ' + ' '.join(cells))
    print('cells: llep/DeepEP ratio. k = kernel, h = hook send/recv kernels (d/c; h_dra / h_cra: the receives '
          'launched ~25 µs after their sends, h_drs / h_crs: once every rank\'s send finished, h_drc / h_crc: the '
          'same after a cache-evicting fill), eager = '
          'host-inclusive round trip, graph = one replay of both, graph16 = per round trip in a graph of 16, cpu = '
          'host µs per call (_dd: with a default device)')
    refused = [r['T'] for r in rows if r['deepep_refuses_T']]
    if refused:
        print(f'DeepEP refuses num_max_dispatch_tokens_per_rank = T for T in {refused} (R * T % 4 != 0): both ran '
              'with the T_max shown')
    if not json_path:
        return
    with open(json_path, 'w') as f:
        json.dump({'ranks': R, 'gpus': ngpu, 'gpu': gpu, 'shared_gpus': shared, 'hidden': H, 'experts': E,
                   'topk': K, 'iters': iters, 'notes': notes, 'rows': rows, 'placement_pad_mb': _placement_pad_mb(),
                   'date': time.strftime('%Y-%m-%d %H:%M:%S')}, f, indent=1)
    from plot_axes import new_axes  # bench/, the script's own folder (on sys.path when run as a script)
    axes = new_axes()
    if axes is None:
        return
    fig, ax = axes
    Ts = [r['T'] for r in rows]
    for name, color in (('llep', 'tab:blue'), ('deepep', 'tab:red')):
        for col, style in (('eager', '-o'), ('graph', '--s')):
            ys = [r.get(f'{name}_{col}') for r in rows]
            if all(y is not None for y in ys):
                ax.plot(Ts, ys, style, color=color, label=f'{name} {col}')
    ax.set_xscale('log', base=2)
    ax.set_xlabel('tokens per rank (T)')
    ax.set_ylabel('dispatch + combine round trip (µs, median)')
    ax.set_title(f'{R} ranks, {gpu}' + (' (shared GPUs: not performance)' if shared else ''))
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend()
    png = os.path.splitext(json_path)[0] + '.png'
    fig.savefig(png, dpi=110, bbox_inches='tight')
    print(f'wrote {json_path} and {png}')


PAIRED = ('eager_p', 'graph_p', 'cpu_d_p', 'cpu_c_p')


def _report_paired(iters, rows, json_path):
    """The paired phase's table (module doc), and its numbers added to the JSON _report wrote."""
    print(f'\npaired host-inclusive columns: both buffers alive, the calls alternating every iteration; cells llep / '
          f'DeepEP µs (medians of {iters}) and the median of the per-iteration ratios, max over ranks')
    print(f'{"T":>4} {"Tmax":>4} | ' + ' '.join(f'{c:>17}' for c in PAIRED))
    for r in rows:
        cells = [f'{r[f"llep_{c}"]:>6.1f}/{r[f"deepep_{c}"]:>5.1f} {r[f"ratio_{c}"]:>4.2f}' for c in PAIRED]
        print(f'{r["T"]:>4} {r["T_max"]:>4} | ' + ' '.join(cells))
    if not json_path:
        return
    with open(json_path) as f:
        data = json.load(f)
    data['rows'] = rows
    with open(json_path, 'w') as f:
        json.dump(data, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--ranks', type=int, default=0, help='ranks (default: the visible GPUs, at most 8)')
    ap.add_argument('--tokens', type=int, nargs='*', default=[1, 8, 32, 128, 256])
    ap.add_argument('--iters', type=int, default=200)
    ap.add_argument('--systems', default='llep,deepep', help='comma-separated subset of llep,deepep')
    ap.add_argument('--json', default='')
    ap.add_argument('--expert-side', action='store_true', default=os.environ.get('LLEP_SBS_EXPERT_SIDE') == '1',
                    help="llep's dispatch carries the combine's weights (combine_weights=): its combine reduced at "
                         "the expert side, one row per (token, rank); DeepEP unchanged. Default: "
                         "LLEP_SBS_EXPERT_SIDE=1 (so a scripts/gpu_sbs_rounds.sh variant can set it)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print('ll_side_by_side: no CUDA device')
        return 1
    systems = parse_systems(ap, args.systems)
    spawn_ranks(_worker, args.ranks, lambda R: (args.tokens, args.iters, systems, args.json, args.expert_side))
    return 0


def parse_systems(ap, text):
    """--systems: a non-empty comma-separated subset of SYSTEMS, in the given order (ap.error otherwise)."""
    systems = [s for s in text.split(',') if s]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        ap.error(f'--systems: a comma-separated subset of {",".join(SYSTEMS)}, got {text!r}')
    return systems


def spawn_ranks(worker, ranks, worker_args):
    """worker(rank, R, port, *worker_args(R)) in one process per rank (ranks, default: the visible GPUs, at most 8),
    NVLink multicast kept off in NCCL, torch and NVSHMEM."""
    R = ranks or min(torch.cuda.device_count(), 8)
    os.environ.setdefault('NCCL_NVLS_ENABLE', '0')
    os.environ.setdefault('TORCH_SYMM_MEM_DISABLE_MULTICAST', '1')
    os.environ.setdefault('NVSHMEM_DISABLE_NVLS', '1')
    mp.spawn(worker, args=(R, free_port(), *worker_args(R)), nprocs=R, join=True)


if __name__ == '__main__':
    sys.exit(main())
