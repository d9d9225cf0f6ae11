"""Continuous batching of decode requests on one rank, in lockstep with the other ranks of the expert-parallel group.

Each step: finished requests leave, waiting ones take free KV slots (up to max_batch), and every running request feeds
one token: the next prompt token while it is prefilling (prefill runs token by token, eagerly), else its last output.
Greedy sampling; optionally padded to fixed batch sizes and replayed as CUDA graphs, optionally as two overlapped
micro-batches. The ranks agree on every step through a CPU all-reduce (max) of the requests each has left: all ranks
step until no rank has work (each rank's batch size is its own: llep's layout depends on max_batch only), and a rank
without requests runs its MoE layers' dispatches and combines on a dummy token with no experts (EpMoE.idle), as
SGLang's DP-attention idle batches do."""
import dataclasses
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from llep.graph_capture import capture_sizes, graph_sizes, pick_size

from .model import Model


@dataclasses.dataclass
class Request:
    rid: int
    prompt: List[int]
    max_new_tokens: int
    output: List[int] = dataclasses.field(default_factory=list)
    pos: int = 0  # tokens of this request already in its KV cache
    slot: int = -1

    def next_token(self) -> int:
        return self.prompt[self.pos] if self.pos < len(self.prompt) else self.output[-1]

    def done(self, max_seq_len: int) -> bool:
        return len(self.output) >= self.max_new_tokens or self.pos >= max_seq_len


class _Static:
    """One batch size's static step inputs, rows tokens / positions / KV slots / valid (1 = a request, 0 = padding:
    token 0 at position 0 of the scratch KV slot), filled by one copy per step; its graph and its logits."""

    def __init__(self, size: int, scratch_slot: int, device: torch.device) -> None:
        self.size, self.scratch_slot = size, scratch_slot
        self.inputs = torch.zeros((4, size), dtype=torch.int64, device=device)
        self.inputs[2].fill_(scratch_slot)
        self.tokens, self.pos, self.slots, self.valid = self.inputs.unbind(0)
        self.graph = None
        self.logits: Optional[torch.Tensor] = None

    def load(self, tokens: List[int], pos: List[int], slots: List[int]) -> None:
        pad = self.size - len(tokens)
        host = torch.tensor([tokens + [0] * pad, pos + [0] * pad, slots + [self.scratch_slot] * pad,
                             [1] * len(tokens) + [0] * pad], dtype=torch.int64)
        self.inputs.copy_(host)


class Engine:
    def __init__(self, model: Model, max_batch: int, group: Optional[dist.ProcessGroup] = None,
                 idle: Optional[Callable[..., None]] = None, pad: bool = False, graphs: bool = False,
                 two_batches: bool = False, observe: Optional[Callable[[float, int], None]] = None) -> None:
        """group: the EP group the steps are kept in lockstep over (None: this engine runs alone); idle(layer): what a
        rank with no requests runs per MoE layer in a step the others take. pad: run every batch at the next size of
        1, 2, 4, ... max_batch (padding rows use the model's scratch KV slot max_batch and go to no expert); graphs:
        also capture one CUDA graph per size (largest first, one memory pool; collective) and replay it. The dense
        reference pads the same way as a graph-replaying engine, so both run identical shapes. two_batches: each step
        as two overlapped micro-batches (Model.forward_two_batches); idle(layer, micro_batches) then makes both
        micro-batches' calls. observe(seconds, tokens): called after every step that ran a batch (llep's
        Buffer.observe_decode_step: the exporter's step latency histogram and token counter)."""
        self.model, self.max_batch, self.group, self.idle, self.observe = model, max_batch, group, idle, observe
        self.micro_batches = 2 if two_batches else 1
        self._fwd = model.forward_two_batches if two_batches else model.forward
        self.sizes = graph_sizes(max_batch) if (pad or graphs) else None
        self.static = {s: _Static(s, max_batch, model.device) for s in self.sizes or []}
        if graphs:
            self._capture()
        self.waiting: List[Request] = []
        self.running: List[Request] = []
        self.finished: List[Request] = []
        self.free_slots = list(range(max_batch))
        self.steps = 0
        self.step_times: List[float] = []  # seconds per step in which this rank ran a batch

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def _capture(self) -> None:
        """Per size, largest first, into one pool (llep.graph_capture.capture_sizes): two warm-up steps and the
        capture, each after a synchronisation and a barrier over the EP group."""
        def step(size: int) -> torch.Tensor:
            s = self.static[size]
            return self._fwd(s.tokens, s.pos, s.slots, s.valid)

        graphs = capture_sizes(self.sizes, step, pool=torch.cuda.graph_pool_handle(), settle=self._barrier)
        for size, (graph, logits) in graphs.items():
            self.static[size].graph, self.static[size].logits = graph, logits

    def _forward(self, tokens: List[int], pos: List[int], slots: List[int]) -> torch.Tensor:
        n = len(tokens)
        if self.sizes is None:  # one host-to-device copy for the three rows
            inputs = torch.tensor([tokens, pos, slots], dtype=torch.int64).to(self.model.device)
            return self._fwd(*inputs.unbind(0))
        s = self.static[pick_size(self.sizes, n)]
        s.load(tokens, pos, slots)
        if s.graph is not None:
            s.graph.replay()
            return s.logits[:n]
        return self._fwd(s.tokens, s.pos, s.slots, s.valid)[:n]

    def close(self) -> None:
        """Drops the graphs (before the Buffer is destroyed, as engines tear graphs down before their groups)."""
        self.static = {}
        self.sizes = None

    def add(self, request: Request) -> None:
        if not request.prompt or len(request.prompt) + request.max_new_tokens > self.model.cfg.max_seq_len:
            raise ValueError(f'request {request.rid}: prompt of {len(request.prompt)} tokens plus '
                             f'{request.max_new_tokens} new must be within 1..{self.model.cfg.max_seq_len}')
        self.waiting.append(request)

    def _schedule(self) -> None:
        for r in [r for r in self.running if r.done(self.model.cfg.max_seq_len)]:
            self.running.remove(r)
            self.free_slots.append(r.slot)
            self.finished.append(r)
        while self.waiting and self.free_slots:
            r = self.waiting.pop(0)
            r.slot = self.free_slots.pop(0)
            self.running.append(r)

    def _agree(self) -> bool:
        """True while some rank has work (this one included)."""
        left = len(self.running) + len(self.waiting)
        if self.group is None:
            return left > 0
        t = torch.tensor([left], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item()) > 0

    def step(self) -> bool:
        """One decode step of every running request; False once no rank has work left."""
        self._schedule()
        if not self._agree():
            return False
        self.steps += 1
        if not self.running:
            for layer in range(self.model.cfg.num_layers):
                self.idle(layer, self.micro_batches)
            return True
        t0 = time.perf_counter()
        logits = self._forward([r.next_token() for r in self.running], [r.pos for r in self.running],
                               [r.slot for r in self.running])
        nxt = logits.argmax(-1).tolist()  # the host needs the tokens: this synchronises, as any sampler does
        for r, t in zip(self.running, nxt):
            r.pos += 1
            if r.pos >= len(r.prompt):
                r.output.append(int(t))
        self.step_times.append(time.perf_counter() - t0)
        if self.observe is not None:
            self.observe(self.step_times[-1], len(nxt))
        return True

    def run(self) -> List[Request]:
        while self.step():
            pass
        return sorted(self.finished, key=lambda r: r.rid)


def make_requests(rank: int, count: int, vocab: int, max_new_tokens: int, seed: int = 0) -> List[Request]:
    """This rank's requests: prompts of 1..8 tokens, drawn from (seed, rank)."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    out = []
    for i in range(count):
        n = int(torch.randint(1, 9, (1,), generator=g))
        out.append(Request(rid=rank * 100000 + i, prompt=torch.randint(0, vocab, (n,), generator=g).tolist(),
                           max_new_tokens=max_new_tokens))
    return out
