#!/usr/bin/env python3
"""Code footprint of each launch of a hook round, from scripts/gpu_ncu_hook.sh's LLEP_NCU_SOURCE output (source.tgz,
unpacked): per launch, how many distinct SASS instructions ran (the code it fetches, cold at every launch: at small T
the receive launches wait on instruction fetch, bench/RESULTS.md session 12), how many of those ran in 16 warps or
fewer (straight-line code of one CTA: the critical path at small T), the stall samples in total and waiting on
instruction fetch ('no_inst'), and the source lines (nvdisasm -g) holding most of the executed code.

Two more views of a launch's path (bench/RESULTS.md session 38):
- divergent fallbacks: executed WARPSYNC.COLLECTIVE instructions, the compiler's out-of-line path for a warp
  collective (vote, shuffle) reached by a diverged warp: a jump to the function's end and back on every such warp
  (each is printed with its source line and how many warps took it);
- --runs W: the addresses run by at least W warps (e.g. 32 for a receive's item warps at T=1: 8 items x 4 warps), as
  runs of contiguous code, with the bytes skipped between runs: a skip beyond a few 128-byte lines is a jump to cold
  code on that path.

Usage: python3 bench/ncu_source.py DIR [--lines N] [--runs W] [--gap BYTES]
  (DIR holds src_T*_launch{1..4}.csv and, for llep, *.sass)"""
import argparse
import collections
import csv
import glob
import os
import re

PHASES = ('dispatch send', 'dispatch recv', 'combine send', 'combine recv')


def sass_lines(paths):
    """{(cubin, function): {offset: (file, line)}} from nvdisasm -g listings. Keyed by cubin too: the receive-only
    kernels (kernels/cuda/ll_kernels_recv.cu) have the main kernels' names in another cubin."""
    funcs, cur, loc = {}, None, ('?', 0)
    for path in paths:
        for ln in open(path):
            m = re.match(r'^(_Z\S+):$', ln)
            if m:
                cur = funcs.setdefault((os.path.basename(path), m.group(1)), {})
                continue
            m = re.match(r'\s*//## File "(.*)", line (\d+)', ln)
            if m:
                loc = (os.path.basename(m.group(1)), int(m.group(2)))
                continue
            m = re.match(r'\s*/\*([0-9a-f]{4,})\*/', ln)
            if m and cur is not None:
                cur[int(m.group(1), 16)] = loc
    return funcs


def launch_rows(path):
    """The first kernel section of an ncu source-page CSV: (kernel name, header, rows)."""
    rows = list(csv.reader(open(path, newline='')))
    ends = [j for j in range(1, len(rows)) if rows[j] and rows[j][0] == 'Kernel Name']
    return rows[0][1], rows[1], rows[2:ends[0] if ends else len(rows)]


def executed(data, ix):
    """[(offset from the launch's first instruction, warps that executed it, SASS text)] of the instructions that ran."""
    base = int(data[0][0], 16)
    out = []
    for r in data:
        ex = int(float(r[ix['Instructions Executed']] or 0))
        if ex > 0:
            out.append((int(r[0], 16) - base, ex, r[1].strip()))
    return out


def divergent_fallbacks(ran):
    """[(offset, warps)] of executed WARPSYNC.COLLECTIVE instructions (see the module docstring)."""
    return [(off, ex) for off, ex, sass in ran if 'WARPSYNC.COLLECTIVE' in sass]


def address_runs(ran, min_warps, gap=128):
    """Runs [(first offset, last offset, instructions)] of the instructions executed by at least min_warps warps; a
    run ends where more than `gap` bytes of code between two such instructions were not run by them."""
    runs = []
    for off, ex, _ in ran:
        if ex < min_warps:
            continue
        if runs and off - runs[-1][1] - 16 <= gap:  # the bytes between the two instructions
            runs[-1][1] = off
            runs[-1][2] += 1
        else:
            runs.append([off, off, 1])
    return [tuple(r) for r in runs]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('dir')
    ap.add_argument('--lines', type=int, default=10)
    ap.add_argument('--runs', type=int, default=0, help='print the address runs of code run by at least W warps')
    ap.add_argument('--gap', type=int, default=128, help='bytes of unrun code that end a run (--runs)')
    args = ap.parse_args()
    funcs = sass_lines(glob.glob(os.path.join(args.dir, '*.sass')))
    for path in sorted(glob.glob(os.path.join(args.dir, 'src_T*_launch*.csv'))):
        i = int(re.search(r'launch(\d+)', path).group(1)) - 1
        name, hdr, data = launch_rows(path)
        ix = {h: j for j, h in enumerate(hdr)}
        # The listing of this kernel's function, if any: the mangled name holding its namespaces and its own name, and
        # of those (one per cubin for a receive-only kernel) the one with the launch's instruction count.
        parts = re.sub(r'<.*', '', name.split('(')[0]).replace('void ', '').split('::')
        named = [m for (_, f), m in funcs.items() if parts and all(x in f for x in parts)]
        fmap = next((m for m in named if m and max(m) // 16 + 1 == len(data)), named[0] if named else {})
        ran_list = executed(data, ix)
        ran, few = len(ran_list), sum(ex <= 16 for _, ex, _ in ran_list)
        by_line = collections.Counter(fmap.get(off, ('?', 0)) for off, _, _ in ran_list)
        samples = sum(float(r[ix['Warp Stall Sampling (All Samples)']] or 0) for r in data)
        no_inst = sum(float(r[ix['stall_no_inst']] or 0) for r in data)
        print(f'{PHASES[i % 4]:14s} {name[:48]:48s} static {len(data):6d}  ran {ran:5d} ({ran * 16 / 1024:5.1f} KB)'
              f'  in <=16 warps {few:5d}  samples {samples:5.0f}  no_inst {no_inst:5.0f}')
        if fmap and args.lines:
            print('    ' + ', '.join(f'{f}:{ln} {n}' for (f, ln), n in by_line.most_common(args.lines)))
        for off, ex in divergent_fallbacks(ran_list):
            f, ln = fmap.get(off, ('?', 0))
            print(f'    divergent fallback at {off:#07x} ({f}:{ln}): {ex} warp passes')
        if args.runs:
            runs = address_runs(ran_list, args.runs, args.gap)
            skips = [b0 - a1 - 16 for (_, a1, _), (b0, _, _) in zip(runs, runs[1:])]
            print(f'    {len(runs)} runs of code run by >= {args.runs} warps; skips over {args.gap} B: '
                  f'{sum(1 for x in skips if x > args.gap)}, largest {max(skips, default=0)} B')
            print('    ' + ' '.join(f'{a0:05x}-{a1:05x}({n})' for a0, a1, n in runs))


if __name__ == '__main__':
    main()
