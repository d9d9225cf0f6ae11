"""`AllToAllMoE`: the engine's MoE layer over torch.distributed `all_to_all_single` (NCCL on GPUs, gloo on CPU ranks),
the baseline llep and DeepEP are compared with (`python3 -m llep.engine --system nccl`, bench/engine_bench.py).

The design an engine without an EP library would write, kept free of host synchronisation so a step can still be
captured in a CUDA graph: fixed-size exchanges (every rank sends T rows to every rank, whatever the routing).
  1. dispatch: to each rank d, token t's row (zeros if none of its top-k experts is on d) and its top-k ids as d's
     local expert ids (-1 for slots elsewhere): [R, T, H] + [R, T, K], one exchange each.
  2. the receiver packs the rows per local expert ([E_loc, R*T, H], positions by a cumulative sum, no host read) and
     runs the same grouped expert MLP as EpMoE with the per-expert counts;
  3. combine: each (token, slot) row's expert output goes back in slot order ([R, T, K, H]), and the token's rank
     sums them in top-k order in fp32 with a fused multiply-add per slot, as llep's combine and the reference do.
BF16 rows travel as float16 bits (gloo has no bfloat16). With FP8 dispatch the rows are rounded through FP8 first
(fp8_round_trip: the values llep and DeepEP deliver) but still sent as BF16: this baseline does not carry FP8 bytes.
Combine returns K rows per token per rank (zeros where the slot's expert is elsewhere): R*K rows per token, the
price of no host synchronisation; llep and DeepEP return one row per (token, selected expert)."""
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from .config import ModelConfig
from .experts import expert_mlp, stack_experts
from .moe import StagedMoE, add_shared, add_topk_term, fp8_round_trip


class AllToAllMoE(StagedMoE):
    per_layer = False  # no per-layer receive counters (llep's `layer` keyword)

    def __init__(self, cfg: ModelConfig, weights: Dict[str, torch.Tensor], group, rank: int, num_ranks: int,
                 max_tokens: int, device: torch.device, use_fp8: bool = False) -> None:
        self.cfg, self.group, self.R, self.T, self.use_fp8 = cfg, group, num_ranks, max_tokens, use_fp8
        self.E_loc = cfg.num_experts // num_ranks
        mine = range(rank * self.E_loc, (rank + 1) * self.E_loc)
        self.experts = [tuple(t.to(device) for t in stack_experts(weights, layer, mine)) for layer in range(cfg.num_layers)]
        R, T, H, K = num_ranks, max_tokens, cfg.hidden, cfg.top_k
        # Exchange areas, allocated once (a captured graph reuses them), one set per micro-batch of two-batch overlap:
        # send and receive sides of both exchanges.
        self.xs = torch.zeros((2, R, T, H), dtype=torch.bfloat16, device=device)
        self.ids = torch.full((2, R, T, K), -1, dtype=torch.int64, device=device)
        self.xr, self.ir = torch.empty_like(self.xs), torch.empty_like(self.ids)
        self.yr = torch.empty((2, R, T, K, H), dtype=torch.bfloat16, device=device)
        self.ranks = torch.arange(R, device=device).view(R, 1, 1)
        self.dummy_x = torch.zeros((0, H), dtype=torch.bfloat16, device=device)
        self.dummy_idx = torch.full((0, K), -1, dtype=torch.int64, device=device)
        self.dummy_w = torch.zeros((0, K), dtype=torch.float32, device=device)

    def _exchange(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        if out.dtype == torch.bfloat16:
            out, inp = out.view(torch.float16), inp.view(torch.float16)  # bits only: no arithmetic on them
        dist.all_to_all_single(out, inp, group=self.group)

    def send(self, layer: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
             shared: Optional[Callable[[], torch.Tensor]], mb: int = 0) -> dict:
        n = x.shape[0]
        rows = fp8_round_trip(x) if self.use_fp8 and n > 0 else x
        on = (idx >= 0).unsqueeze(0) & (idx.div(self.E_loc, rounding_mode='floor').unsqueeze(0) == self.ranks)  # [R,n,K]
        xs, ids = self.xs[mb], self.ids[mb]
        xs[:, :n] = torch.where(on.any(-1, keepdim=True), rows.unsqueeze(0), torch.zeros_like(rows).unsqueeze(0))
        xs[:, n:] = 0
        ids[:, :n] = torch.where(on, idx.unsqueeze(0) - self.ranks * self.E_loc, torch.full_like(idx, -1).unsqueeze(0))
        ids[:, n:] = -1
        self._exchange(self.xr[mb], xs)
        self._exchange(self.ir[mb], ids)
        return {'layer': layer, 'n': n, 'idx': idx, 'w': w, 'shared': shared, 'mb': mb}

    def middle(self, st: dict) -> None:
        st['s'] = st['shared']() if st['shared'] is not None and st['n'] > 0 else None
        R, T, H, K, E_loc = self.R, self.T, self.cfg.hidden, self.cfg.top_k, self.E_loc
        N = R * T
        rows, lid = self.xr[st['mb']].view(N, H), self.ir[st['mb']].view(N, K)
        valid = lid >= 0
        e = lid.clamp(min=0)
        # Row j's position in local expert e's block: how many rows before j selected e (a token selects an expert
        # at most once). Invalid slots go to a scratch row N that no count covers.
        hot = torch.zeros((N, E_loc), dtype=torch.int32, device=rows.device)
        hot.scatter_add_(1, e, valid.to(torch.int32))
        before = torch.cumsum(hot, 0) - hot
        pos = torch.where(valid, before.gather(1, e), torch.full_like(e, N))
        # Not zeroed: rows past an expert's count are never read back (the grouped GEMM skips them on GPUs; the dense
        # path computes each row on its own), and zeroing ~0.5 GB per layer at the DeepSeek shape would bill the
        # baseline for work no engine does.
        packed = torch.empty((E_loc, N + 1, H), dtype=rows.dtype, device=rows.device)
        packed[e, pos] = rows.unsqueeze(1).expand(N, K, H)
        gu, dn = self.experts[st['layer']]
        y = expert_mlp(packed[:, :N], gu, dn, counts=hot.sum(0).to(torch.int32))
        back = torch.where(valid.unsqueeze(-1), y[e, pos.clamp(max=N - 1)], torch.zeros((), dtype=y.dtype,
                                                                                           device=y.device))
        self._exchange(self.yr[st['mb']], back.view(R, T, K, H))

    def finish(self, st: dict) -> torch.Tensor:
        n, idx, w = st['n'], st['idx'], st['w']
        K = self.cfg.top_k
        d = idx.div(self.E_loc, rounding_mode='floor').clamp(min=0)
        t = torch.arange(n, device=idx.device).view(n, 1)
        got = self.yr[st['mb']][d, t, torch.arange(K, device=idx.device).view(1, K)]  # [n, K, H]: slot k's expert output
        acc = torch.zeros((n, self.cfg.hidden), dtype=torch.float32, device=idx.device)
        for k in range(K):
            acc = add_topk_term(acc, w[:, k], got[:, k], idx[:, k] >= 0)
        out = acc.to(torch.bfloat16)
        return out if st['s'] is None else add_shared(out, st['s'])
