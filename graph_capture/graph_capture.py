"""llep.graph_capture: an MoE decode step captured as one CUDA graph per batch size, on one llep Buffer.

Decode engines replay a graph per batch size (SGLang's CudaGraphRunner, vLLM's FULL cudagraph mode): sizes
1, 2, 4, ... up to the buffer's num_max_dispatch_tokens_per_rank, captured largest first into one memory pool, a
partial batch padded up to the next captured size. llep makes this safe where DeepEP V1 is not: the kernels pick the
buffer half on the device (kernels/cuda/ll_kernels.h LlCallState), so a graph may hold any number of low-latency
calls, graphs of different sizes share one buffer, and eager calls mix freely with replays (DeepEP#93).

  step = functools.partial(moe_step, buffer, expert_fn=my_experts, num_max_dispatch_tokens_per_rank=T,
                           num_experts=E, between=overlap_work)
  graphs = DecodeGraphs(buffer, step, max_tokens=T, hidden=H, num_topk=K)
  graphs.capture()                      # collective: every rank captures the same sizes in the same order
  out = graphs.run(x, topk_idx, topk_weights)   # pads to the next size, replays, returns rows [:n]

Rules (also in graph_capture/README.md):
  - capture() and run() are collective in the sense every llep call is: each rank's graphs hold the same sequence
    of low-latency calls, and ranks replay them in the same order. The sizes ranks pick may differ (each rank
    sends its own number of tokens; the layout depends on max_tokens only).
  - Outputs are the graph's static tensors: valid until the next run() of any graph sharing the pool.
  - The buffer's in-flight rules hold for the sequence of calls the replays make (at most two operations in
    flight; a receive region is reused only after this rank sent and received another operation since its last
    receive, which alternating dispatch and combine satisfies). The kernels check them on every replay and the
    next run() raises LlepFailedPreconditionError if one was broken; nothing is silently overwritten.
  - A step must not synchronise the host (capture runs in 'global' error mode by default, which turns any
    synchronising call from any thread into an error rather than a silent bug).
  - Padded tokens carry topk_idx = -1, weight 0 and x = 0: they are routed nowhere, so results equal an
    unpadded call, and their combine output rows are 0.

Without CUDA graphs (use_graphs=False, or the CPU backend) run() executes the step eagerly through the same
static, padded inputs, so the CPU backend checks the padding path bit for bit against the graphs.
"""
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

Outputs = Union[torch.Tensor, Tuple[torch.Tensor, ...]]


def graph_sizes(max_tokens: int, sizes: Optional[Sequence[int]] = None) -> List[int]:
    """The batch sizes to capture, largest first: by default 1, 2, 4, ... below max_tokens, and max_tokens."""
    if max_tokens < 1:
        raise ValueError(f'max_tokens must be >= 1, got {max_tokens}')
    if sizes is None:
        out, s = {max_tokens}, 1
        while s < max_tokens:
            out.add(s)
            s *= 2
    else:
        out = {int(s) for s in sizes}
        bad = [s for s in out if not 1 <= s <= max_tokens]
        if bad or not out:
            raise ValueError(f'graph sizes must lie in [1, {max_tokens}] (max_tokens), got {sorted(out) or "none"}')
    return sorted(out, reverse=True)


def pick_size(sizes: Sequence[int], num_tokens: int) -> int:
    """The smallest captured size that holds num_tokens tokens."""
    fits = [s for s in sizes if s >= num_tokens]
    if num_tokens < 0 or not fits:
        raise ValueError(f'a batch of {num_tokens} tokens does not fit the captured sizes {sorted(sizes)}')
    return min(fits)


def capture_sizes(sizes: Sequence[int], step: Callable[[int], Outputs], *, pool: Any, warmups: int = 2,
                  settle: Optional[Callable[[], None]] = None,
                  capture_error_mode: str = 'global') -> Dict[int, Tuple[Any, Outputs]]:
    """Collective. One CUDA graph of step(size) per size, in the order given (largest first: graph_sizes), all in
    `pool`. Per size: `warmups` eager steps (they also create what a step allocates lazily, e.g. the buffer's layout,
    which must not allocate inside a capture), then the capture; before each of them the device is synchronised and
    settle() runs (a barrier over the EP group, so every rank makes the same calls in the same order as SGLang's
    CudaGraphRunner does, or a check of the buffer's recorded errors). Returns {size: (graph, the captured outputs)}.
    The one capture loop of DecodeGraphs and llep.engine."""
    graphs: Dict[int, Tuple[Any, Outputs]] = {}
    for size in sizes:
        for i in range(warmups + 1):
            torch.cuda.synchronize()
            if settle is not None:
                settle()
            if i < warmups:
                step(size)
                continue
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_error_mode):
                graphs[size] = (graph, step(size))
    torch.cuda.synchronize()
    return graphs


def moe_step(buffer: Any, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
             expert_fn: Callable[[Any, torch.Tensor, tuple], torch.Tensor], *, num_max_dispatch_tokens_per_rank: int,
             num_experts: int, use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
             use_hooks: bool = True, between: Optional[Callable[[], Any]] = None,
             expert_side: bool = False) -> torch.Tensor:
    """One MoE layer's communication around the caller's experts: dispatch, expert_fn(recv, recv_count, handle)
    -> y bf16 [num_local_experts, num_ranks * T, hidden], combine; returns the combined [num_tokens, hidden].
    With use_hooks, send and receive are separate launches and `between()` (other GPU work: attention, shared
    experts) runs between each send and its receive, as a decode loop overlaps them. expert_side: the dispatch
    carries topk_weights (llep's combine_weights), so the combine reduces at the experts' ranks."""
    T, E = num_max_dispatch_tokens_per_rank, num_experts
    recv, count, handle, _, hook = buffer.low_latency_dispatch(
        x, topk_idx, T, E, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
        return_recv_hook=use_hooks, combine_weights=topk_weights if expert_side else None)
    if use_hooks:
        if between is not None:
            between()
        hook()
    y = expert_fn(recv, count, handle)
    out, _, hook = buffer.low_latency_combine(y, topk_idx, topk_weights, handle, return_recv_hook=use_hooks)
    if use_hooks:
        if between is not None:
            between()
        hook()
    return out


def moe_step_two_microbatches(buffer: Any, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                              expert_fn: Callable[[Any, torch.Tensor, tuple], torch.Tensor], *,
                              num_max_dispatch_tokens_per_rank: int, num_experts: int, use_fp8: bool = True,
                              round_scale: bool = False, use_ue8m0: bool = False,
                              between: Optional[Callable[[], Any]] = None, expert_side: bool = False) -> torch.Tensor:
    """The same layer as moe_step with the batch split into two micro-batches A and B whose communication overlaps
    (SGLang's two-batch overlap, vLLM's DBO): dispatch-send A, dispatch-send B, hook A, hook B, experts A,
    combine-send A, experts B, combine-send B, hook A, hook B. Two operations are in flight at every point, the
    most a buffer allows. Each micro-batch may hold up to num_max_dispatch_tokens_per_rank tokens; B may be empty
    (every rank still makes the same calls). expert_side as moe_step."""
    T, E = num_max_dispatch_tokens_per_rank, num_experts
    n = x.size(0)
    cut = (n + 1) // 2
    parts = [(x[:cut], topk_idx[:cut], topk_weights[:cut]), (x[cut:], topk_idx[cut:], topk_weights[cut:])]
    out = torch.empty_like(x)
    sent = []
    for xs, ids, w in parts:
        recv, count, handle, _, hook = buffer.low_latency_dispatch(
            xs, ids, T, E, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, return_recv_hook=True,
            combine_weights=w if expert_side else None)
        sent.append((recv, count, handle, hook))
    if between is not None:
        between()
    for _, _, _, hook in sent:
        hook()
    hooks = []
    for (recv, count, handle, _), (_, ids, w), rows in zip(sent, parts, (out[:cut], out[cut:])):
        y = expert_fn(recv, count, handle)
        _, _, hook = buffer.low_latency_combine(y, ids, w, handle, return_recv_hook=True, out=rows)
        hooks.append(hook)
    if between is not None:
        between()
    for hook in hooks:
        hook()
    return out


class _SizeSlot:
    """Static inputs, the graph and its outputs for one batch size."""

    def __init__(self, size: int, hidden: int, num_topk: int, device: torch.device) -> None:
        self.size = size
        self.x = torch.zeros((size, hidden), dtype=torch.bfloat16, device=device)
        self.topk_idx = torch.full((size, num_topk), -1, dtype=torch.int64, device=device)
        self.topk_weights = torch.zeros((size, num_topk), dtype=torch.float32, device=device)
        self.graph: Optional[Any] = None
        self.outputs: Optional[Outputs] = None


class DecodeGraphs:
    """A decode step `step(x, topk_idx, topk_weights) -> Tensor | tuple of Tensors` captured once per batch size on
    one llep Buffer, all graphs in one memory pool (pass `pool` to share another DecodeGraphs' pool too).

    run() returns the outputs listed in token_outputs (indices into a tuple; a single tensor is per token by
    default) cut to the caller's tokens, the others whole."""

    def __init__(self, buffer: Any, step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Outputs], *,
                 max_tokens: int, hidden: int, num_topk: int, sizes: Optional[Sequence[int]] = None,
                 use_graphs: Optional[bool] = None, pool: Any = None, capture_error_mode: str = 'global',
                 warmups: int = 2, token_outputs: Sequence[int] = (0,)) -> None:
        self.buffer = buffer
        self.step = step
        self.max_tokens = int(max_tokens)
        self.hidden = int(hidden)
        self.num_topk = int(num_topk)
        self.sizes = graph_sizes(self.max_tokens, sizes)
        gpu = getattr(buffer, 'backend', 'cpu') == 'cuda'
        if use_graphs is None:
            use_graphs = gpu
        if use_graphs and not gpu:
            raise ValueError('CUDA graphs need the Buffer\'s cuda backend')
        self.use_graphs = bool(use_graphs)
        self.device = torch.device('cuda', torch.cuda.current_device()) if gpu else torch.device('cpu')
        self.pool = pool if pool is not None or not self.use_graphs else torch.cuda.graph_pool_handle()
        self.capture_error_mode = capture_error_mode
        self.warmups = int(warmups)
        self.token_outputs = frozenset(int(i) for i in token_outputs)
        self._slots: Dict[int, _SizeSlot] = {
            s: _SizeSlot(s, self.hidden, self.num_topk, self.device) for s in self.sizes}
        self.captured = False

    def capture(self) -> None:
        """Collective. Per size, largest first: `warmups` eager steps (they also create the buffer's layout, which
        allocates and must not happen inside a capture), then the capture. Eager mode only marks itself ready."""
        if self.use_graphs:
            def step(size: int) -> Outputs:
                slot = self._slots[size]
                return self.step(slot.x, slot.topk_idx, slot.topk_weights)

            graphs = capture_sizes(self.sizes, step, pool=self.pool, warmups=self.warmups,
                                   settle=self.buffer.check_errors, capture_error_mode=self.capture_error_mode)
            for size, (graph, outputs) in graphs.items():
                self._slots[size].graph, self._slots[size].outputs = graph, outputs
        self.captured = True

    def _load(self, slot: _SizeSlot, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> None:
        n = x.size(0)
        if x.dim() != 2 or x.size(1) != self.hidden or topk_idx.shape != (n, self.num_topk) or \
                topk_weights.shape != (n, self.num_topk):
            raise ValueError(f'inputs must be x [n, {self.hidden}], topk_idx and topk_weights [n, {self.num_topk}]; '
                             f'got {tuple(x.shape)}, {tuple(topk_idx.shape)}, {tuple(topk_weights.shape)}')
        slot.x[:n].copy_(x)
        slot.topk_idx[:n].copy_(topk_idx)
        slot.topk_weights[:n].copy_(topk_weights)
        if n < slot.size:  # padding: routed nowhere
            slot.x[n:].zero_()
            slot.topk_idx[n:].fill_(-1)
            slot.topk_weights[n:].zero_()

    def run(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            size: Optional[int] = None) -> Outputs:
        """Copies the batch into the smallest captured size that holds it (or `size`), pads, replays (eager mode:
        runs the step), and returns the outputs cut to the batch. Raises the buffer's recorded kernel error first,
        so a broken buffer is never replayed silently."""
        if not self.captured:
            raise RuntimeError('DecodeGraphs.capture() has not run')
        n = x.size(0)
        size = pick_size(self.sizes, n) if size is None else int(size)
        if size not in self._slots or size < n:
            raise ValueError(f'size {size} is not a captured size holding {n} tokens ({sorted(self.sizes)})')
        self.buffer.check_errors(bad_input=False)  # fatal only: bad input is the caller's check_errors() to raise
        slot = self._slots[size]
        self._load(slot, x, topk_idx, topk_weights)
        if self.use_graphs:
            slot.graph.replay()
            outputs = slot.outputs
        else:
            outputs = self.step(slot.x, slot.topk_idx, slot.topk_weights)
        if isinstance(outputs, torch.Tensor):
            return outputs[:n]
        return tuple(t[:n] if i in self.token_outputs else t for i, t in enumerate(outputs))

    def reset(self) -> None:
        """Drops the graphs (before the buffer is destroyed, as engines tear graphs down before their groups)."""
        for slot in self._slots.values():
            slot.graph = None
            slot.outputs = None
        self.captured = False
