"""llep.graph_capture on the CPU backend (no CUDA graphs here: DecodeGraphs runs its steps eagerly through the same
static, padded inputs). Checks the size rules, that a padded batch gives bit for bit the results of the unpadded
call for every step kind of graph_steps.py (hooks with work in between, no hooks, two overlapped micro-batches, an
odd number of low-latency calls), and that two micro-batches combine to the same output as one batch. The GPU
side (real graphs, 10,000 random replays against this backend) is tests/gpu/graph_test.py."""
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import llep
from llep.graph_capture import DecodeGraphs, graph_sizes, moe_step, pick_size

import graph_steps
from llep.utils import free_port

T, H, E, K, R = 8, 1024, 16, 4, 2


def test_graph_sizes_and_pick():
    assert graph_sizes(32) == [32, 16, 8, 4, 2, 1]
    assert graph_sizes(20) == [20, 16, 8, 4, 2, 1]
    assert graph_sizes(1) == [1]
    assert graph_sizes(8, [3, 8, 3]) == [8, 3]
    for bad in ((0, None), (8, [9]), (8, [0]), (8, [])):
        with pytest.raises(ValueError):
            graph_sizes(*bad)
    sizes = graph_sizes(32)
    assert [pick_size(sizes, n) for n in (0, 1, 2, 3, 17, 32)] == [1, 1, 2, 4, 32, 32]
    with pytest.raises(ValueError, match='does not fit'):
        pick_size(sizes, 33)



def _worker(rank, port):
    os.environ.setdefault('LLEP_FABRIC_PROVIDER', 'shm')  # in the rank process: the pytest process's env stays as it was
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=R,
                            timeout=datetime.timedelta(seconds=120))
    buf = llep.Buffer(dist.group.WORLD, low_latency_mode=True, explicitly_destroy=True)
    buf.backend = 'cpu'
    cpu = torch.device('cpu')
    failures = []
    for kind in graph_steps.KINDS:
        step = graph_steps.make_step(buf, kind, T, E)
        graphs = DecodeGraphs(buf, step, max_tokens=T, hidden=H, num_topk=K,
                              sizes=graph_steps.kind_sizes(kind, T))
        assert not graphs.use_graphs
        graphs.capture()
        for seed in range(3):
            n = 1 + (seed * 5 + rank * 3) % T  # ranks send different numbers of tokens
            x, ids, w = graph_steps.make_inputs(rank, seed, n, H, E, K, cpu)
            padded = graphs.run(x, ids, w)
            biggest = graphs.run(x, ids, w, size=T)
            direct = step(x, ids, w)
            for name, got in (('padded', padded), ('max size', biggest)):
                if kind.endswith('two_microbatches'):  # micro-batches split the padded batch: compare the output only
                    got, direct = got[:1], direct[:1]
                if graph_steps.mismatch(got, direct):
                    failures.append(f'{kind} seed {seed} n {n} {name}: {graph_steps.describe_mismatch(got, direct)}')
            if kind.endswith('two_microbatches'):
                whole = moe_step(buf, x, ids, w, graph_steps.expert, num_max_dispatch_tokens_per_rank=T,
                                 num_experts=E, expert_side=kind.startswith('expert_side'),
                                 **graph_steps.mode_flags(graph_steps.KINDS[kind][0]))
                if not torch.equal(whole.view(torch.int16), padded[0].view(torch.int16)):
                    failures.append(f'two micro-batches combine differently from one batch (seed {seed})')
            if n < T and padded[0].size(0) != n:
                failures.append(f'{kind}: run() returned {padded[0].size(0)} rows for {n} tokens')
        with pytest.raises(ValueError, match='does not fit'):
            graphs.run(*graph_steps.make_inputs(rank, 9, T + 1, H, E, K, cpu))
    buf.destroy()
    dist.destroy_process_group()
    assert not failures, failures


def test_decode_graphs_pad_on_cpu_backend():
    mp.spawn(_worker, args=(free_port(),), nprocs=R, join=True)
