#!/usr/bin/env python3
"""The NVLink-only compilations' rule (kernels/SMALL_T_CODE.md rule 6, kernels/cuda/ll_kernels_nvlink.cu): device code
tests whether the buffer has proxy peers or rank masking only through HasProxy(c) / HasMask(c), which those
compilations make false by construction so that the proxy's and the masking's code is not in line on their paths. A
direct test of `proxy_region` or `mask` against nullptr in a phase would compile that code back in (and still be
correct, so no other test would notice): this check fails on one.

Scans kernels/cuda/*.cuh; the two helpers' own definitions (ll_device_common.cuh) are the allowed tests.
Usage: check_config_branches.py PROJECT_SOURCE_DIR
"""
import pathlib
import re
import sys

DIRECT = re.compile(r'\b(proxy_region|mask)\s*[!=]=\s*nullptr|\bnullptr\s*[!=]=\s*\w+\s*\.\s*(proxy_region|mask)\b')
HELPERS = ('bool HasProxy(', 'bool HasMask(')


def violations(path):
    """Direct tests outside a helper's body (from its signature to the first closing brace: one statement)."""
    out = []
    inside_helper = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        code = line.split('//', 1)[0]
        inside_helper = inside_helper or any(h in code for h in HELPERS)
        if DIRECT.search(code) and not inside_helper:
            out.append(f'{path}:{n}: {line.strip()}')
        if '}' in code:
            inside_helper = False
    return out


def main():
    root = pathlib.Path(sys.argv[1]) / 'kernels' / 'cuda'
    files = sorted(root.glob('*.cuh'))
    found = [v for f in files for v in violations(f)]
    for v in found:
        print('ERROR: test HasProxy(c) / HasMask(c) instead:', v)
    print(f'{len(files)} device files checked, {len(found)} direct tests of proxy_region / mask')
    return 1 if found or not files else 0


if __name__ == '__main__':
    sys.exit(main())
