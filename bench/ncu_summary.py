#!/usr/bin/env python3
"""Summarises Nsight Compute raw-page CSVs of hook rounds (scripts/gpu_ncu_hook.sh): per launch, its duration,
instructions executed, and the warp-state breakdown (cycles a warp spent per issued instruction, by stall reason; the
largest five), so where a receive launch's time goes can be compared between llep and DeepEP.

Usage: python3 bench/ncu_summary.py OUT/ncu_llep_T1.csv OUT/ncu_deepep_T1.csv ..."""
import csv
import os
import re
import sys

STALL = re.compile(r'^smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$')
# The launch order of one hook round (bench/hook_loop.py).
PHASES = ('dispatch send', 'dispatch recv', 'combine send', 'combine recv')


def rows(path):
    with open(path, newline='') as f:
        lines = [ln for ln in f if not ln.startswith('==')]
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        return []
    table = list(csv.reader(lines[start:]))
    header, data = table[0], table[2:]  # table[1] holds the units
    return [dict(zip(header, r)) for r in data if len(r) == len(header)]


def num(v):
    try:
        return float(v.replace(',', ''))
    except (AttributeError, ValueError):
        return float('nan')


def main(paths):
    for path in paths:
        rs = rows(path)
        print(f'== {os.path.basename(path)}: {len(rs)} launches')
        for i, r in enumerate(rs):
            stalls = sorted(((num(v), m.group(1)) for k, v in r.items() if (m := STALL.match(k))), reverse=True)
            total = sum(s for s, _ in stalls if s == s)
            top = ', '.join(f'{name} {s:.1f}' for s, name in stalls[:5])
            print(f'{PHASES[i % 4]:14s} {num(r.get("gpu__time_duration.sum")) / 1000:7.2f} us  '
                  f'inst {num(r.get("smsp__inst_executed.sum")):9.0f}  grid {r.get("launch__grid_size", "?"):>4s}  '
                  f'regs {r.get("launch__registers_per_thread", "?"):>3s}  '
                  f'cycles/issue {total:6.1f}: {top}')


if __name__ == '__main__':
    main(sys.argv[1:])
