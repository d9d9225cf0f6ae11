#!/usr/bin/env python3
"""Kernel-naming contract (shared/spec/deepep-ll-api.md §8.1): among all CUDA kernels llep builds, exactly one
name contains `dispatch` and exactly one `combine` (profiler-based benchmarks assert this), and those are
llep::kernels::cuda::dispatch / ::combine, so hook-mode traces find both phases under `::dispatch` / `::combine`.

Reads the kernels' host stubs (`__device_stub_` + the mangled kernel name, as `nm -C` prints them) from the static libraries given on the
command line with nm, demangles them with c++filt and exits non-zero on any violation.
"""
import re
import subprocess
import sys


def kernels(archives):
    names = set()
    for a in archives:
        out = subprocess.run(['nm', '-C', '--defined-only', a], check=True, capture_output=True, text=True).stdout
        for m in re.finditer(r'__device_stub_(_Z[^\s(]+)\(', out):
            names.add(m.group(1))
    demangled = subprocess.run(['c++filt'], input='\n'.join(sorted(names)), check=True, capture_output=True,
                               text=True).stdout.split('\n')
    return [d for d in demangled if d]


def main():
    found = kernels(sys.argv[1:])
    errors = []
    for word, want in (('dispatch', 'llep::kernels::cuda::dispatch('), ('combine', 'llep::kernels::cuda::combine(')):
        hits = [k for k in found if word in k.split('(')[0].lower()]
        if len(hits) != 1 or not hits[0].startswith(want):
            errors.append(f'kernels named with "{word}": {hits} (want exactly one, {want}...)')
        if not any(f'::{word}(' in k for k in hits):
            errors.append(f'no kernel name contains ::{word}')
    print(f'{len(found)} kernels:', *found, sep='\n  ')
    for e in errors:
        print('ERROR:', e)
    return 1 if errors or not found else 0


if __name__ == '__main__':
    sys.exit(main())
