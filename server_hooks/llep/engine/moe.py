"""The MoE layer implementations a Model calls: `EpMoE`, expert-parallel over a low-latency Buffer (llep's or DeepEP's:
the same calls), and `DenseMoE`, the single-process reference that computes every selected expert of every token.

EpMoE per layer: dispatch (FP8 per-128 or BF16) -> the shared expert while the tokens travel (receive hooks) -> the
grouped expert MLP over [E_loc, R*T, H] -> combine into a preallocated `out`. The expert MLP runs on every row of the
[E_loc, R*T] receive area and never reads recv_count on the host (rows past an expert's count are garbage that combine
never reads), so a step is free of host synchronisation and can be captured in a CUDA graph."""
from typing import Callable, Dict, Optional

import torch

from .config import ModelConfig
from .experts import expert_mlp, stack_experts

# e4m3fn code -> value (the 256 codes; NaN codes map to NaN), per device: decodes FP8 receive rows on a torch without
# float8, drives fp8_round_trip, and is the tests' decoder. Cached so no call (and no graph capture) copies it to the
# device again.
_E4M3: Dict[torch.device, torch.Tensor] = {}


def e4m3_values(device: torch.device) -> torch.Tensor:
    if device not in _E4M3:
        vals = []
        for b in range(256):
            s, e, m = b >> 7, (b >> 3) & 0xF, b & 7
            v = float('nan') if (e == 15 and m == 7) else (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
            vals.append(-v if s else v)
        _E4M3[device] = torch.tensor(vals, dtype=torch.float32, device=device)
    return _E4M3[device]


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., H] e4m3 rows (float8 or uint8 codes) times their per-128-channel fp32 scales [..., H/128] -> bf16."""
    if q.dtype == torch.uint8:
        f = e4m3_values(q.device)[q.long()]
    else:
        f = q.float()
    return (f.unflatten(-1, (-1, 128)) * scales.float().unsqueeze(-1)).flatten(-2).to(torch.bfloat16)


def fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """bf16 rows [B, H] as FP8 dispatch delivers them: encoded per 128 channels exactly as llep's codec and DeepEP do
    (kernels/codec/fp8.h: amax = max(1e-4, max |x|), scale = 448 / amax, scale_inv = amax * (1 / 448), code = e4m3 of
    x * scale rounded to nearest even, saturated at 448) and decoded by dequantize_fp8. The reference applies it so an
    FP8 engine run can be compared token for token."""
    table = e4m3_values(x.device)[:127]  # codes 0..126: the non-negative finite values, increasing
    xf = x.float().unflatten(-1, (-1, 128))
    amax = xf.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = torch.tensor(448.0, device=x.device) / amax
    scale_inv = amax * torch.tensor(1.0 / 448.0, dtype=torch.float32, device=x.device)
    v = (xf * scale).abs().clamp(max=448.0)
    hi = torch.searchsorted(table, v.contiguous()).clamp(max=126)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = v - table[lo], table[hi] - v
    code = torch.where((d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0)), lo, hi)
    q = table[code] * torch.where(xf < 0, -1.0, 1.0)
    return (q * scale_inv).flatten(-2).to(torch.bfloat16)


def add_shared(routed: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    return (routed.float() + shared.float()).to(torch.bfloat16)


def add_topk_term(acc: torch.Tensor, w_k: torch.Tensor, y_k: torch.Tensor, valid_k: torch.Tensor) -> torch.Tensor:
    """acc + w_k * y_k as one fused multiply-add per element, where valid_k (slot k of the token has an expert): the
    product of two fp32 values is exact in fp64, so one rounding to fp32 after the add matches a fused multiply-add
    except where the fp64 sum itself rounds (vanishingly rare). The order of llep's combine: slots in top-k order."""
    step = (acc.double() + w_k.double().view(-1, 1) * y_k.double()).float()
    return torch.where(valid_k[:, None], step, acc)


class StagedMoE:
    """A MoE layer in the three stages two-batch overlap interleaves (send, middle, finish); subclasses define them
    and `dummy_x` / `dummy_idx` / `dummy_w` (a token routed nowhere)."""

    def __call__(self, layer: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                 shared: Optional[Callable[[], torch.Tensor]]) -> torch.Tensor:
        st = self.send(layer, x, idx, w, shared)
        self.middle(st)
        return self.finish(st)

    def idle(self, layer: int, micro_batches: int = 1) -> None:
        """A rank without requests still takes part in every layer's exchanges, in the order the others make them
        (with two-batch overlap: micro-batch A's dispatch and combine, then B's; Model.forward_two_batches): no
        tokens."""
        for mb in range(micro_batches):
            st = self.send(layer, self.dummy_x[:0], self.dummy_idx[:0], self.dummy_w[:0], None, mb)
            self.middle(st)
            self.finish(st)


class DenseMoE:
    """Reference: out[t] = bf16(sum_k w[t,k] * expert_{idx[t,k]}(x[t])) in fp32, top-k order (as llep's combine adds),
    plus the shared expert. With expert_side_ranks = R > 0, the order of llep's combine reduced at the expert side
    (EpMoE expert_side; kernels/EXPERT_SIDE_COMBINE.md) over R ranks of E / R experts each: out[t] = bf16(sum over the
    ranks r, ascending, of bf16(sum_k w[t,k] * y in fp32, top-k order, over t's selections on r)) in fp32."""

    def __init__(self, cfg: ModelConfig, weights: Dict[str, torch.Tensor], device: torch.device,
                 use_fp8: bool = False, expert_side_ranks: int = 0) -> None:
        self.use_fp8 = use_fp8  # the rows the experts see went through FP8 (fp8_round_trip), as dispatch sends them
        self.expert_side_ranks = expert_side_ranks
        self.E_loc = cfg.num_experts // expert_side_ranks if expert_side_ranks else 0
        self.experts = [tuple(t.to(device) for t in stack_experts(weights, layer, range(cfg.num_experts)))
                        for layer in range(cfg.num_layers)]

    # The staged form two-batch overlap uses (EpMoE's stages; the reference computes everything in finish()).
    def send(self, layer, x, idx, w, shared, mb=0):
        return (layer, x, idx, w, shared)

    def middle(self, state) -> None:
        pass

    def finish(self, state) -> torch.Tensor:
        return self(*state)

    def __call__(self, layer: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                 shared: Callable[[], torch.Tensor]) -> torch.Tensor:
        gu, dn = self.experts[layer]
        rows = fp8_round_trip(x) if self.use_fp8 else x
        ys = [expert_mlp(rows.unsqueeze(1), gu[e.clamp(min=0)], dn[e.clamp(min=0)]).squeeze(1) for e in idx.t()]
        if not self.expert_side_ranks:
            acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            for k, y in enumerate(ys):
                acc = add_topk_term(acc, w[:, k], y, idx[:, k] >= 0)
            return add_shared(acc.to(torch.bfloat16), shared())
        total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for r in range(self.expert_side_ranks):  # each rank's partial rounded to bf16, the ranks added in fp32
            part = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            for k, y in enumerate(ys):
                part = add_topk_term(part, w[:, k], y, (idx[:, k] >= 0) & (idx[:, k] // self.E_loc == r))
            total = total + part.to(torch.bfloat16).float()
        return add_shared(total.to(torch.bfloat16), shared())


class EpMoE(StagedMoE):
    """Expert parallel over `buffer` (llep.Buffer or deep_ep.Buffer), one Buffer for every layer. This rank holds
    experts [rank * E_loc, (rank + 1) * E_loc). `hooks`: dispatch and combine with return_recv_hook and the shared
    expert between the send and the receive; otherwise the shared expert runs after the dispatch returns.
    `expert_side` (llep's Buffer only): each dispatch carries its topk_weights (llep's `combine_weights` keyword), so
    the combine reduces a token's rows on the experts' ranks and returns one row per (token, rank): fewer combine bytes
    from ~32 tokens per rank (bench/RESULTS.md sessions 29-30), one more bf16 rounding than DeepEP's order."""

    def __init__(self, cfg: ModelConfig, weights: Dict[str, torch.Tensor], buffer, rank: int, num_ranks: int,
                 max_tokens: int, device: torch.device, use_fp8: bool = False, hooks: bool = True,
                 expert_side: bool = False) -> None:
        self.cfg, self.buffer, self.T, self.use_fp8, self.hooks = cfg, buffer, max_tokens, use_fp8, hooks
        self.expert_side = expert_side
        E_loc = cfg.num_experts // num_ranks
        mine = range(rank * E_loc, (rank + 1) * E_loc)
        self.experts = [tuple(t.to(device) for t in stack_experts(weights, layer, mine)) for layer in range(cfg.num_layers)]
        # Combine outputs, one area per micro-batch of two-batch overlap (output rows of A and B stay apart).
        self.out = torch.empty((2, max_tokens, cfg.hidden), dtype=torch.bfloat16, device=device)
        self.dummy_x = torch.zeros((1, cfg.hidden), dtype=torch.bfloat16, device=device)
        self.dummy_idx = torch.full((1, cfg.top_k), -1, dtype=torch.int64, device=device)
        self.dummy_w = torch.zeros((1, cfg.top_k), dtype=torch.float32, device=device)
        # llep counts received tokens per MoE layer (its `layer` keyword); DeepEP's Buffer has no such argument.
        self.per_layer = hasattr(buffer, 'metrics_snapshot')

    def send(self, layer: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
             shared: Optional[Callable[[], torch.Tensor]], mb: int = 0) -> dict:
        """Stage 1: the dispatch's send (micro-batch mb's combine output area). A micro-batch without tokens sends a
        dummy token routed nowhere, so every rank makes the same calls."""
        n = x.shape[0]
        if n == 0:
            x, idx, w = self.dummy_x, self.dummy_idx, self.dummy_w
        recv, count, handle, _event, hook = self.buffer.low_latency_dispatch(
            x, idx, self.T, self.cfg.num_experts, use_fp8=self.use_fp8, return_recv_hook=self.hooks,
            **({'layer': layer} if self.per_layer else {}), **({'combine_weights': w} if self.expert_side else {}))
        return {'layer': layer, 'n': n, 'rows': x.shape[0], 'idx': idx, 'w': w, 'shared': shared, 'mb': mb,
                'recv': recv, 'count': count, 'handle': handle, 'hook': hook}

    def middle(self, st: dict) -> None:
        """Stage 2: the shared expert while the tokens travel, the dispatch's receive, the experts, the combine's
        send."""
        st['s'] = st['shared']() if st['shared'] is not None and st['n'] > 0 else None
        if self.hooks:
            st['hook']()
        rows = dequantize_fp8(*st['recv']) if self.use_fp8 else st['recv']
        gu, dn = self.experts[st['layer']]
        y = expert_mlp(rows, gu, dn, counts=st['count'])  # only the rows each expert received (grouped_gemm.py)
        st['out'], _event, st['chook'] = self.buffer.low_latency_combine(
            y, st['idx'], st['w'], st['handle'], return_recv_hook=self.hooks, out=self.out[st['mb'], :st['rows']])

    def finish(self, st: dict) -> torch.Tensor:
        """Stage 3: the combine's receive; the micro-batch's MoE output (routed sum plus shared expert)."""
        if self.hooks:
            st['chook']()
        out = st['out'][:st['n']]
        return out if st['s'] is None else add_shared(out, st['s'])
