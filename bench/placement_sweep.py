#!/usr/bin/env python3
"""Where the data lands, swept inside one process: the settled hook receives (bench/ll_side_by_side.py's h_drs /
h_crs) of llep and, optionally, DeepEP at many data placements, with the code fixed.

Why: a small-T receive moved 0.93-1.11x between processes that differed only in the device memory allocated before
the buffers, and in one process llep's settled dispatch receive was 1.16-1.22x DeepEP's at one placement of four and
level at the other three (bench/RESULTS.md session 54). One process of bench/ll_side_by_side.py measures one
placement; this script measures many in one process, so a placement-sensitive kernel shows as a spread, and a change
can be judged on the distribution rather than on one draw.

Per placement P (MiB, --pads): torch's cached blocks are released, P MiB are held, and what --move names is made
anew after them; both receives are timed at each T (medians of --iters, max over ranks). --move all (default): a new
llep Buffer per placement (its regions, then its outputs and the inputs, land after the held memory), destroyed after.
--move outputs: llep's Buffer is made once and only its outputs (its output pool emptied) and the inputs move — as
DeepEP's in both modes: DeepEP's Buffer is made once, before the sweep (NVSHMEM is not set up twice in one process),
so only its per-call outputs and the inputs move, and its spread here is a lower bound of its own. `--move outputs`
thus compares the two on equal terms; `--move all` adds llep's regions. Before the sweep each system passes
ll_side_by_side.py's correctness gate at each T.

Usage (one GPU per rank; the visible GPUs by default):
    PYTHONPATH=build-gpu/python[:deepep] python3 bench/placement_sweep.py [--tokens 1 8 32] [--pads 0 2 4 ...]
        [--systems llep,deepep] [--move all|outputs] [--flush-mb 256] [--iters 50] [--json PATH]
--flush-mb N fills N MiB before each timed receive (not timed): the receives with L2 cold, as after an engine's
compute between a hook's send and its receive. Warm, llep's receive-only kernel moves with placement and DeepEP's
(which runs its send's kernel) does not; cold, neither does (bench/RESULTS.md session 55).
Output: a row per placement (llep / DeepEP µs and their ratio per T), then per T the median, minimum and maximum over
the placements of each system and of the ratio."""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ll_side_by_side import (E, H, _gate, _hook_round, _max_over_ranks, _round_trip_inputs,  # noqa: E402
                             _settled_receives, _System, cache_flusher, parse_systems, spawn_ranks)
from local_group import buffer_tokens, init_gloo  # noqa: E402  (bench/local_group.py)

WARM_ROUNDS = 20


def _timed(sysm, rank, R, T, T_max, dev, iters, flush):
    """(dispatch receive µs, combine receive µs) settled, max over ranks, at this T (the buffer cleaned for T_max);
    flush: called before each timed receive, or None."""
    inputs = _round_trip_inputs(rank, R, T, T_max, dev)
    for _ in range(WARM_ROUNDS):
        _hook_round(sysm, inputs, T_max)
    torch.cuda.synchronize()
    drs, crs = _settled_receives(sysm, inputs, T_max, iters, before_recv=flush)
    return _max_over_ranks(drs), _max_over_ranks(crs)


def _worker(rank, R, port, Ts, pads, iters, systems, move, json_path, flush_mb=0):
    ngpu = torch.cuda.device_count()
    torch.cuda.set_device(rank % ngpu)
    dev = torch.device('cuda', rank % ngpu)
    init_gloo(rank, R, port, 300)
    group = dist.group.WORLD
    T_top = max(buffer_tokens(T, R) for T in Ts)
    flush = cache_flusher(flush_mb, dev)  # made before the sweep: it does not move with the placements
    deepep = _System('deepep', group, R, T_top) if 'deepep' in systems else None
    fixed = _System('llep', group, R, T_top) if 'llep' in systems and move == 'outputs' else None
    rows = []
    for i, pad in enumerate(pads):
        if fixed is not None:
            fixed.buf._clear_pools()  # its pooled outputs go: the next calls make them anew, after the held memory
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # torch's cached segments released: what follows is allocated anew
        held = torch.empty(pad << 20, dtype=torch.uint8, device=dev)
        llep = fixed if fixed is not None else _System('llep', group, R, T_top) if 'llep' in systems else None
        row = {'pad_mb': pad}
        for T in Ts:
            T_max = buffer_tokens(T, R)
            for name, sysm in (('llep', llep), ('deepep', deepep)):
                if sysm is None:
                    continue
                sysm.buf.clean_low_latency_buffer(T_max, H, E)
                if i == 0:
                    _gate(sysm, rank, R, T, T_max, dev)
                row[f'{name}_h_drs_T{T}'], row[f'{name}_h_crs_T{T}'] = _timed(sysm, rank, R, T, T_max, dev, iters,
                                                                              flush)
        if llep is not None and llep is not fixed:
            llep.buf.destroy()
        del llep, held
        rows.append(row)
        if rank == 0:
            print(_row_line(row, Ts), flush=True)
    for sysm in (fixed, deepep):
        if sysm is not None:
            sysm.buf.destroy()
    torch.cuda.synchronize()
    dist.destroy_process_group()
    if rank == 0:
        _summary(rows, Ts, systems)
        if json_path:
            with open(json_path, 'w') as f:
                json.dump({'ranks': R, 'gpus': ngpu, 'gpu': torch.cuda.get_device_name(dev), 'hidden': H,
                           'experts': E, 'iters': iters, 'systems': systems, 'move': move, 'flush_mb': flush_mb,
                           'rows': rows, 'date': time.strftime('%Y-%m-%d %H:%M:%S')}, f, indent=1)


def _cell(row, col, T):
    a, b = row.get(f'llep_{col}_T{T}'), row.get(f'deepep_{col}_T{T}')
    if a is None or b is None:
        return f'{a if a is not None else b:5.2f}'
    return f'{a:5.2f}/{b:5.2f} {a / b:4.2f}'


def _row_line(row, Ts):
    return f'pad {row["pad_mb"]:4d} MiB | ' + ' | '.join(
        f'T={T} drs {_cell(row, "h_drs", T)} crs {_cell(row, "h_crs", T)}' for T in Ts)


def _spread(v):
    return f'{statistics.median(v):5.2f} [{min(v):5.2f}, {max(v):5.2f}]'


def _summary(rows, Ts, systems):
    both = len(systems) == 2
    print(f'\nsettled receives over {len(rows)} placements: median [min, max], µs' +
          (' (ratio: llep / DeepEP per placement)' if both else ''))
    for T in Ts:
        for col in ('h_drs', 'h_crs'):
            parts = []
            for name in systems:
                v = [r[f'{name}_{col}_T{T}'] for r in rows]
                parts.append(f'{name} {_spread(v)}')
            if both:
                parts.append(f'ratio {_spread([r[f"llep_{col}_T{T}"] / r[f"deepep_{col}_T{T}"] for r in rows])}')
            print(f'  T={T:<4} {col}: ' + ', '.join(parts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--ranks', type=int, default=0, help='ranks (default: the visible GPUs, at most 8)')
    ap.add_argument('--tokens', type=int, nargs='*', default=[1, 8, 32])
    ap.add_argument('--pads', type=int, nargs='*', default=list(range(0, 32, 2)),
                    help='MiB held at each placement, before what --move makes anew (default 0, 2, ..., 30)')
    ap.add_argument('--move', choices=('all', 'outputs'), default='all',
                    help="what each placement makes anew: llep's Buffer and everything after it, or only the outputs "
                         "and inputs (llep's Buffer made once, as DeepEP's always is)")
    ap.add_argument('--iters', type=int, default=50)
    ap.add_argument('--flush-mb', type=int, default=0,
                    help='MiB filled before each timed receive (L2 is 50 MiB): the receive with cold caches, as '
                         "after an engine's compute between send and receive (default 0: right after the send)")
    ap.add_argument('--systems', default='llep,deepep', help='comma-separated subset of llep,deepep')
    ap.add_argument('--json', default='')
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print('placement_sweep: no CUDA device')
        return 1
    systems = parse_systems(ap, args.systems)
    if any(p < 0 for p in args.pads) or not args.pads:
        ap.error('--pads: one or more sizes >= 0 (MiB)')
    if args.flush_mb < 0:
        ap.error('--flush-mb: a size >= 0 (MiB)')
    spawn_ranks(_worker, args.ranks,
                lambda R: (args.tokens, args.pads, args.iters, systems, args.move, args.json, args.flush_mb))
    return 0


if __name__ == '__main__':
    sys.exit(main())
