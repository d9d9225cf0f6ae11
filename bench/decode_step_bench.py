#!/usr/bin/env python3
"""Decode-step benchmark (issue #5): one MoE layer's dispatch -> stand-in expert GEMM -> combine on llep's GPU
backend, eager vs CUDA-graph replay, and one batch vs two overlapped micro-batches, at T in {1, 32, 128} tokens per
rank (DeepSeek-V3 decode shape: hidden 7168, top-8, 256 experts, FP8 dispatch, BF16 combine, receive hooks as
SGLang/vLLM use them).

One Buffer (num_max_dispatch_tokens_per_rank 128) serves every T and every graph, as in an engine; the graphs come
from llep.graph_capture.DecodeGraphs (sizes 1, 32, 128 in one pool). The stand-in expert work is what a rank's
experts compute on average per step: a bf16 GEMM pair [T*8, 7168] x [7168, 2048] x [2048, 7168] (two of half the
rows with two micro-batches). Each step is bracketed by CUDA events with nothing queued ahead, so eager numbers
include the host's launch cost, which is what graphs remove. Medians over --iters steps per rank, then the
maximum over ranks. One process per GPU. Prints a table last; --json writes all numbers.
"""
import argparse
import json
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import llep
from llep.graph_capture import DecodeGraphs, moe_step, moe_step_two_microbatches
from local_group import free_port, init_gloo  # bench/local_group.py

H, E, K, INTER, T_MAX = 7168, 256, 8, 2048, 128
SIZES = (1, 32, 128)



def _median_us(fn, iters):
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in evs:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1000 for a, b in evs)


def _worker(rank, R, port, iters, out_path):
    torch.cuda.set_device(rank)
    init_gloo(rank, R, port, 300)
    dev = torch.device('cuda', rank)
    buf = llep.Buffer(dist.group.WORLD, low_latency_mode=True, explicitly_destroy=True)
    buf.backend = 'cuda'
    buf.clean_low_latency_buffer(T_MAX, H, E)
    E_loc = E // R
    g = torch.Generator(device=dev).manual_seed(rank)
    w1 = (torch.randn((H, INTER), generator=g, device=dev) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn((INTER, H), generator=g, device=dev) * 0.02).to(torch.bfloat16)
    act = torch.randn((T_MAX * K, H), generator=g, device=dev).to(torch.bfloat16)
    y = torch.zeros((E_loc, R * T_MAX, H), dtype=torch.bfloat16, device=dev)  # the expert outputs combine reads

    def gemm(rows):
        torch.mm(torch.mm(act[:rows], w1), w2)

    def make_step(two):
        def step(x, ids, w):
            n = x.size(0)
            rows = ((n + 1) // 2 if two else n) * K

            def experts(recv, count, handle):
                gemm(rows)
                return y

            kw = dict(num_max_dispatch_tokens_per_rank=T_MAX, num_experts=E, use_fp8=True)
            if two:
                return moe_step_two_microbatches(buf, x, ids, w, experts, **kw)
            return moe_step(buf, x, ids, w, experts, use_hooks=True, **kw)
        return step

    steps = {'one': make_step(False), 'two': make_step(True)}
    graphs = {}
    pool = torch.cuda.graph_pool_handle()
    for name, step in steps.items():
        graphs[name] = DecodeGraphs(buf, step, max_tokens=T_MAX, hidden=H, num_topk=K, sizes=SIZES, pool=pool)
        graphs[name].capture()

    res = {}
    for T in SIZES:
        gi = torch.Generator().manual_seed(100 + rank)
        x = torch.randn((T, H), generator=gi).to(torch.bfloat16).to(dev)
        ids = torch.topk(torch.rand((T, E), generator=gi), K, dim=-1).indices.to(dev)
        w = (torch.rand((T, K), generator=gi) + 0.05).to(dev)
        # Sanity: a replay returns exactly what the eager step returns.
        ok = torch.equal(graphs['one'].run(x, ids, w).view(torch.int16), steps['one'](x, ids, w).view(torch.int16))
        row = {'graph_equals_eager': ok}
        for name, fn in (('gemm', lambda: gemm(T * K)),
                         ('eager', lambda: steps['one'](x, ids, w)),
                         ('graph', lambda: graphs['one'].run(x, ids, w)),
                         ('eager_two_mb', lambda: steps['two'](x, ids, w)),
                         ('graph_two_mb', lambda: graphs['two'].run(x, ids, w))):
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            dist.barrier()
            row[name] = _median_us(fn, iters)
        res[T] = row
    buf.check_errors()
    for gr in graphs.values():
        gr.reset()
    torch.cuda.synchronize()
    buf.destroy()
    allres = [None] * R
    dist.all_gather_object(allres, res)
    if rank == 0:
        with open(out_path, 'w') as f:
            json.dump(allres, f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--ranks', type=int, default=0, help='default: every GPU')
    ap.add_argument('--iters', type=int, default=200)
    ap.add_argument('--json', default='decode_step_bench.json')
    args = ap.parse_args()
    if not torch.cuda.is_available() or not getattr(llep._llep, 'HAVE_CUDA', False):
        print('decode_step_bench: SKIPPED (no CUDA device or llep built without CUDA)')
        return 0
    R = args.ranks or torch.cuda.device_count()
    if R < 2 or R > torch.cuda.device_count():
        print(f'decode_step_bench: needs 2..{torch.cuda.device_count()} ranks, one GPU each')
        return 1
    mp.spawn(_worker, args=(R, free_port(), args.iters, args.json), nprocs=R, join=True)
    allres = json.load(open(args.json))
    cols = ('gemm', 'eager', 'graph', 'eager_two_mb', 'graph_two_mb')
    print(f'decode step on {R} GPUs, median us per step (max over ranks); hidden {H}, top-{K}, {E} experts, '
          f'FP8 dispatch, receive hooks, stand-in expert GEMM [T*8,{H}]x[{H},{INTER}]x[{INTER},{H}]')
    print(f'{"T":>4} ' + ' '.join(f'{c:>13}' for c in cols) + '  graph==eager')
    rc = 0
    for T in SIZES:
        rows = [r[str(T)] for r in allres]
        ok = all(r['graph_equals_eager'] for r in rows)
        rc |= 0 if ok else 1
        print(f'{T:>4} ' + ' '.join(f'{max(r[c] for r in rows):>13.1f}' for c in cols) + f'  {ok}')
    return rc


if __name__ == '__main__':
    sys.exit(main())
