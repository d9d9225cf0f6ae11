"""The experts' grouped GEMM over the receive area [E_loc, R*T, H] that computes only the rows each expert received:
row blocks at or past recv_count[e] exit at once, read from the device inside the kernel (no host read of the counts,
so a step stays capturable). DeepGEMM's m_grouped masked GEMM does this for FP8; this is a plain BF16 Triton kernel
(fp32 accumulation). Without Triton (the CPU ranks, Debian's torch) the whole area is computed with torch.matmul.

out[g, m, :] = x[g, m, :] @ w[g] for m < counts[g]; rows at or past counts[g] are left unwritten (whatever the output
tensor held: the combine never reads them)."""
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the callers use the dense path
    triton = None

if triton is not None:

    @triton.jit
    def _masked_grouped_mm(x_ptr, w_ptr, out_ptr, counts_ptr, M, N, K, sxg, sxm, sxk, swg, swk, swn, sog, som, son,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        g = tl.program_id(0).to(tl.int64)  # g * stride passes 2^31 elements at the DeepSeek shape (128 x 7168 x 4096)
        pid_m = tl.program_id(1)
        pid_n = tl.program_id(2)
        count = tl.load(counts_ptr + g)
        if pid_m * BM >= count:
            return
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = tl.load(x_ptr + g * sxg + rm[:, None] * sxm + (k0 + rk)[None, :] * sxk,
                        mask=(rm[:, None] < count) & ((k0 + rk)[None, :] < K), other=0.0)
            b = tl.load(w_ptr + g * swg + (k0 + rk)[:, None] * swk + rn[None, :] * swn,
                        mask=((k0 + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
            acc += tl.dot(a, b)
        tl.store(out_ptr + g * sog + rm[:, None] * som + rn[None, :] * son, acc.to(tl.bfloat16),
                 mask=(rm[:, None] < count) & (rn[None, :] < N))


def available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def masked_grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """bf16 x [G, M, K] @ bf16 w [G, K, N] for the first counts[g] rows of each group (int32 device tensor [G])."""
    G, M, K = x.shape
    N = w.shape[2]
    out = torch.empty((G, M, N), dtype=torch.bfloat16, device=x.device)
    BM, BN, BK = 64, 128, 64
    grid = (G, triton.cdiv(M, BM), triton.cdiv(N, BN))
    _masked_grouped_mm[grid](x, w, out, counts, M, N, K, *x.stride(), *w.stride(), *out.stride(), BM=BM, BN=BN, BK=BK)
    return out
