#!/usr/bin/env python3
"""The bad-input catalogue (issue #15): every kind of bad input through the Python API, on either backend.

Each row of CASES makes one bad call (every rank the same one, as a buggy engine would) and names the typed error it
must raise and a pattern its message must match. None may crash, hang or corrupt: after every row the ranks run an
exact round on the same buffer (BF16 dispatch + combine, every count, layout range, source index, row and output
compared for equality with what the routing implies), so an error that left state behind fails the row after it.

Errors the GPU can only find on the device (expert ids out of range or repeated, a corrupt layout_range, a combine
whose topk_idx is not its dispatch's) are recorded by the kernels, which drop the bad entries and keep the buffer
consistent; the row then synchronises and calls Buffer.check_errors(), which raises them. On the CPU backend the same
rows raise at the call.

Known limit (as in DeepEP): a combine given the topk_idx of another dispatch that selects the same number of
experts per rank cannot be told from the right one (the rows land by position); a different count is caught.

CI runs it on the CPU backend (2 ranks); the GPU test script as `test_bad_inputs.py --device cuda`.
Usage: test_bad_inputs.py [--device cpu|cuda] [--rows REGEX]   (exit 0 = pass; --rows runs the rows whose names
match, each still followed by its exact round, e.g. to chase one failure)"""
import argparse
import datetime
import os
import re
import sys
import time
from typing import Any, Callable, List, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import llep
from llep.utils import free_port

R, T, H, E, K = 2, 8, 512, 8, 3
E_LOC = E // R
IA, FP = llep.LlepInvalidArgumentError, llep.LlepFailedPreconditionError


class Case(NamedTuple):
    name: str
    call: Callable[['Ctx'], Any]
    error: type
    pattern: str
    cleanup: Optional[Callable[['Ctx'], Any]] = None


def _inputs(rank: int, seed: int, dev: torch.device):
    """x, topk_idx, weights of (rank, seed). Values are small integers and weights quarters, so every combine sum is
    exact in fp32 and in bf16: results compare with torch.equal. The last token selects K experts (no -1)."""
    g = torch.Generator().manual_seed(7919 * seed + rank)
    n = T - seed % 2
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]).to(torch.int64)
    if n > 1:
        topk[0, 1] = -1
    t = torch.arange(n).view(-1, 1)
    x = (((rank * 16 + t + torch.arange(H).view(1, -1)) % 17) - 8).to(torch.bfloat16)
    w = (((t + torch.arange(K).view(1, -1) + rank) % 4 + 1) * 0.25).to(torch.float32)
    return x.to(dev), topk.to(dev), w.to(dev)


class Ctx:
    def __init__(self, buf: Any, group: Any, rank: int, dev: torch.device) -> None:
        self.buf, self.group, self.rank, self.dev = buf, group, rank, dev
        self.x, self.topk, self.w = _inputs(rank, 0, dev)
        # A device this buffer does not work on: CPU tensors for the GPU backend, meta tensors for the CPU one.
        self.other = torch.device('cpu') if dev.type == 'cuda' else torch.device('meta')
        self.pending: List[Any] = []  # hooks a row left to its cleanup
        self.last: Any = None  # what a row hands its cleanup

    def settle(self) -> None:
        """GPU: wait for the queued work and raise what the kernels recorded (CPU: the call already raised)."""
        if self.dev.type == 'cuda':
            torch.cuda.synchronize()
            self.buf.check_errors()

    def dispatch(self, x=None, topk=None, tokens=T, experts=E, **kw):
        kw.setdefault('use_fp8', False)
        return self.buf.low_latency_dispatch(self.x if x is None else x, self.topk if topk is None else topk, tokens,
                                             experts, **kw)

    def good(self):
        recv, _, handle, _, _ = self.dispatch()
        return recv, handle

    def combine(self, x=None, topk=None, w=None, handle=None, **kw):
        if handle is None:
            x_, handle = self.good()
            x = x_ if x is None else x
        return self.buf.low_latency_combine(x, self.topk if topk is None else topk, self.w if w is None else w,
                                            handle, **kw)

    def combine_with(self, edit: Callable[[tuple], tuple]):
        """A combine of a good dispatch's rows with its handle edited."""
        recv, handle = self.good()
        return self.buf.low_latency_combine(recv, self.topk, self.w, edit(handle))

    def fresh(self, **kw):
        b = llep.Buffer(self.group, low_latency_mode=True, explicitly_destroy=True, **kw)
        b.backend = self.buf.backend
        return b

    def bad_ids_round(self, edit: Callable[[torch.Tensor], None]) -> None:
        """Dispatch and combine with edited ids (the GPU drops the bad ones and records them), then settle."""
        topk = self.topk.clone()
        edit(topk)
        recv, _, handle, _, _ = self.dispatch(topk=topk)
        self.buf.low_latency_combine(recv, topk, self.w, handle)
        self.settle()

    def hooked(self):
        recv, _, handle, _, hook = self.dispatch(return_recv_hook=True)
        self.pending.append(hook)
        return recv, handle, hook

    def run_pending(self) -> None:
        hooks, self.pending = self.pending, []
        for h in hooks:
            h()


def _set(i: int, j: int, value: int) -> Callable[[torch.Tensor], None]:
    def edit(t: torch.Tensor) -> None:
        t[i, j] = value if value is not None else t[i, 0]
    return edit


def _three_in_flight(c: Ctx) -> None:
    c.hooked()
    c.last = c.hooked()
    c.dispatch()


def _after_three_in_flight(c: Ctx) -> None:
    """Receive both, then combine the second: the next dispatch reuses its region only after another send+receive."""
    c.run_pending()
    if c.last is None:  # the row's call failed before its second dispatch: its problem says how; nothing to combine
        return
    recv, handle, _ = c.last
    c.buf.low_latency_combine(recv, c.topk, c.w, handle)


def _exporter_twice(c: Ctx) -> None:
    c.buf.start_metrics_exporter(port=0)
    c.buf.start_metrics_exporter(port=0)


def _native_call(c: Ctx, op: str, *args: Any, **kw: Any) -> None:
    """The backend's own dispatch / combine method (the crossing llep/buffer.py calls with every argument named as the
    DispatchCall / CombineCall field it fills), called with arguments it must refuse before reading any."""
    c.good()  # the runtime exists
    getattr(c.buf.runtime, op)(*args, **kw)


_COMBINE_ARGS = ('x', 'zero_copy', 'topk_idx', 'topk_weights', 'num_tokens', 'num_topk', 'layout_range', 'out',
                 'wait_recv_cost_stats', 'plan_key', 'expert_reduced', 'split', 'stream')


def _renamed(names: tuple, i: int, new: str) -> dict:
    return {new if k == i else n: 0 for k, n in enumerate(names)}


def _combine_before_dispatch(c: Ctx) -> None:
    b = c.fresh()
    try:
        handle = (torch.zeros((E_LOC, R * T), dtype=torch.int32, device=c.dev),
                  torch.zeros((E_LOC, R), dtype=torch.int64, device=c.dev), T, H, E)
        b.clean_low_latency_buffer(T, H, E)
        b.low_latency_combine(torch.zeros((E_LOC, R * T, H), dtype=torch.bfloat16, device=c.dev), c.topk, c.w, handle)
    finally:
        if b.runtime is not None:
            b.destroy()


def _hook_twice(c: Ctx) -> None:
    recv, handle, hook = c.hooked()
    c.run_pending()
    c.buf.low_latency_combine(recv, c.topk, c.w, handle)
    hook()


def _combine_unreceived(c: Ctx) -> None:
    recv, handle, _ = c.hooked()
    c.buf.low_latency_combine(recv, c.topk, c.w, handle)


def _mismatched_topk(c: Ctx) -> None:
    recv, handle = c.good()
    c.buf.low_latency_combine(recv, c.topk[:-1], c.w[:-1], handle)  # the last token (K experts) is missing
    c.settle()


def _corrupt_layout(c: Ctx) -> None:
    recv, handle = c.good()
    c.buf.low_latency_combine(recv, c.topk, c.w, (handle[0], torch.full_like(handle[1], 1 << 40)) + handle[2:])
    c.settle()


def _repeat_past_eight(c: Ctx) -> None:
    """A top-12 call (slots K..11 masked) in which token 1 repeats its slot-0 expert in slot 9: past the first eight
    slots, which the kernels validate together (the dispatch send's route counting takes them eight at a time), so the
    repeat must be found across passes. It is dropped, so each block's row count is the top-K call's, and recorded."""
    topk = torch.full((c.topk.size(0), 12), -1, dtype=torch.int64, device=c.dev)
    topk[:, :K] = c.topk
    topk[1, 9] = topk[1, 0]
    w = torch.zeros(topk.shape, dtype=torch.float32, device=c.dev)
    w[:, :K] = c.w
    recv, _, handle, _, _ = c.dispatch(topk=topk)
    if c.dev.type == 'cuda':  # the CPU backend raised at the call
        layout = handle[1].cpu()
        for le in range(E_LOC):
            for src in range(R):
                want = int((_inputs(src, 0, torch.device('cpu'))[1] == c.rank * E_LOC + le).any(dim=1).sum())
                got = int(layout[le, src] & 0xFFFFFFFF)
                assert got == want, f'expert {c.rank * E_LOC + le} from rank {src}: {got} rows, expected {want}'
    c.buf.low_latency_combine(recv, topk, w, handle)
    c.settle()


def _cases(c: Ctx) -> List[Case]:
    dev, other, n = c.dev, c.other, c.x.size(0)
    layers = int(c.buf._options['metrics_layers'])
    i32 = dict(dtype=torch.int32, device=dev)
    i64 = dict(dtype=torch.int64, device=dev)
    bf16 = dict(dtype=torch.bfloat16, device=dev)
    return [
        # ---- constructor and buffer shape (a fresh Buffer; refused before anything collective)
        Case('ctor_without_group', lambda c: llep.Buffer(None), ValueError, 'torch.distributed group'),
        Case('ctor_negative_rdma_bytes', lambda c: c.fresh(num_rdma_bytes=-128), IA, 'num_rdma_bytes must be a non'),
        Case('ctor_negative_nvl_bytes', lambda c: c.fresh(num_nvl_bytes=-1), IA, 'num_nvl_bytes must be a non'),
        Case('ctor_rdma_bytes_not_128_aligned', lambda c: c.fresh(num_rdma_bytes=1000), IA, 'multiple of 128'),
        Case('ctor_zero_qps_per_rank', lambda c: c.fresh(num_qps_per_rank=0), IA, 'num_qps_per_rank'),
        Case('unknown_backend', lambda c: (setattr(b := c.fresh(), 'backend', 'tpu'), b.clean_low_latency_buffer(
            T, H, E)), IA, 'backend must be'),
        Case('buffer_too_small', lambda c: c.fresh(num_rdma_bytes=128).clean_low_latency_buffer(T, H, E), IA,
             'smaller than the'),
        Case('shape_zero_tokens', lambda c: c.fresh().clean_low_latency_buffer(0, H, E), IA,
             'num_max_dispatch_tokens_per_rank must be in'),
        Case('shape_absurd_tokens', lambda c: c.fresh().clean_low_latency_buffer(10**9, H, E), IA,
             'num_max_dispatch_tokens_per_rank must be in'),
        Case('shape_fractional_tokens', lambda c: c.fresh().clean_low_latency_buffer(8.5, H, E), TypeError, 'integer'),
        Case('shape_negative_hidden', lambda c: c.fresh().clean_low_latency_buffer(T, -128, E), IA, 'hidden must be'),
        Case('shape_hidden_not_128_multiple', lambda c: c.fresh().clean_low_latency_buffer(T, 100, E), IA,
             'hidden must be a positive multiple of 128'),
        Case('shape_absurd_hidden', lambda c: c.fresh().clean_low_latency_buffer(T, 1 << 30, E), IA, 'hidden must be'),
        Case('shape_zero_experts', lambda c: c.fresh().clean_low_latency_buffer(T, H, 0), IA,
             'num_experts must be in'),
        Case('shape_absurd_experts', lambda c: c.fresh().clean_low_latency_buffer(T, H, 1 << 40), IA,
             r'num_experts \(1099511627776\) is out of range'),
        Case('shape_too_many_experts', lambda c: c.fresh().clean_low_latency_buffer(T, H, 1 << 30), IA,
             'num_experts must be in'),
        Case('shape_experts_not_divisible', lambda c: c.fresh().clean_low_latency_buffer(T, H, E + 1), IA,
             'divisible by num_ranks'),
        Case('shape_rows_not_multiple_of_4', lambda c: c.fresh().clean_low_latency_buffer(1, H, E), IA,
             'multiple of 4'),
        Case('switch_layout_above_num_rdma_bytes', lambda c: c.buf.clean_low_latency_buffer(T * 64, H, E), IA,
             'smaller than the'),
        # ---- dispatch: x
        Case('x_not_a_tensor', lambda c: c.dispatch(x=c.x.tolist()), IA, '2-D torch.Tensor'),
        Case('x_float32', lambda c: c.dispatch(x=c.x.float()), IA, 'x must have dtype torch.bfloat16'),
        Case('x_one_dimensional', lambda c: c.dispatch(x=c.x[0]), IA, '2-D torch.Tensor'),
        Case('x_non_contiguous', lambda c: c.dispatch(x=c.x.t().contiguous().t()), IA, 'x must be contiguous'),
        Case('x_on_another_device', lambda c: c.dispatch(x=c.x.to(other)), IA, 'x is on|has no data'),
        Case('x_other_hidden', lambda c: c.dispatch(x=torch.zeros((n, 2 * H), **bf16)), IA, 'every call must agree'),
        Case('x_more_tokens_than_the_buffer', lambda c: c.dispatch(x=torch.zeros((T + 1, H), **bf16),
                                                                     topk=torch.zeros((T + 1, K), **i64)), IA,
             r'num_tokens \(9\) must be in \[0, 8\]'),
        # ---- dispatch: topk_idx
        Case('topk_int32', lambda c: c.dispatch(topk=c.topk.int()), IA, 'topk_idx must have dtype torch.int64'),
        Case('topk_one_dimensional', lambda c: c.dispatch(topk=c.topk.flatten()), IA, 'topk_idx must have shape'),
        Case('topk_row_count_mismatch', lambda c: c.dispatch(topk=c.topk[1:]), IA, 'topk_idx must have shape'),
        Case('topk_non_contiguous', lambda c: c.dispatch(topk=c.topk.t().contiguous().t()), IA,
             'topk_idx must be contiguous'),
        Case('topk_on_another_device', lambda c: c.dispatch(topk=c.topk.to(other)), IA, 'topk_idx is on|has no data'),
        Case('topk_no_slots', lambda c: c.dispatch(topk=c.topk[:, :0].contiguous()), IA, 'num_topk must be in'),
        Case('topk_too_many_slots', lambda c: c.dispatch(topk=torch.full((n, 17), -1, **i64)), IA,
             'num_topk must be in'),
        Case('topk_id_too_large', lambda c: c.bad_ids_round(_set(1, 0, E)), IA, 'out of range|outside'),
        Case('topk_id_below_minus_one', lambda c: c.bad_ids_round(_set(1, 0, -2)), IA, 'out of range|outside'),
        Case('topk_id_repeated', lambda c: c.bad_ids_round(_set(1, 1, None)), IA, 'twice|repeated'),
        Case('topk_id_repeated_past_slot_eight', _repeat_past_eight, IA, 'twice|repeated'),
        # ---- dispatch: the other arguments
        Case('num_experts_not_the_buffers', lambda c: c.dispatch(experts=2 * E), IA, 'every call must agree'),
        Case('tokens_per_rank_not_the_buffers', lambda c: c.dispatch(tokens=2 * T), IA, 'every call must agree'),
        Case('tokens_per_rank_fractional', lambda c: c.dispatch(tokens=8.5), TypeError, 'integer'),
        Case('cumulative_stats_wrong_shape', lambda c: c.dispatch(
            cumulative_local_expert_recv_stats=torch.zeros(E_LOC + 1, **i32)), IA,
            'cumulative_local_expert_recv_stats must have shape'),
        Case('cumulative_stats_int64', lambda c: c.dispatch(
            cumulative_local_expert_recv_stats=torch.zeros(E_LOC, **i64)), IA,
            'cumulative_local_expert_recv_stats must have dtype'),
        Case('wait_stats_int32', lambda c: c.dispatch(dispatch_wait_recv_cost_stats=torch.zeros(R, **i32)), IA,
             'dispatch_wait_recv_cost_stats must have dtype'),
        Case('wait_stats_on_another_device', lambda c: c.dispatch(
            dispatch_wait_recv_cost_stats=torch.zeros(R, dtype=torch.int64, device=other)), IA,
            'dispatch_wait_recv_cost_stats is on|has no data'),
        Case('layer_beyond_metrics_layers', lambda c: c.dispatch(layer=layers), IA, f'layer {layers} is outside'),
        Case('layer_negative', lambda c: c.dispatch(layer=-1), IA, 'layer -1 is outside'),
        Case('layer_not_an_int', lambda c: c.dispatch(layer=1.5), TypeError,
             r'argument 16 \(layer\) must be an int, got float'),
        Case('dispatch_async_and_hook', lambda c: c.dispatch(async_finish=True, return_recv_hook=True), IA,
             'mutually exclusive'),
        Case('ue8m0_without_round_scale', lambda c: c.dispatch(use_fp8=True, use_ue8m0=True), IA,
             'use_ue8m0 requires round_scale'),
        Case('round_scale_without_fp8', lambda c: c.dispatch(round_scale=True), IA, 'round_scale requires use_fp8'),
        Case('dispatch_unknown_keyword', lambda c: c.dispatch(no_such_argument=1), TypeError, 'unexpected keyword'),
        Case('dispatch_fork_feature', lambda c: c.dispatch(use_nvfp4=True), NotImplementedError, 'use_nvfp4'),
        Case('native_combine_misnamed_keyword',
             lambda c: _native_call(c, 'combine', **_renamed(_COMBINE_ARGS, 2, 'topk')), TypeError,
             r"argument 3 must be 'topk_idx', got keyword 'topk'"),
        Case('native_combine_keywords_out_of_order', lambda c: _native_call(
            c, 'combine', 0, False, **{n: 0 for n in reversed(_COMBINE_ARGS[2:])}), TypeError,
             r"argument 3 must be 'topk_idx', got keyword 'stream'"),
        Case('native_combine_argument_count', lambda c: _native_call(c, 'combine', 0, False, topk_idx=0), TypeError,
             r'combine\(\) takes 13 arguments \(3 given\)'),
        Case('native_dispatch_misnamed_keyword', lambda c: _native_call(c, 'dispatch', 0, 0, None, 1, 1, False, False,
                                                                        False, 0, 0, 0, 0, 0, cumulative_stats=0,
                                                                        wait_recv_cost_stats=0, layer=0, plan_key=0,
                                                                        split=False, stream=0), TypeError,
             r"argument 14 must be 'cumulative_local_expert_recv_stats', got keyword 'cumulative_stats'"),
        # ---- combine
        Case('combine_before_any_dispatch', _combine_before_dispatch, FP, 'before any low_latency_dispatch'),
        Case('combine_x_float32', lambda c: c.combine(x=torch.zeros((E_LOC, R * T, H), dtype=torch.float32,
                                                                    device=dev)), IA, 'x must have dtype'),
        Case('combine_x_wrong_shape', lambda c: c.combine(x=torch.zeros((E_LOC, R * T - 1, H), **bf16)), IA,
             'x must have shape'),
        Case('combine_x_on_another_device', lambda c: c.combine(x=torch.zeros((E_LOC, R * T, H), dtype=torch.bfloat16,
                                                                              device=other)), IA, 'x is on|has no data'),
        Case('combine_weights_float64', lambda c: c.combine(w=c.w.double()), IA, 'topk_weights must have dtype'),
        Case('combine_weights_wrong_shape', lambda c: c.combine(w=c.w[:, :-1].contiguous()), IA,
             'topk_weights must have shape'),
        Case('combine_topk_int32', lambda c: c.combine(topk=c.topk.int()), IA, 'topk_idx must have dtype'),
        Case('combine_handle_a_list', lambda c: c.combine(handle=list(c.good()[1])), IA, 'handle must be the 5-tuple'),
        Case('combine_handle_too_short', lambda c: c.combine(handle=c.good()[1][:4]), IA, 'handle must be the 5-tuple'),
        Case('combine_handle_of_another_layout', lambda c: c.combine(handle=c.good()[1][:2] + (2 * T, H, E)), IA,
             'every call must agree'),
        Case('combine_handle_src_info_shape', lambda c: c.combine_with(lambda h: (h[0][:1],) + h[1:]), IA,
             r'src_info\) must have shape'),
        Case('combine_handle_layout_int32', lambda c: c.combine_with(lambda h: (h[0], h[1].int()) + h[2:]), IA,
             r'layout_range\) must have dtype'),
        Case('combine_handle_corrupt_layout', _corrupt_layout, IA, 'layout_range'),
        Case('combine_topk_of_another_dispatch', _mismatched_topk, IA, 'topk_idx of the matching dispatch'),
        Case('combine_out_float32', lambda c: c.combine(out=torch.empty((n, H), dtype=torch.float32, device=dev)), IA,
             'out must have dtype'),
        Case('combine_out_wrong_shape', lambda c: c.combine(out=torch.empty((n + 1, H), **bf16)), IA,
             'out must have shape'),
        Case('combine_out_non_contiguous', lambda c: c.combine(out=torch.empty((H, n), **bf16).t()), IA,
             'out must be contiguous'),
        # out given with the dispatch's handle and topk_idx (vLLM's call): the other tensors are still checked.
        Case('combine_out_on_another_device', lambda c: c.combine(
            out=torch.empty((n, H), dtype=torch.bfloat16, device=other)), IA, 'out is on|has no data'),
        Case('combine_out_given_x_on_another_device', lambda c: c.combine(
            x=torch.zeros((E_LOC, R * T, H), dtype=torch.bfloat16, device=other), out=torch.empty((n, H), **bf16)),
             IA, 'x is on|has no data'),
        Case('combine_out_given_weights_float64', lambda c: c.combine(w=c.w.double(), out=torch.empty((n, H), **bf16)),
             IA, 'topk_weights must have dtype'),
        Case('combine_out_given_wait_stats_int32', lambda c: c.combine(
            out=torch.empty((n, H), **bf16), combine_wait_recv_cost_stats=torch.zeros(R, **i32)), IA,
             'combine_wait_recv_cost_stats must have dtype'),
        Case('combine_wait_stats_wrong_shape', lambda c: c.combine(
            combine_wait_recv_cost_stats=torch.zeros(R + 1, **i64)), IA, 'combine_wait_recv_cost_stats must have shape'),
        Case('combine_logfmt_and_zero_copy', lambda c: c.combine(use_logfmt=True, zero_copy=True), IA,
             'cannot be combined'),
        Case('combine_async_and_hook', lambda c: c.combine(async_finish=True, return_recv_hook=True), IA,
             'mutually exclusive'),
        Case('combine_unknown_keyword', lambda c: c.combine(no_such_argument=1), TypeError, 'unexpected keyword'),
        # ---- receive hooks and operations in flight
        Case('combine_before_its_dispatch_was_received', _combine_unreceived, FP, 'not received yet',
             lambda c: c.run_pending()),
        Case('hook_run_twice', _hook_twice, FP, 'already ran'),
        Case('three_dispatches_in_flight', _three_in_flight, FP, 'would overwrite|in flight|still held',
             _after_three_in_flight),
        Case('next_combine_buffer_bad_handle', lambda c: c.buf.get_next_low_latency_combine_buffer((1, 2)), IA,
             'handle must be the 5-tuple'),
        # ---- masks and metrics
        Case('mask_without_shrink', lambda c: c.buf.low_latency_update_mask_buffer(0, True), FP, 'enable_shrink'),
        Case('query_mask_without_shrink', lambda c: c.buf.low_latency_query_mask_buffer(torch.zeros(R, **i32)), FP,
             'enable_shrink'),
        Case('exporter_zero_interval', lambda c: c.buf.start_metrics_exporter(interval_s=0), ValueError, 'interval_s'),
        Case('exporter_port_out_of_range', lambda c: c.buf.start_metrics_exporter(port=70000), IA, 'outside'),
        Case('exporter_started_twice', _exporter_twice, FP, 'already running',
             lambda c: c.buf.stop_metrics_exporter()),
    ]


def _after_destroy_cases(c: Ctx) -> List[Case]:
    handle = (torch.zeros((E_LOC, R * T), dtype=torch.int32, device=c.dev),
              torch.zeros((E_LOC, R), dtype=torch.int64, device=c.dev), T, H, E)
    y = torch.zeros((E_LOC, R * T, H), dtype=torch.bfloat16, device=c.dev)
    return [
        Case('dispatch_after_destroy', lambda c: c.dispatch(), FP, 'destroy'),
        Case('combine_after_destroy', lambda c: c.buf.low_latency_combine(y, c.topk, c.w, handle), FP, 'destroy'),
        Case('clean_after_destroy', lambda c: c.buf.clean_low_latency_buffer(T, H, E), FP, 'destroy'),
        Case('snapshot_after_destroy', lambda c: c.buf.metrics_snapshot(), FP, 'destroy'),
        Case('exporter_after_destroy', lambda c: c.buf.start_metrics_exporter(), FP, 'destroy'),
        Case('mask_after_destroy', lambda c: c.buf.low_latency_clean_mask_buffer(), FP, 'destroy'),
        Case('combine_buffer_after_destroy', lambda c: c.buf.get_next_low_latency_combine_buffer(handle), FP,
             'destroy'),
    ]


def _exact_round(c: Ctx, seed: int) -> None:
    """Dispatch + combine on the buffer, compared for equality with what the routing of every rank implies."""
    x, topk, w = _inputs(c.rank, seed, c.dev)
    hook_mode = seed % 2 == 0
    recv, count, handle, _, hook = c.buf.low_latency_dispatch(x, topk, T, E, use_fp8=False, layer=seed % 4,
                                                              return_recv_hook=hook_mode)
    if hook_mode:
        hook()
    out, _, chook = c.buf.low_latency_combine(recv, topk, w, handle, return_recv_hook=hook_mode)
    if hook_mode:
        chook()
    c.settle()
    src_info, layout_range, recv, count = handle[0].cpu(), handle[1].cpu(), recv.cpu(), count.cpu()
    for le in range(E_LOC):
        g, total = c.rank * E_LOC + le, 0
        for src in range(R):
            sx, stopk, _ = _inputs(src, seed, torch.device('cpu'))
            want = (stopk == g).any(dim=1).nonzero().flatten()
            cnt, begin = int(layout_range[le, src] & 0xFFFFFFFF), int(layout_range[le, src] >> 32)
            assert cnt == want.numel() and begin == total, f'expert {g} from rank {src}: block ({begin}, {cnt})'
            assert torch.equal(src_info[le, begin:begin + cnt].long(), want), f'expert {g} src_info from rank {src}'
            assert torch.equal(recv[le, begin:begin + cnt], sx[want]), f'expert {g}: rows from rank {src}'
            total += cnt
        assert int(count[le]) == total, f'recv_count[{le}] = {int(count[le])}, expected {total}'
    xc, tc, wc = x.cpu().float(), topk.cpu(), w.cpu()
    want_out = (xc * (wc * (tc >= 0)).sum(dim=1, keepdim=True)).to(torch.bfloat16)
    assert torch.equal(out.cpu(), want_out), 'combine output differs'


def _run_case(c: Ctx, case: Case) -> Optional[str]:
    """None when the case raised its error with a matching message; else what went wrong."""
    try:
        case.call(c)
        problem = 'no error raised'
    except case.error as e:
        problem = None if re.search(case.pattern, str(e)) else f'{type(e).__name__} without /{case.pattern}/: {e}'
    except Exception as e:  # noqa: BLE001 - the wrong type is the finding
        problem = f'{type(e).__name__} instead of {case.error.__name__}: {str(e)[:300]}'
    if case.cleanup is not None:
        case.cleanup(c)
    return problem


def _worker(rank: int, port: int, device: str, rows: str) -> None:
    os.environ.setdefault('LLEP_TIMEOUT_S', '20')
    if device == 'cuda':
        torch.cuda.set_device(rank % torch.cuda.device_count())  # ranks may share one GPU (protocol test)
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=R,
                            timeout=datetime.timedelta(seconds=60))
    dev = torch.device('cuda', torch.cuda.current_device()) if device == 'cuda' else torch.device('cpu')
    buf = llep.Buffer(dist.group.WORLD, low_latency_mode=True, explicitly_destroy=True,
                      num_rdma_bytes=llep.Buffer.get_low_latency_rdma_size_hint(2 * T, H, R, E))
    buf.backend = device
    c = Ctx(buf, dist.group.WORLD, rank, dev)
    _exact_round(c, 1)
    failures, seed, t0 = [], 2, time.time()
    cases = [case for case in _cases(c) if re.search(rows, case.name)]
    for case in cases:
        problem = _run_case(c, case)
        try:
            _exact_round(c, seed)  # the buffer must still be right after the bad call
        except Exception as e:  # noqa: BLE001
            problem = (problem + '; ' if problem else '') + f'the next exact round failed: {type(e).__name__}: {e}'
        seed += 1
        if problem:
            failures.append(f'{case.name}: {problem}')
        dist.barrier()
    buf.destroy()
    after = _after_destroy_cases(c)
    for case in after:
        problem = _run_case(c, case)
        if problem:
            failures.append(f'{case.name}: {problem}')
    total = len(cases) + len(after)
    if failures:  # every rank says what failed: mp.spawn re-raises only the first rank's exception
        print(f'rank {rank} failures:\n  ' + '\n  '.join(failures), flush=True)
    if rank == 0:
        print(f'test_bad_inputs ({device}): {total} kinds of bad input, {len(cases)} each followed by an exact round, '
              f'{time.time() - t0:.1f} s')
    assert not failures, f'rank {rank}: {len(failures)} of {total} rows failed:\n  ' + '\n  '.join(failures)
    dist.destroy_process_group()


def _run(device: str, rows: str = '') -> None:
    mp.spawn(_worker, args=(free_port(), device, rows), nprocs=R, join=True)


def test_bad_input_catalogue_on_the_cpu_backend():
    _run('cpu')


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument('--device', choices=('cpu', 'cuda'), default='cpu')
    ap.add_argument('--rows', default='', help='a regular expression: run only the rows whose names match')
    a = ap.parse_args()
    try:
        _run(a.device, a.rows)
    except Exception as e:  # noqa: BLE001 - mp.spawn re-raises a rank's failure
        print(f'test_bad_inputs ({a.device}): FAIL\n{e}')
        return 1
    print(f'test_bad_inputs ({a.device}): PASS')
    return 0


if __name__ == '__main__':
    sys.exit(main())
