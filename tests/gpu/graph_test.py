#!/usr/bin/env python3
"""CUDA graphs on the GPU backend against the CPU backend (issue #5).

Every rank holds one GPU Buffer and one CPU Buffer (the oracle) on a gloo group. On the single GPU Buffer it
captures, into one memory pool and in global capture mode (any host synchronisation from any thread fails the
capture) while the metrics exporter's collector thread snapshots every millisecond:
  hooks             dispatch / combine with receive hooks and a GEMM between each send and its receive,
                    one graph per size 1, 2, 4, ..., T
  no_hooks          one launch per operation (BF16 dispatch), sizes T and 3
  two_microbatches  dispatch-send A, dispatch-send B, hook A, hook B, combine A, combine B, hooks (FP8 round_scale)
  odd_calls         dispatch, combine, the same combine again: 3 calls, so each replay flips the parity a host
                    counter would bake (DeepEP#93)
  expert_side       hooks with combine_weights at dispatch (the combine reduced at the experts' ranks), every size;
  expert_side_two_microbatches  the same with two micro-batches (FP8): a kept plan per buffer half in flight
With LLEP_RANKS_PER_NODE set (virtual nodes), the same runs over the inter-node path and checks that the replays'
kernels pushed their traffic to the CPU proxy. Then it replays them --steps times (default 10,000) in random order: each step all ranks pick the same kind and
input variant, each rank its own graph size among those that hold its tokens (so ranks replay different graphs at
once), and every result (combined output, recv_count, layout_range, recv_x bytes, scales, src_info of every
dispatch) is compared bit for bit with the CPU backend's result for that variant on the GPU, without a host sync
per step. Afterwards the kernels' metrics must count exactly the operations the replays and warm-ups ran. A graph of
three dispatches of different MoE layers (the `layer` keyword) counts each layer's tokens in its own row on replay.
Hooks captured in other graphs than their sends, replayed out of order and after a send graph replayed twice,
still pair with the right operation (the device pairs them by tag). Misuse the device must catch where the host
cannot see it (every call was legal in capture order): a graph that only sends, replayed a third time before a
receive (kGpuInFlight); a graph that only receives, replayed twice (kGpuBadReceive); a third dispatch right after
two dispatches in flight were received (kGpuRegionBusy: peers may still read its region). Each raises a clear
LlepFailedPreconditionError, never hangs, and the buffer refuses further calls.

Runs without pytest (scripts/gpu_test.sh calls it); ranks share GPUs round-robin when fewer GPUs than ranks.
Prints one line per check and rank; exit code 0 only if all passed.
"""
import argparse
import datetime
import json
import os
import random
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'python'))

import llep  # noqa: E402
from llep.utils import free_port  # noqa: E402
from llep.graph_capture import DecodeGraphs, pick_size  # noqa: E402

import graph_steps  # noqa: E402

H, E, K = 2048, 64, 8
VARIANTS = 4


def _tokens(rank, variant, T):
    return 1 + (variant * 7 + rank * 5 + variant * rank) % T  # per rank and variant, 1..T


def _buffer(gloo, backend, T):
    """A llep Buffer on `backend` with the layout for T tokens per rank (collective)."""
    buf = llep.Buffer(gloo, low_latency_mode=True, explicitly_destroy=True)
    buf.backend = backend
    buf.clean_low_latency_buffer(T, H, E)
    return buf


def _soak(rank, R, T, steps, gloo, log):
    dev = torch.device('cuda', torch.cuda.current_device())
    gpu = _buffer(gloo, 'cuda', T)
    cpu = _buffer(gloo, 'cpu', T)
    port = gpu.start_metrics_exporter(0, interval_s=0.001)  # its thread snapshots during every capture below

    # The CPU backend's results per (kind, variant), through the same padded static inputs as the graphs.
    refs, inputs = {}, {}
    for v in range(VARIANTS):
        inputs[v] = graph_steps.make_inputs(rank, v, _tokens(rank, v, T), H, E, K, torch.device('cpu'))
    for kind in graph_steps.KINDS:
        eager = DecodeGraphs(cpu, graph_steps.make_step(cpu, kind, T, E), max_tokens=T, hidden=H, num_topk=K,
                             sizes=graph_steps.kind_sizes(kind, T), use_graphs=False)
        eager.capture()
        for v in range(VARIANTS):
            n = inputs[v][0].size(0)
            # two micro-batches split the padded batch: its references are per captured size
            for size in ([s for s in eager.sizes if s >= n] if kind.endswith('two_microbatches') else [None]):
                refs[(kind, v, size)] = tuple(t.to(dev) for t in eager.run(*inputs[v], size=size))
    gpu_inputs = {v: tuple(t.to(dev) for t in inputs[v]) for v in inputs}

    # Captures: one buffer, one pool, every kind; a GEMM between sends and receives.
    a = torch.randn((512, 512), device=dev, dtype=torch.bfloat16)
    gemm_out = torch.empty_like(a)

    def between():
        torch.mm(a, a, out=gemm_out)

    t0 = time.time()
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    for kind in graph_steps.KINDS:
        graphs[kind] = DecodeGraphs(gpu, graph_steps.make_step(gpu, kind, T, E, between=between), max_tokens=T,
                                    hidden=H, num_topk=K, sizes=graph_steps.kind_sizes(kind, T), pool=pool,
                                    capture_error_mode='global')
        graphs[kind].capture()
    capture_s = time.time() - t0
    gpu.stop_metrics_exporter()
    log({'check': 'capture_global_mode_with_collector_thread', 'rank': rank, 'ok': True, 'port': port,
         'graphs': {k: g.sizes for k, g in graphs.items()}, 'seconds': round(capture_s, 1)})

    torch.cuda.synchronize()
    before = gpu.metrics_snapshot()['ops']
    shared = random.Random(1234)       # the same kind and variant on every rank
    local = random.Random(99 + rank)   # each rank its own graph size
    flags = torch.zeros(steps, dtype=torch.bool, device=dev)
    plan = []
    calls = {'dispatch': 0, 'combine': 0}
    t0 = time.time()
    for i in range(steps):
        kind = shared.choice(list(graph_steps.KINDS))
        v = shared.randrange(VARIANTS)
        g = graphs[kind]
        n = gpu_inputs[v][0].size(0)
        size = local.choice([s for s in g.sizes if s >= n])
        got = g.run(*gpu_inputs[v], size=size)
        ref = refs[(kind, v, size if kind.endswith('two_microbatches') else None)]
        flags[i] = graph_steps.mismatch(got, ref)
        plan.append((kind, v, size))
        d, c = graph_steps.KINDS[kind][2]
        calls['dispatch'] += d
        calls['combine'] += c
    torch.cuda.synchronize()
    soak_s = time.time() - t0
    errs = []
    try:
        gpu.check_errors()
    except llep.LlepError as e:
        errs.append(f'kernel error after the replays: {e}')
    bad = flags.nonzero().flatten().tolist()
    if bad:
        kind, v, size = plan[bad[0]]
        got = graphs[kind].run(*gpu_inputs[v], size=size)
        ref = refs[(kind, v, size if kind.endswith('two_microbatches') else None)]
        errs.append(f'{len(bad)} of {steps} replays differ from the CPU backend; first: step {bad[0]} ({kind}, '
                    f'variant {v}, size {size}): {graph_steps.describe_mismatch(got, ref)}')
    after = gpu.metrics_snapshot()['ops']
    counted = {op: after[op] - before[op] for op in after}
    if counted != calls:
        errs.append(f'metrics counted {counted} operations during the replays, the graphs ran {calls}')
    by_kind = {k: sum(1 for p in plan if p[0] == k) for k in graph_steps.KINDS}
    log({'check': f'replays_{steps}_random_order_vs_cpu_backend', 'rank': rank, 'ok': not errs, 'errors': errs,
         'by_kind': by_kind, 'sizes_used': sorted({(p[0], p[2]) for p in plan}), 'seconds': round(soak_s, 1),
         'us_per_step': round(soak_s / steps * 1e6, 1)})

    # Eager calls still agree after all those replays (the device sequence moved on; the host's did not).
    ref = refs[('hooks', 0, None)]
    e2 = []
    for name, got in (('replay', graphs['hooks'].run(*gpu_inputs[0])),
                      ('eager', graph_steps.make_step(gpu, 'hooks', T, E)(*gpu_inputs[0])),
                      ('replay after eager', graphs['hooks'].run(*gpu_inputs[0]))):
        if bool(graph_steps.mismatch(got, ref)):
            e2.append(f'{name}: {graph_steps.describe_mismatch(got, ref)}')
    log({'check': 'eager_calls_mix_with_replays', 'rank': rank, 'ok': not e2, 'errors': e2})
    if int(os.environ.get('LLEP_RANKS_PER_NODE', '0')) > 0:
        # Virtual nodes: the replays must really have gone through the proxy (FIFO commands pushed by replayed
        # kernels, no host work per step), not silently over NVLink.
        paths, st = gpu.runtime.peer_paths(), gpu.runtime.proxy_stats()
        e3 = [] if 'proxy' in paths and st['commands'] >= steps else [f'paths {paths}, proxy stats {st}']
        log({'check': 'replays_went_through_the_proxy', 'rank': rank, 'ok': not e3, 'errors': e3,
             'proxy_commands': st['commands']})
    for g in graphs.values():
        g.reset()
    torch.cuda.synchronize()
    gpu.destroy()
    cpu.destroy()


def _cross_graph_hooks(rank, T, gloo, log):
    """Sends and their receive hooks captured in separate graphs (the device pairs them by the send's tag, whatever
    graph holds either): hooks replayed in the other order than their sends, and one send graph replayed twice
    before its hook graph is replayed twice (each receive takes the older waiting operation). An eager combine of
    the received tokens follows each pair, as a decode loop's would (and as the in-flight rules require before a
    dispatch region is reused). Every dispatch result must equal the CPU backend's for the inputs its send
    carried, and every combine must run without a kernel error."""
    dev = torch.device('cuda', torch.cuda.current_device())
    cpu = _buffer(gloo, 'cpu', T)
    buf = _buffer(gloo, 'cuda', T)
    variants = [graph_steps.make_inputs(rank, 20 + v, T, H, E, K, torch.device('cpu')) for v in range(3)]
    refs = []
    for x, ids, _ in variants:
        recv, count, handle, _, _ = cpu.low_latency_dispatch(x, ids, T, E)
        refs.append(tuple(t.to(dev) for t in graph_steps.masked_dispatch(recv, count, handle)))
    cpu.destroy()
    on_dev = [tuple(t.to(dev) for t in v) for v in variants]
    static = [tuple(t.clone() for t in on_dev[v][:2]) for v in range(2)]  # inputs of send graphs A and B
    send_graphs, recv_graphs, outs = [], [], []
    torch.cuda.synchronize()
    for x, ids in static:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            recv, count, handle, _, hook = buf.low_latency_dispatch(x, ids, T, E, return_recv_hook=True)
        outs.append((recv, count, handle, hook))
        send_graphs.append(g)
    for _, _, _, hook in outs:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            hook()
        recv_graphs.append(g)
    errs = []

    def check(what, graph_idx, variant):
        recv, count, handle, _ = outs[graph_idx]
        got = graph_steps.masked_dispatch(recv, count, handle)
        if bool(graph_steps.mismatch(got, refs[variant])):
            errs.append(f'{what}: {graph_steps.describe_mismatch(got, refs[variant])}')

    def combine(graph_idx, variant):  # eager, one launch
        recv, count, handle, _ = outs[graph_idx]
        buf.low_latency_combine(graph_steps.expert(recv, count, handle), on_dev[variant][1], on_dev[variant][2],
                                handle)

    for _ in range(3):
        send_graphs[0].replay()  # A
        send_graphs[1].replay()  # B: two operations in flight
        recv_graphs[1].replay()  # B's hook first
        check('hook B replayed before hook A', 1, 1)
        recv_graphs[0].replay()
        check('hook A replayed after hook B', 0, 0)
        combine(0, 0)
        # One send graph twice with different inputs (A then A'), then its hook graph twice: oldest first.
        send_graphs[0].replay()
        static[0][0].copy_(on_dev[2][0])
        static[0][1].copy_(on_dev[2][1])
        send_graphs[0].replay()
        recv_graphs[0].replay()
        check('first hook replay of a send graph replayed twice (inputs A)', 0, 0)
        recv_graphs[0].replay()
        check("second hook replay (inputs A')", 0, 2)
        combine(0, 2)
        static[0][0].copy_(on_dev[0][0])
        static[0][1].copy_(on_dev[0][1])
    torch.cuda.synchronize()
    try:
        buf.check_errors()
    except llep.LlepError as e:
        errs.append(f'kernel error: {e}')
    log({'check': 'hooks_in_other_graphs_than_their_sends', 'rank': rank, 'ok': not errs, 'errors': errs[:3]})
    del send_graphs, recv_graphs, outs
    torch.cuda.synchronize()
    buf.destroy()


def _layers_in_graph(rank, T, gloo, log, replays=25):
    """One graph runs three MoE layers (dispatch with layer=0, 5, 2, then combine, each with its own routing) through
    one buffer, as an engine's decode step does: the layer is a kernel argument baked into the capture, so every
    replay adds each layer's receive counts to its own row of the per-layer expert counters, exactly (replays x that
    layer's recv_count), and nothing to other rows."""
    dev = torch.device('cuda', torch.cuda.current_device())
    buf = _buffer(gloo, 'cuda', T)
    layers = (0, 5, 2)
    ins = [graph_steps.make_inputs(rank, v, T, H, E, K, dev) for v in range(len(layers))]

    def step():
        counts = []
        for (x, ids, w), layer in zip(ins, layers):
            recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, ids, T, E, use_fp8=False, layer=layer)
            buf.low_latency_combine(recv_x, ids, w, handle)
            counts.append(count)
        return counts

    counts = [c.clone() for c in step()]  # eager, once: the per-layer recv_count to expect
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    before = buf.metrics_snapshot()['layer_expert_recv_tokens']
    for _ in range(replays):
        graph.replay()
    after = buf.metrics_snapshot()['layer_expert_recv_tokens']
    want = torch.zeros_like(before)
    for c, layer in zip(counts, layers):
        want[layer] += replays * c.cpu().to(torch.int64)
    errs = []
    if not torch.equal(after - before, want):
        rows = sorted(set((after - before).nonzero()[:, 0].tolist()) | set(layers))
        errs.append(f'per-layer counts over {replays} replays: rows {rows} got '
                    f'{[(after - before)[r].tolist() for r in rows]}, want {[want[r].tolist() for r in rows]}')
    log({'check': 'layer_keyword_baked_into_graph', 'rank': rank, 'ok': not errs, 'errors': errs})
    del graph
    torch.cuda.synchronize()
    buf.destroy()


def _misuse(rank, T, gloo, log):
    """Graphs whose replays break the in-flight rule: the device reports them (the host saw a valid capture)."""
    dev = torch.device('cuda', torch.cuda.current_device())
    x, ids, w = graph_steps.make_inputs(rank, 0, T, H, E, K, dev)
    for case in ('send_without_receive_replayed_twice', 'receive_replayed_twice', 'third_dispatch_after_two_in_flight'):
        buf = _buffer(gloo, 'cuda', T)
        send_graph, recv_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        holder = {}
        torch.cuda.synchronize()
        with torch.cuda.graph(send_graph):
            holder['out'] = buf.low_latency_dispatch(x, ids, T, E, return_recv_hook=True)
        with torch.cuda.graph(recv_graph):
            holder['out'][4]()  # the hook: a receive launch alone in its graph
        errs = []
        t0 = time.time()
        if case == 'send_without_receive_replayed_twice':
            send_graph.replay()  # two sends in flight: allowed
            send_graph.replay()
            send_graph.replay()  # the third reuses the first one's half, still unreceived
            want = 'still held call'
        elif case == 'receive_replayed_twice':
            send_graph.replay()
            recv_graph.replay()
            recv_graph.replay()  # nothing is waiting any more
            want = 'not waiting for it'
        else:
            # Two dispatches in flight, both received, then a third dispatch into the first one's region: peers
            # may still be reading it. The host allowed each call in capture order; the device refuses the replay.
            send_graph.replay()
            send_graph.replay()
            recv_graph.replay()
            recv_graph.replay()
            send_graph.replay()
            want = 'before they are known to have received it'
        torch.cuda.synchronize()
        try:
            buf.check_errors()
            errs.append('not reported')
        except llep.LlepFailedPreconditionError as e:
            if want not in str(e):
                errs.append(f'unexpected message: {e}')
        except llep.LlepError as e:
            errs.append(f'wrong error type {type(e).__name__}: {e}')
        if time.time() - t0 > 10:
            errs.append(f'took {time.time() - t0:.1f} s')
        try:
            buf.low_latency_dispatch(x, ids, T, E)
            errs.append('the buffer accepted a call after the error')
        except llep.LlepFailedPreconditionError:
            pass
        log({'check': f'device_refuses_{case}', 'rank': rank, 'ok': not errs, 'errors': errs})
        del send_graph, recv_graph, holder
        torch.cuda.synchronize()
        buf.destroy()


def _worker(rank, R, port, T, steps, results_path):
    os.environ['LLEP_TIMEOUT_S'] = '10'
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=R,
                            timeout=datetime.timedelta(seconds=300))
    gloo = dist.group.WORLD

    def log(rec):
        with open(results_path, 'a') as f:
            f.write(json.dumps(rec) + '\n')

    try:
        _soak(rank, R, T, steps, gloo, log)
        _cross_graph_hooks(rank, T, gloo, log)
        _layers_in_graph(rank, T, gloo, log)
        _misuse(rank, T, gloo, log)
    except Exception:
        log({'check': 'exception', 'rank': rank, 'ok': False, 'errors': [traceback.format_exc()[-2000:]]})
        raise
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--results', default='graph_test.jsonl')
    ap.add_argument('--ranks', type=int, default=0, help='default: the GPU count (at least 2)')
    ap.add_argument('--T', type=int, default=32)
    ap.add_argument('--steps', type=int, default=10000)
    args = ap.parse_args()
    if not torch.cuda.is_available() or not getattr(llep._llep, 'HAVE_CUDA', False):
        print('graph_test: SKIPPED (no CUDA device or llep built without CUDA)')
        return 0
    R = args.ranks or max(2, torch.cuda.device_count())
    open(args.results, 'w').close()
    rc = 0
    try:
        mp.spawn(_worker, args=(R, free_port(), args.T, args.steps, args.results), nprocs=R, join=True)
    except Exception as e:
        print(f'graph_test: worker failed: {e}', flush=True)
        rc = 1
    recs = [json.loads(l) for l in open(args.results)]
    by_check = {}
    for r in recs:
        by_check.setdefault(r['check'], []).append(r)
    for name, rs in by_check.items():
        ok = all(r['ok'] for r in rs) and len(rs) == R
        rc |= 0 if ok else 1
        extra = ''
        if 'us_per_step' in rs[0]:
            extra = f' ({rs[0]["seconds"]} s, {rs[0]["us_per_step"]} us/step, by kind {rs[0]["by_kind"]})'
        print(f'{"PASS" if ok else "FAIL"} {name}: {len(rs)}/{R} ranks{extra}')
        for r in rs:
            for e in r.get('errors', [])[:3]:
                print(f'    rank {r["rank"]}: {e}')
    n_ok = sum(all(r['ok'] for r in rs) and len(rs) == R for rs in by_check.values())
    print(f'graph_test: {n_ok}/{len(by_check)} checks passed on {R} ranks')
    return rc


if __name__ == '__main__':
    sys.exit(main())
