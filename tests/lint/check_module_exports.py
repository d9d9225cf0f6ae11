#!/usr/bin/env python3
"""The Python extension module exports PyInit_<name> and nothing else, and uses the shared C++ runtime (issue #15).

Any other defined dynamic symbol lets the process's shared libraries bind to the module's private copy of a
function: on the GPU machine (whose compiler linked libstdc++ statically into the module) prometheus-cpp's text
serializer called the module's copy of `std::ostream << double` and the first /metrics scrape killed the serving
process. And a module of C++ code that does not need libstdc++.so.6 carries a second C++ runtime beside the one its
shared dependencies use. Reads the dynamic symbol table (`nm -D --defined-only`) and the NEEDED entries
(`readelf -d`).

Usage: check_module_exports.py MODULE.so
"""
import os
import subprocess
import sys


def exported(path):
    out = subprocess.run(['nm', '-D', '--defined-only', path], check=True, capture_output=True, text=True).stdout
    names = []
    for line in out.splitlines():
        parts = line.split()
        # "<address> <type> <name>": type A (absolute) marks version-node names, not functions or data.
        if len(parts) >= 3 and parts[1] != 'A':
            names.append(parts[2].split('@')[0])
    return sorted(set(names))


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    path = sys.argv[1]
    want = 'PyInit_' + os.path.basename(path).split('.')[0]
    names = exported(path)
    extra = [n for n in names if n != want]
    if want not in names:
        print(f'ERROR: {path} does not export {want}')
    if extra:
        demangled = subprocess.run(['c++filt'], input='\n'.join(extra), capture_output=True, text=True).stdout.split('\n')
        print(f'ERROR: {path} exports {len(extra)} symbols besides {want}, e.g.:', *demangled[:20], sep='\n  ')
    needed = subprocess.run(['readelf', '-d', path], check=True, capture_output=True, text=True).stdout
    shared_runtime = 'libstdc++.so' in needed
    if not shared_runtime:
        print(f'ERROR: {path} does not need libstdc++.so: the C++ runtime was linked into it (a second copy in the '
              'process; see server_hooks/CMakeLists.txt)')
    if want in names and not extra and shared_runtime:
        print(f'{path}: exports {want} only and uses the shared C++ runtime')
        return 0
    return 1


if __name__ == '__main__':
    sys.exit(main())
