#!/usr/bin/env python3
"""Where a low-latency call's host microseconds go (issue #19 item 2): one rank, the GPU kept busy ahead so no call
waits for the device, medians of --iters of each step alone: the output allocations, the native call with prepared
addresses, the whole Python call; for llep and, when importable, DeepEP's whole calls. Run on a GPU machine:
    PYTHONPATH=build-gpu/python python3 bench/host_path_breakdown.py [--tokens 8]"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from local_group import free_port, init_gloo  # bench/local_group.py

H, E, K = 7168, 256, 8


def _timed(fn, iters):
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        ts.append((time.perf_counter_ns() - t0) / 1000)
    torch.cuda.synchronize()
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--tokens', type=int, default=8)
    ap.add_argument('--iters', type=int, default=300)
    args = ap.parse_args()
    init_gloo(0, 1, free_port(), 60)
    import llep
    dev = torch.device('cuda', 0)
    T = args.tokens
    x = torch.randn((T, H), device=dev).to(torch.bfloat16)
    topk = torch.topk(torch.rand((T, E), device=dev), K, dim=-1).indices.to(torch.int64)
    w = torch.rand((T, K), device=dev)
    buf = llep.Buffer(dist.group.WORLD, low_latency_mode=True, explicitly_destroy=True)
    buf.backend = 'cuda'
    (rx, sc), cnt, hd, _, _ = buf.low_latency_dispatch(x, topk, T, E)
    y = torch.randn((E, T, H), device=dev).to(torch.bfloat16)
    out = torch.empty((T, H), dtype=torch.bfloat16, device=dev)
    rt = buf.runtime
    res = {}
    from llep.buffer import _new_combine_out, _new_dispatch_outputs  # what a call without a free pooled set runs
    spec = buf._dispatch_outputs(True, False)
    res['5 x new_empty (dispatch outputs, reuse off)'] = _timed(lambda: _new_dispatch_outputs(False, x, spec, True),
                                                               args.iters)
    res['dispatch outputs in one block (pool misses)'] = _timed(lambda: _new_dispatch_outputs(True, x, spec, True),
                                                                args.iters)
    res['1 x new_empty (combine out, reuse off)'] = _timed(lambda: _new_combine_out(False, w, T, H), args.iters)
    pool = buf._dispatch_pool
    if pool is not None:
        buf.low_latency_dispatch(x, topk, T, E)  # a second set, dropped: free (the first is held above)
        stream0 = buf._stream()
        res['output pool take (dispatch: a held set, a free one)'] = _timed(lambda: pool.take((True, False, stream0)),
                                                                            args.iters)
    res['Buffer._stream()'] = _timed(buf._stream, args.iters)
    res['7 x data_ptr()'] = _timed(lambda: [t.data_ptr() for t in (x, topk, rx, sc, cnt, hd[0], hd[1])], args.iters)
    from llep._call_checks import _fast_ok, _NoTorchFunction

    def no_torch_function_block():
        with _NoTorchFunction():
            pass

    def checks():
        with _NoTorchFunction():
            return (_fast_ok(x, torch.bfloat16, 0) and _fast_ok(topk, torch.int64, 0) and
                    len(s := topk.shape) == 2 and s[0] == T)
    res['dispatch tensor checks (x, topk) + no-torch-function'] = _timed(checks, args.iters)
    for name, op in (('x.dtype', lambda: x.dtype), ('x.is_contiguous()', x.is_contiguous),
                     ('x.get_device()', x.get_device), ('x.shape == (T, H)', lambda: x.shape == (T, H)),
                     ('x.size(0)', lambda: x.size(0)), ('x.data_ptr()', x.data_ptr),
                     ('_NoTorchFunction enter + exit', no_torch_function_block)):
        res['  one op: ' + name] = _timed(op, args.iters)
    ptrs = [t.data_ptr() for t in (x, topk, rx, sc, cnt, hd[0], hd[1])]
    stream = buf._stream()

    # The native calls as llep/buffer.py makes them, every argument named as the DispatchCall / CombineCall field it
    # fills (the dispatch through one Python frame more: ~0.05 µs).
    def native_dispatch(split):
        return rt.dispatch(x=ptrs[0], topk_idx=ptrs[1], combine_weights=None, num_tokens=T, num_topk=K, use_fp8=True,
                           round_scale=False, use_ue8m0=False, recv_x=ptrs[2], recv_scales=ptrs[3],
                           recv_count=ptrs[4], src_info=ptrs[5], layout_range=ptrs[6],
                           cumulative_local_expert_recv_stats=0, wait_recv_cost_stats=0, layer=0, plan_key=0,
                           split=split, stream=stream)

    res['native dispatch (addresses ready)'] = _timed(lambda: native_dispatch(False), args.iters)
    res['native dispatch send + receive (hook)'] = _timed(lambda: rt.receive(native_dispatch(True), stream),
                                                          args.iters)
    res['native combine (addresses ready)'] = _timed(lambda: rt.combine(
        x=y.data_ptr(), zero_copy=False, topk_idx=topk.data_ptr(), topk_weights=w.data_ptr(), num_tokens=T,
        num_topk=K, layout_range=hd[1].data_ptr(), out=out.data_ptr(), wait_recv_cost_stats=0, plan_key=0,
        expert_reduced=False, split=False, stream=stream), args.iters)
    res['llep low_latency_dispatch'] = _timed(lambda: buf.low_latency_dispatch(x, topk, T, E), args.iters)
    res['llep low_latency_combine'] = _timed(lambda: buf.low_latency_combine(y, topk, w, hd, out=out), args.iters)
    res['llep low_latency_combine (no out=)'] = _timed(lambda: buf.low_latency_combine(y, topk, w, hd), args.iters)
    res['llep low_latency_dispatch bf16'] = _timed(lambda: buf.low_latency_dispatch(x, topk, T, E, use_fp8=False),
                                                   args.iters)
    try:
        import deep_ep
        dbuf = deep_ep.Buffer(dist.group.WORLD, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, 1, E),
                              low_latency_mode=True, num_qps_per_rank=E, explicitly_destroy=True)
        _, _, dhd, _, _ = dbuf.low_latency_dispatch(x, topk, T, E)
        res['DeepEP low_latency_dispatch'] = _timed(lambda: dbuf.low_latency_dispatch(x, topk, T, E), args.iters)
        res['DeepEP low_latency_combine'] = _timed(lambda: dbuf.low_latency_combine(y, topk, w, dhd, out=out),
                                                   args.iters)
        torch.cuda.synchronize()
        dbuf.destroy()
    except ImportError:
        pass
    torch.cuda.synchronize()
    buf.destroy()
    print(f'host µs per call, T={T}, 1 rank, GPU busy ahead, medians of {args.iters}:')
    for k, v in res.items():
        print(f'  {k:<40} {v:8.2f}')
    dist.destroy_process_group()


if __name__ == '__main__':
    os.environ.setdefault('NVSHMEM_DISABLE_NVLS', '1')
    main()
