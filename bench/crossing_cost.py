#!/usr/bin/env python3
"""What naming the native call's arguments costs (issue #19 item 5): one rank on the CPU backend, the backend's own
combine method called with the same arguments positionally and by name (as llep/buffer.py calls it), min of
--repeat x --number calls each, alternated. Runs without a GPU:
    PYTHONPATH=build/python python3 bench/crossing_cost.py"""
import argparse
import timeit

import torch
import torch.distributed as dist

import llep
from llep.utils import free_port

T, H, E, K = 4, 1024, 8, 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--number', type=int, default=20000)
    ap.add_argument('--repeat', type=int, default=3)
    ap.add_argument('--rounds', type=int, default=4)
    args = ap.parse_args()
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)
    buf = llep.Buffer(dist.group.WORLD, low_latency_mode=True, explicitly_destroy=True)
    buf.backend = 'cpu'  # also where CUDA is there (a GPU machine's host)
    x = torch.randn(T, H).to(torch.bfloat16)
    topk = torch.topk(torch.rand(T, E), K, dim=-1).indices
    w = torch.rand(T, K)
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, topk, T, E, use_fp8=False)
    out = torch.empty(T, H, dtype=torch.bfloat16)
    buf.low_latency_combine(recv, topk, w, handle, out=out)
    rt = buf.runtime
    xp, tp, wp, lp, op, key = (recv.data_ptr(), topk.data_ptr(), w.data_ptr(), handle[1].data_ptr(), out.data_ptr(),
                               handle[2].plan_key)

    def positional():
        rt.combine(xp, False, tp, wp, T, K, lp, op, 0, key, False, False, 0)

    def named():
        rt.combine(x=xp, zero_copy=False, topk_idx=tp, topk_weights=wp, num_tokens=T, num_topk=K, layout_range=lp,
                   out=op, wait_recv_cost_stats=0, plan_key=key, expert_reduced=False, split=False, stream=0)

    def us(fn):
        return min(timeit.repeat(fn, number=args.number, repeat=args.repeat)) / args.number * 1e6

    for r in range(args.rounds):
        p, n = us(positional), us(named)
        print(f'round {r + 1}: native combine positional {p:.3f} µs, named {n:.3f} µs, named - positional '
              f'{n - p:+.3f} µs')
    buf.destroy()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
