#!/usr/bin/env bash
# Compares the CUDA kernels' machine code of the working tree with that of a git revision, without a GPU: compiles
# each kernel translation unit (kernels/cuda/ll_kernels.cu, and ll_kernels_recv.cu, the NVLink-only compilations
# ll_kernels_nvlink*.cu and the expert-side combine's ll_kernels_expert_side*.cu where a tree has them) to a cubin
# (sm_90a, -O3, as the build does) for both and compares every kernel's .text section byte for byte, unit by unit
# (the receive-only unit's kernels carry the main unit's kernel names). Exit 0 and "identical" when a change (e.g. the
# HIP portability layer, kernels/HIP_PORT.md) left the CUDA kernels exactly as they were; otherwise names the kernels
# that differ and their sizes in instructions.
# Usage: scripts/cuda_sass_diff.sh REV   (needs nvcc: PATH or /usr/local/cuda/bin)
set -euo pipefail
cd "$(dirname "$0")/.."
rev="${1:?usage: scripts/cuda_sass_diff.sh REV}"
nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
git archive "$rev" | tar -x -C "$tmp" --one-top-level=base
cubin() {  # $1 = source root, $2 = unit, $3 = output; an empty output where the tree lacks the unit
  : > "$3"
  [ -f "$1/kernels/cuda/$2.cu" ] || return 0
  "$nvcc" -I"$1" -O3 -DNDEBUG -arch=sm_90a --expt-relaxed-constexpr -std=c++17 -cubin -o "$3" \
    "$1/kernels/cuda/$2.cu"
}
sections() { readelf -SW "$1" 2>/dev/null | grep -o '\.text\.[^ ]*' | sort -u; }
rc=0
for unit in ll_kernels ll_kernels_recv ll_kernels_nvlink ll_kernels_nvlink_recv ll_kernels_expert_side \
  ll_kernels_expert_side_recv; do
  cubin "$tmp/base" "$unit" "$tmp/base.cubin"
  cubin "$PWD" "$unit" "$tmp/new.cubin"
  for s in $(sort -u <(sections "$tmp/base.cubin") <(sections "$tmp/new.cubin")); do
    if cmp -s <(readelf -x "$s" "$tmp/base.cubin" 2>&1) <(readelf -x "$s" "$tmp/new.cubin" 2>&1); then
      echo "identical  $unit $s"
    else
      size() {  # instructions: the section's size field (hex bytes, 16 per SASS instruction)
        readelf -SW "$1" 2>/dev/null | python3 -c "import re, sys
for l in sys.stdin:
    m = re.search(re.escape('$s') + r'\s+\S+\s+\S+\s+\S+\s+([0-9a-f]+)', l)
    if m and int(m.group(1), 16): print(int(m.group(1), 16) // 16); break"
      }
      echo "DIFFERENT  $unit $s ($(size "$tmp/base.cubin") -> $(size "$tmp/new.cubin") instructions)"
      rc=1
    fi
  done
done
exit $rc
