#!/usr/bin/env python3
"""A profiler-free loop of hook-mode rounds (dispatch send, dispatch receive, combine send, combine receive) on one
rank, for an outside profiler such as Nsight Compute: the torch profiler the other benchmarks use holds CUPTI, which
ncu needs for itself. llep or DeepEP (same Python API), same inputs as bench/ll_side_by_side.py.

Every round launches exactly four low-latency kernels in that order, after --warmup rounds, so
`ncu --kernel-name regex:'::(dispatch|combine)' --launch-skip 4*W --launch-count 4` profiles one round's four launches
(W = --warmup). Usage: PYTHONPATH=build-gpu/python[:deepep] python3 bench/hook_loop.py --system llep --tokens 1
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ll_side_by_side import E, H, _inputs, _System  # bench/ll_side_by_side.py
from local_group import buffer_tokens, free_port, init_gloo  # bench/local_group.py


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--system', choices=('llep', 'deepep'), default='llep')
    ap.add_argument('--tokens', type=int, default=1)
    ap.add_argument('--warmup', type=int, default=20)
    ap.add_argument('--rounds', type=int, default=5, help='rounds after the warm-up')
    args = ap.parse_args()
    init_gloo(0, 1, free_port(), 60)
    dev = torch.device('cuda', 0)
    torch.cuda.set_device(dev)
    T = args.tokens
    T_max = buffer_tokens(T, 1)
    sysm = _System(args.system, dist.group.WORLD, 1, T_max)
    x, topk, w = _inputs(0, T, dev)
    y = torch.randn((E, T_max, H), device=dev).to(torch.bfloat16)
    out = torch.empty((T, H), dtype=torch.bfloat16, device=dev)
    for _ in range(args.warmup + args.rounds):
        _, _, hd, _, hook = sysm.dispatch(x, topk, w, T_max, return_recv_hook=True)
        hook()
        _, _, chook = sysm.combine(y, topk, w, hd, out=out, return_recv_hook=True)
        chook()
    torch.cuda.synchronize()
    print(f'hook_loop: {args.system} T={T} T_max={T_max}: {args.warmup + args.rounds} rounds done')
    if hasattr(sysm.buf, 'destroy'):
        sysm.buf.destroy()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
