"""Expert weights as grouped-GEMM operands and the expert MLP every path (routed, shared, reference) computes with."""
from typing import Dict, List, Optional, Tuple

import torch

from . import grouped_gemm


# The expert MLP's arithmetic when the run is checked against the dense reference (set_exact), and always on the CPU:
# fp64, whose sums of fp32-exact products round to the same bf16 however the rows are batched (the EP engine batches
# [E_loc, R*T] rows, the reference one token at a time), so the two agree bit for bit.
_EXACT = False


def set_exact(exact: bool) -> None:
    global _EXACT
    _EXACT = exact


def exact(device: torch.device) -> bool:
    return _EXACT or device.type == 'cpu'


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
               counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SiLU-gated MLP of bf16 rows x [..., H] with gate_up [..., H, 2I] and down [..., I, H] (batched over leading
    dims), returning bf16: in fp64 when exact (see set_exact), else bf16 GEMMs with fp32 accumulation, as engines run
    them. counts (int32 device [G], for x [G, M, H]): only each group's first counts[g] rows are computed
    (grouped_gemm.py, when Triton is there); the other rows of the result are undefined."""
    if counts is not None and not exact(x.device) and grouped_gemm.available(x):
        g, u = grouped_gemm.masked_grouped_mm(x, gate_up, counts).chunk(2, dim=-1)
        act = (torch.nn.functional.silu(g.float()) * u.float()).to(torch.bfloat16)
        return grouped_gemm.masked_grouped_mm(act, down, counts)
    if exact(x.device):
        # A few groups at a time: each group's rows meet only its own weights, so the result is the same, and the
        # fp64 copies of the weights stay bounded (a whole DeepSeek-V3 rank, 128 experts, is ~45 GB in fp64).
        step = max(1, _EXACT_WEIGHT_BYTES // (8 * (gate_up.shape[-2:].numel() + down.shape[-2:].numel())))
        if x.dim() < 3 or gate_up.dim() < 3 or x.shape[0] <= step:  # not batched per group, or one product
            return _exact_mlp(x, gate_up, down)
        return torch.cat([_exact_mlp(x[i:i + step], gate_up[i:i + step], down[i:i + step])
                          for i in range(0, x.shape[0], step)])
    g, u = torch.matmul(x, gate_up).chunk(2, dim=-1)
    return torch.matmul((torch.nn.functional.silu(g.float()) * u.float()).to(torch.bfloat16), down)


_EXACT_WEIGHT_BYTES = 1 << 30  # fp64 weight bytes converted at once by the exact path


def _exact_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    g, u = torch.matmul(x.double(), gate_up.double()).chunk(2, dim=-1)
    return torch.matmul(torch.nn.functional.silu(g) * u, down.double()).to(torch.bfloat16)


def stack_mlps(weights: Dict[str, torch.Tensor], prefixes: List[str]) -> Tuple[torch.Tensor, torch.Tensor]:
    """[len(prefixes), H, 2I] gate|up and [len(prefixes), I, H] down of the MLPs whose weights are named
    prefix + 'gate_proj.weight' etc. (the grouped GEMM's operands)."""
    gu = torch.stack([torch.cat([weights[p + 'gate_proj.weight'], weights[p + 'up_proj.weight']]).t() for p in prefixes])
    dn = torch.stack([weights[p + 'down_proj.weight'].t() for p in prefixes])
    return gu.contiguous(), dn.contiguous()


def stack_experts(weights: Dict[str, torch.Tensor], layer: int, experts: range) -> Tuple[torch.Tensor, torch.Tensor]:
    """stack_mlps of a layer's routed experts."""
    return stack_mlps(weights, [f'model.layers.{layer}.mlp.experts.{e}.' for e in experts])
