#!/usr/bin/env python3
"""One definition per option (issue #20): every LLEP_* environment option of the library is read in exactly one C++
place and listed in exactly one README row.

- C++ library sources (not tests, not bench) name an LLEP_* variable only in runtime/base/env.{h,cc}, plus the two
  codec knobs kernels/host/ll_host.cc reads itself (that layer may not use abseil); each is read exactly once.
- kOptionNames (runtime/base/env.h) is exactly the set of names read.
- Python library code (server_hooks/llep, graph_capture) reads no LLEP_* variable: it gets read_options().
- README.md's Options table has one row per name in kOptionNames, and no other rows.
Exits non-zero and lists every violation.
"""
import pathlib
import re
import sys

NAME = re.compile(r'"(LLEP_[A-Z0-9_]+)"')
READERS = {"runtime/base/env.cc", "kernels/host/ll_host.cc"}
CPP_DIRS = ("runtime", "proxy", "kernels", "metrics", "server_hooks", "graph_capture")
PY_DIRS = ("server_hooks/llep", "graph_capture")


def is_test(rel: str) -> bool:
    return "_test." in rel or rel.startswith(("tests/", "bench/"))


def main() -> int:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    errors = []
    reads = {}
    for d in CPP_DIRS:
        for path in sorted((root / d).rglob("*")):
            if path.suffix not in (".h", ".cc", ".cu", ".cuh"):
                continue
            rel = path.relative_to(root).as_posix()
            if is_test(rel) or rel == "runtime/base/env.h":
                continue
            for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                for name in NAME.findall(line):
                    if rel not in READERS:
                        errors.append(f"{rel}:{lineno}: reads {name} outside runtime/base/env.cc")
                    reads.setdefault(name, []).append(f"{rel}:{lineno}")
    for name, sites in sorted(reads.items()):
        if len(sites) != 1:
            errors.append(f"{name} is read in {len(sites)} places: {', '.join(sites)}")
    env_h = (root / "runtime/base/env.h").read_text()
    table = re.search(r"kOptionNames\[\]\s*=\s*\{(.*?)\};", env_h, re.S)
    declared = NAME.findall(table.group(1)) if table else []
    if not declared:
        errors.append("runtime/base/env.h: kOptionNames not found")
    if len(set(declared)) != len(declared):
        errors.append("runtime/base/env.h: kOptionNames lists a name twice")
    if set(declared) != set(reads):
        errors.append(f"kOptionNames and the names read differ: only listed {sorted(set(declared) - set(reads))}, "
                      f"only read {sorted(set(reads) - set(declared))}")
    for d in PY_DIRS:
        for path in sorted((root / d).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if re.search(r"(environ|getenv)[^#\n]*['\"]LLEP_", line):
                    errors.append(f"{rel}:{lineno}: Python reads an LLEP_* variable; use _llep.read_options()")
    readme = (root / "README.md").read_text()
    rows = re.findall(r"^\| `(LLEP_[A-Z0-9_]+)` \|", readme, re.M)
    if sorted(rows) != sorted(set(rows)):
        errors.append("README.md: an option has more than one row")
    if set(rows) != set(declared):
        errors.append(f"README.md Options table and kOptionNames differ: only in README {sorted(set(rows) - set(declared))}, "
                      f"only in code {sorted(set(declared) - set(rows))}")
    for e in errors:
        print(e)
    print(f"check_options: {len(declared)} options, {len(errors)} problem(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
