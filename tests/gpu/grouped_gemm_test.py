#!/usr/bin/env python3
"""llep.engine's masked grouped GEMM (server_hooks/llep/engine/grouped_gemm.py) against torch.matmul on a GPU: every
row below its group's count within bf16 GEMM tolerance (relative Frobenius error < 1e-2 per group), for counts 0, 1,
a partial block, a full area, and the DeepSeek-V3 expert shapes (H 7168 -> 2 x 2048, and back). Exit 0 = pass.
Needs Triton and a GPU (scripts/gpu_test.sh runs it); prints SKIP otherwise."""
import sys

import torch


def main() -> int:
    from llep.engine import grouped_gemm
    if not torch.cuda.is_available() or grouped_gemm.triton is None:
        print('grouped_gemm_test: SKIP (needs a GPU and Triton)')
        return 0
    g = torch.Generator(device='cuda').manual_seed(3)
    failures = []
    # The last case: a weight tensor of more than 2^31 elements (80 x 7168 x 4096, as 128 DeepSeek experts are), so
    # an offset computed in 32 bits would overflow.
    for G, M, K, N in ((5, 100, 256, 384), (8, 256, 7168, 4096), (8, 256, 2048, 7168), (80, 64, 7168, 4096)):
        x = torch.randn((G, M, K), generator=g, device='cuda').to(torch.bfloat16)
        w = (torch.randn((G, K, N), generator=g, device='cuda') / K ** 0.5).to(torch.bfloat16)
        counts = torch.tensor(([0, 1, 63, M, 77 % M, 130 % M, M - 1, 2] * G)[:G], dtype=torch.int32, device='cuda')
        out = grouped_gemm.masked_grouped_mm(x, w, counts)
        want = torch.matmul(x.float(), w.float())
        for e, c in enumerate(counts.tolist()):
            if c == 0:
                continue
            err = ((out[e, :c].float() - want[e, :c]).norm() / want[e, :c].norm()).item()
            if not err < 1e-2:
                failures.append(f'G={G} M={M} K={K} N={N} group {e} ({c} rows): relative error {err:.3g}')
    print('grouped_gemm_test: ' + ('FAIL\n  ' + '\n  '.join(failures) if failures else 'PASS'))
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main())
