#!/usr/bin/env python3
"""Code footprint of each launch of a hook round, from scripts/gpu_ncu_hook.sh's LLEP_NCU_SOURCE output (source.tgz,
unpacked): per launch, how many distinct SASS instructions ran (the code it fetches, cold at every launch: at small T
the receive launches wait on instruction fetch, bench/RESULTS.md session 12), how many of those ran in 16 warps or
fewer (straight-line code of one CTA: the critical path at small T), the stall samples in total and waiting on
instruction fetch ('no_inst'), and the source lines (nvdisasm -g) holding most of the executed code.

Usage: python3 bench/ncu_source.py DIR [--lines N]   (DIR holds src_T*_launch{1..4}.csv and, for llep, *.sass)"""
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('dir')
    ap.add_argument('--lines', type=int, default=10)
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
        base = int(data[0][0], 16)
        ran = few = 0
        samples = no_inst = 0.0
        by_line = collections.Counter()
        for r in data:
            ex = float(r[ix['Instructions Executed']] or 0)
            samples += float(r[ix['Warp Stall Sampling (All Samples)']] or 0)
            no_inst += float(r[ix['stall_no_inst']] or 0)
            if ex > 0:
                ran += 1
                few += ex <= 16
                by_line[fmap.get(int(r[0], 16) - base, ('?', 0))] += 1
        print(f'{PHASES[i % 4]:14s} {name[:48]:48s} static {len(data):6d}  ran {ran:5d} ({ran * 16 / 1024:5.1f} KB)'
              f'  in <=16 warps {few:5d}  samples {samples:5.0f}  no_inst {no_inst:5.0f}')
        if fmap and args.lines:
            print('    ' + ', '.join(f'{f}:{ln} {n}' for (f, ln), n in by_line.most_common(args.lines)))


if __name__ == '__main__':
    main()
