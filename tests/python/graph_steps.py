"""Decode steps shared by the graph-capture tests (tests/python/test_graph_capture.py on the CPU backend,
tests/gpu/graph_test.py on GPUs against the CPU backend).

Every step returns only well-defined tensors, so two backends (or a graph replay and an eager call) can be compared
bit for bit with plain equality: the combined output, and each dispatch's recv_count, layout_range and its
recv_x bytes / scales / src_info with the rows past recv_count zeroed. The expert stand-in is exact on every
device (FP8 codes times their fp32 scale rounded once to bf16; BF16 rows times 2).
"""
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from llep.graph_capture import moe_step, moe_step_two_microbatches

# kind -> (dispatch mode, sizes to capture (None = 1, 2, 4, ... max), LL calls per step: (dispatches, combines))
KINDS: Dict[str, Tuple[str, Optional[List[int]], Tuple[int, int]]] = {
    'hooks': ('fp8', None, (1, 1)),           # send / other GPU work / receive, every size
    'no_hooks': ('bf16', [0, 3], (1, 1)),     # one launch per operation; sizes: max and 3
    'two_microbatches': ('fp8_round', [0], (2, 2)),
    'odd_calls': ('fp8', [0, 5], (1, 2)),     # dispatch, combine, the same combine again: 3 LL calls per replay
    # The combine reduced at the expert side (combine_weights at dispatch): hooks at every size, and two micro-batches
    # (two kept plans in flight, one per buffer half).
    'expert_side': ('bf16', None, (1, 1)),
    'expert_side_two_microbatches': ('fp8', [0], (2, 2)),
}


def mode_flags(mode: str) -> Dict[str, bool]:
    return {'use_fp8': mode != 'bf16', 'round_scale': mode in ('fp8_round', 'ue8m0'), 'use_ue8m0': mode == 'ue8m0'}


def kind_sizes(kind: str, max_tokens: int) -> Optional[List[int]]:
    sizes = KINDS[kind][1]
    return None if sizes is None else sorted({max_tokens if s == 0 else min(s, max_tokens) for s in sizes})


def masked_dispatch(recv: Any, count: torch.Tensor, handle: tuple) -> List[torch.Tensor]:
    recv_x, scales = recv if isinstance(recv, tuple) else (recv, None)
    rows = recv_x.size(1)
    valid = torch.arange(rows, device=count.device).view(1, -1) < count.view(-1, 1)
    out = [count.clone(), handle[1].clone(),
           torch.where(valid.unsqueeze(-1), recv_x.view(torch.uint8), torch.zeros((), dtype=torch.uint8,
                                                                                  device=count.device)),
           torch.where(valid, handle[0], torch.full((), -7, dtype=torch.int32, device=count.device))]
    if scales is not None:
        s = scales.contiguous().view(torch.int32)
        out.append(torch.where(valid.unsqueeze(-1), s, torch.zeros((), dtype=torch.int32, device=count.device)))
    return out


def expert(recv: Any, count: torch.Tensor, handle: tuple) -> torch.Tensor:
    """The expert stand-in: the dispatched values, dequantised exactly (or BF16 doubled)."""
    if isinstance(recv, tuple):
        recv_x, scales = recv
        if scales.dtype == torch.int32:  # packed UE8M0: four exponent bytes per int32
            s = (scales.contiguous().view(torch.uint8).int() << 23).view(torch.float32)
        else:
            s = scales
        return (recv_x.float() * s.repeat_interleave(128, dim=-1)).to(torch.bfloat16)
    return recv * 2


def make_step(buffer: Any, kind: str, T: int, E: int,
              between: Optional[Callable[[], Any]] = None) -> Callable[..., Tuple[torch.Tensor, ...]]:
    """The step of `kind` on `buffer` (a llep.Buffer on either backend)."""
    mode = KINDS[kind][0]
    flags = mode_flags(mode)

    def step(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        seen: List[torch.Tensor] = []

        def recording_expert(recv: Any, count: torch.Tensor, handle: tuple) -> torch.Tensor:
            seen.extend(masked_dispatch(recv, count, handle))
            return expert(recv, count, handle)

        kw = dict(num_max_dispatch_tokens_per_rank=T, num_experts=E, **flags)
        if kind == 'odd_calls':  # a third low-latency call: a graph of this step flips the parity per replay
            recv, count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, **flags)
            y = recording_expert(recv, count, handle)
            out, _, _ = buffer.low_latency_combine(y, topk_idx, topk_weights, handle)
            again, _, _ = buffer.low_latency_combine(y, topk_idx, topk_weights, handle)
            return (torch.cat([out, again], dim=1), *seen)  # per token, as output 0 of every kind
        expert_side = kind.startswith('expert_side')
        if kind.endswith('two_microbatches'):
            out = moe_step_two_microbatches(buffer, x, topk_idx, topk_weights, recording_expert, between=between,
                                            expert_side=expert_side, **kw)
        else:
            out = moe_step(buffer, x, topk_idx, topk_weights, recording_expert, use_hooks=kind != 'no_hooks',
                           between=between, expert_side=expert_side, **kw)
        return (out, *seen)

    return step


def make_inputs(rank: int, seed: int, n: int, H: int, E: int, K: int, device: torch.device
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    x = (torch.randn((n, H), generator=g) * 2).to(torch.bfloat16)
    x[:, :128] *= 300  # a wide range between scale groups
    topk = torch.topk(torch.rand((n, E), generator=g), K, dim=-1).indices.to(torch.int64)
    topk[torch.rand((n, K), generator=g) < 0.1] = -1
    w = torch.rand((n, K), generator=g) + 0.05
    return x.to(device), topk.to(device), w.to(device)


def mismatch(a: Tuple[torch.Tensor, ...], b: Tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A 0-dim bool tensor (no host synchronisation): do two step results differ in any bit?"""
    if len(a) != len(b):
        return torch.ones((), dtype=torch.bool, device=a[0].device)
    diffs = []
    for x, y in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype:
            return torch.ones((), dtype=torch.bool, device=a[0].device)
        if x.dtype == torch.bfloat16:
            x, y = x.view(torch.int16), y.view(torch.int16)
        diffs.append((x != y).any())
    return torch.stack(diffs).any()


def describe_mismatch(a: Tuple[torch.Tensor, ...], b: Tuple[torch.Tensor, ...]) -> str:
    # Outputs: out, then per dispatch recv_count, layout_range, recv_x bytes, src_info[, scales].
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape:
            return f'output {i} shape {tuple(x.shape)} != {tuple(y.shape)}'
        if x.dtype == torch.bfloat16:
            x, y = x.view(torch.int16), y.view(torch.int16)
        bad = (x.cpu() != y.cpu())
        if bad.any():
            return f'output {i} ({x.dtype}): {int(bad.sum())} elements differ, first at {bad.nonzero()[0].tolist()}'
    return 'equal' if len(a) == len(b) else f'{len(a)} outputs != {len(b)}'
