#!/usr/bin/env python3
"""Enforces the module dependency rules of shared/design/STYLE.md §1-2 on #include lines.

Each folder may include only the folders its row allows; runtime/protocol includes nothing of llep but itself
and must not include abseil, torch, pybind or verbs; kernels/ must stay free of abseil. Exits non-zero and lists
every violation.
"""
import pathlib
import re
import sys

# folder -> llep folders it may include (its own folder is always allowed)
ALLOWED = {
    "runtime/protocol": set(),
    "runtime/base": {"runtime/base"},
    "kernels": {"runtime/protocol", "kernels"},
    "proxy": {"runtime/protocol", "runtime/base", "proxy"},
    "metrics": {"runtime/protocol", "runtime/base", "metrics"},
    "runtime": {"runtime", "kernels", "proxy", "metrics"},
    "graph_capture": {"runtime", "graph_capture"},
    "server_hooks": {"runtime", "graph_capture", "metrics", "server_hooks"},
    "tests": None,  # anything public
    "tests/harness": {"runtime", "kernels", "proxy", "metrics"},  # what tests and benchmarks share
    "bench": {"runtime", "kernels", "proxy", "metrics", "graph_capture", "tests/harness", "bench"},
}
FOREIGN_BANNED = {
    "runtime/protocol": ("absl/", "torch/", "pybind11/", "infiniband/", "rdma/", "prometheus/"),
    "kernels": ("absl/", "torch/", "pybind11/", "infiniband/", "rdma/", "prometheus/"),
    # prometheus-cpp appears only under metrics/ (STYLE.md §2)
    "runtime/base": ("prometheus/",),
    "runtime": ("prometheus/",),
    "proxy": ("prometheus/",),
    "graph_capture": ("prometheus/",),
    "server_hooks": ("prometheus/",),
}
LLEP_ROOTS = ("runtime/", "kernels/", "proxy/", "metrics/", "graph_capture/", "server_hooks/", "tests/", "bench/")
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]')


def owner(rel: str) -> str:
    for folder in sorted(ALLOWED, key=len, reverse=True):
        if rel.startswith(folder + "/"):
            return folder
    return ""


def main() -> int:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    violations = []
    checked = 0
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".h", ".cc", ".cu", ".cuh") or "build" in path.relative_to(root).parts[0]:
            continue
        rel = path.relative_to(root).as_posix()
        folder = owner(rel)
        if not folder:
            continue
        checked += 1
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            inc = m.group(1)
            for banned in FOREIGN_BANNED.get(folder, ()):
                if inc.startswith(banned):
                    violations.append(f"{rel}:{lineno}: {folder} must not include {inc}")
            if not inc.startswith(LLEP_ROOTS):
                continue
            target = owner(inc)
            if "/internal/" in inc and pathlib.PurePosixPath(inc).parent != pathlib.PurePosixPath(rel).parent:
                violations.append(f"{rel}:{lineno}: {inc} is internal to its folder")
            allowed = ALLOWED[folder]
            # An allowed folder covers its subfolders too ("runtime" covers runtime/protocol), except that a
            # subfolder with its own row is a different module (runtime/protocol is not runtime/base).
            if allowed is None or target == folder or any(target == a or target.startswith(a + "/") for a in allowed):
                continue
            if inc.endswith("_test.h") or target in ("tests", "bench", "server_hooks") and folder != target:
                violations.append(f"{rel}:{lineno}: nothing may include {target}/ ({inc})")
                continue
            violations.append(f"{rel}:{lineno}: {folder} may not include {inc} (allowed: {sorted(allowed)})")
    for v in violations:
        print(v)
    print(f"{checked} files checked, {len(violations)} violations")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
