#!/usr/bin/env bash
# Fails when a tracked C++/CUDA file differs from clang-format's output (.clang-format: Google base, 120 columns).
# Fix with: git ls-files '*.h' '*.cc' '*.cu' | xargs clang-format -i
set -euo pipefail
cd "$1"
CLANG_FORMAT="${2:-clang-format}"
files=$(git ls-files '*.h' '*.cc' '*.cu' '*.cuh')
"$CLANG_FORMAT" --dry-run -Werror $files
echo "$(echo "$files" | wc -l) files formatted"
