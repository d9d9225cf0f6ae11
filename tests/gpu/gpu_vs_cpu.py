#!/usr/bin/env python3
"""GPU backend vs CPU backend through llep.Buffer: the correctness matrix of issue #3.

Every rank builds two Buffers on one gloo group, one on the NVLink kernels ('cuda') and one on the CPU backend
('cpu', the oracle the CPU e2e tests pin bit for bit to the definitions), feeds both the same inputs and compares:
  dispatch  recv_x bytes (FP8 codes or BF16) and scales in every valid row, recv_count, layout_range, src_info,
            cumulative_local_expert_recv_stats — exact;
  combine   out — exact (both backends accumulate with fma in fp32 in top-k order; the issue allows 1e-5
            relative, we require equal bits and report the largest difference if not).
Matrix: num_tokens {1, 3, 64, 128, 256}, hidden {2048, 4096, 7168}, experts {64, 256, 288}, 2 and 4 ranks,
random and hot-expert routing with -1 holes, FP8 / round_scale / UE8M0 / BF16, hooks on/off, LogFMT, zero-copy,
async_finish; each case runs many GPU iterations over both buffer halves against CPU references of a few
distinct inputs, and one case per rank count switches mode and hooks every call on one buffer (128 tokens). The
`_reduce` cases pass combine_weights at dispatch: the combine reduced at the expert side (kernels/EXPERT_SIDE_COMBINE.md),
bit for bit against the CPU backend's order. Then the carried combine plans (combines after three dispatches; copied
and keyless handles), a buffer whose calls change their token count so that the hooks' receive grids (fewer CTAs at
small T) follow each other in every order, the expert-side combine with uneven and empty batches, and the profiler's
view of hook launches (one kernel name per operation, as DeepEP's bench_kineto checks), then error cases: a bad
expert id is reported and the buffer stays usable; an expert-side combine with other weights than its dispatch
carried, or whose dispatch's plan a later dispatch replaced, is reported and the buffer stays usable; a rank that
never calls makes its peers' kernels time out and report LlepTimeoutError instead of hanging.

Inter-node path (issue #4): --ranks-per-node N splits the ranks into virtual nodes of N (LLEP_RANKS_PER_NODE), so
traffic between nodes goes GPU -> FIFO -> CPU proxy -> libfabric (shm by default, LLEP_FABRIC_PROVIDER) -> peer's
proxy -> GPU, and NVLink peers and proxy peers mix in one launch; every case then also checks each rank's peer paths
and that the proxy carried commands, so the matrix cannot silently pass over NVLink alone.

Runs without pytest (scripts/gpu_test.sh calls it); ranks share GPUs round-robin when fewer GPUs than ranks.
Writes one JSON line per (case, rank) to --results and prints a summary; exit code 0 only if all passed.
"""
import argparse
import datetime
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import llep
from llep.utils import free_port


# Mode 'mixed': one buffer, every iteration another dispatch mode, the first cycle without hooks and the next with them
# (modes and hooks switch per call, as DeepEP allows; a receive must never take an earlier call's bytes of another mode
# for its own: bench/RESULTS.md session 27).
MIXED_MODES = ('bf16', 'fp8', 'fp8_round', 'ue8m0')


def _iteration_mode(mode, hook, it):
    """(dispatch mode, hook) of GPU iteration `it` of a case."""
    if mode != 'mixed':
        return mode, hook
    return MIXED_MODES[it % len(MIXED_MODES)], (it // len(MIXED_MODES)) % 2 == 1


# (name, R, num_tokens, T, H, E, K, mode, routing, hook, zero_copy, logfmt, gpu_iters, reduce)
def _cases(quick, ranks=(4, 2)):
    cases = []
    modes = ['fp8', 'bf16', 'fp8_round', 'ue8m0']
    i = 0
    for R in [4, 2] + [r for r in ranks if r not in (4, 2)]:  # 4 and 2 first: their case names stay as they were
        # top-8 (the decode shape) and two wider top-k (the kernels' K > 8 code paths).
        for (n, H, E, K) in ((1, 7168, 256, 8), (3, 2048, 64, 8), (64, 4096, 288, 8), (128, 7168, 256, 8),
                             (256, 7168, 256, 8), (128, 2048, 288, 8), (64, 7168, 64, 8), (64, 2048, 64, 12),
                             (32, 4096, 288, 16)):
            if E % R:
                continue  # experts split evenly over ranks (E = 288 serves R = 9)
            T = max(n, 4)
            for routing in ('random', 'hot'):
                mode = modes[i % len(modes)]
                hook = i % 2 == 1
                zero_copy = i % 3 == 2
                logfmt = (i % 5 == 4) and not zero_copy
                iters = 8 if n >= 128 else 20
                cases.append((f'R{R}_n{n}_H{H}_E{E}_K{K}_{mode}_{routing}' + ('_hook' if hook else '') +
                              ('_zc' if zero_copy else '') + ('_logfmt' if logfmt else ''),
                              R, n, T, H, E, K, mode, routing, hook, zero_copy, logfmt, iters, False))
                i += 1
        # Modes and hooks switching per call on one buffer at 128 tokens (after the cycled cases: their names keep).
        cases.append((f'R{R}_n128_H7168_E256_K8_mixed_modes_random', R, 128, 128, 7168, 256, 8, 'mixed', 'random',
                      False, False, False, 2 * len(MIXED_MODES), False))
        # The expert-side combine (combine_weights at dispatch): small and large T, top-k above 8, hooks, zero-copy.
        for (n, H, E, K, mode, routing, hook, zero_copy) in (
                (1, 7168, 256, 8, 'fp8', 'random', True, False), (3, 2048, 64, 8, 'bf16', 'hot', False, True),
                (128, 7168, 256, 8, 'fp8', 'random', False, False), (64, 2048, 64, 12, 'ue8m0', 'random', True, False),
                (256, 7168, 256, 8, 'bf16', 'hot', True, True)):
            if E % R == 0:
                cases.append((f'R{R}_n{n}_H{H}_E{E}_K{K}_{mode}_{routing}' + ('_hook' if hook else '') +
                              ('_zc' if zero_copy else '') + '_reduce', R, n, max(n, 4), H, E, K, mode, routing, hook,
                              zero_copy, False, 8 if n >= 128 else 20, True))
    if quick:
        cases = _covering_subset(cases)
    return cases


def _covering_subset(cases):
    """--quick: the first cases that together still cover, per rank count, every dispatch mode, hooks on and off,
    zero-copy, LogFMT, both routings, a top-k above 8 and 128 or more tokens (where the kernels deal several work
    items to a CTA or a warp). The first such cases, not a plain stride: a stride repeated the same mode (the modes
    cycle with the case index)."""
    chosen, seen = [], set()
    for c in cases:
        R, n, K, mode, routing, hook, zero_copy, logfmt = c[1], c[2], c[6], c[7], c[8], c[9], c[10], c[11]
        feats = {(R, c[13], 'mode', mode), (R, c[13], 'hook', hook), (R, c[13], 'zero_copy', zero_copy),
                 (R, 'logfmt', logfmt), (R, 'routing', routing), (R, c[13], 'wide_k', K > 8),
                 (R, c[13], 'many_tokens', n >= 128)}
        if feats - seen:
            chosen.append(c)
            seen |= feats
    return chosen


def _inputs(rank, seed, n, H, E, K, routing):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = (torch.randn((n, H), generator=g) * 3).to(torch.bfloat16)
    x[:, :128] *= 1000  # wide dynamic range across groups
    if n > 1:
        x[n // 2, 128:256] = 0  # an all-zero group: the amax floor
    scores = torch.rand((n, E), generator=g)
    if routing == 'hot':
        scores[:, :4] += 2.0  # every token picks experts 0..3: one rank receives 4 rows of every token
    topk = torch.topk(scores, K, dim=-1).indices.to(torch.int64)
    holes = torch.rand((n, K), generator=g) < 0.1
    topk[holes] = -1
    w = torch.rand((n, K), generator=g) + 0.05
    return x, topk, w


def _expert_out(rank, seed, E_loc, rows, H):
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    return torch.randn((E_loc, rows, H), generator=g).to(torch.bfloat16)


def _run(buf, x, topk, w, y, T, E, mode, hook, zero_copy, logfmt, stats, wait_d, wait_c, reduce=False):
    use_fp8 = mode != 'bf16'
    round_scale = mode in ('fp8_round', 'ue8m0')
    use_ue8m0 = mode == 'ue8m0'
    recv, count, handle, event, h = buf.low_latency_dispatch(
        x, topk, T, E, cumulative_local_expert_recv_stats=stats, dispatch_wait_recv_cost_stats=wait_d,
        use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, async_finish=not hook,
        return_recv_hook=hook, combine_weights=w if reduce else None)
    if hook:
        h()
    else:
        event.current_stream_wait()
    if zero_copy:
        buf.get_next_low_latency_combine_buffer(handle)[:] = y
    # With hooks the caller passes out (vLLM does): the combine writes there; without, the output comes from the
    # pool (SGLang passes none).
    given = torch.full((x.size(0), x.size(1)), float('nan'), dtype=torch.bfloat16, device=x.device) if hook else None
    out, cevent, ch = buf.low_latency_combine(y, topk, w, handle, use_logfmt=logfmt, zero_copy=zero_copy,
                                              async_finish=not hook, return_recv_hook=hook,
                                              combine_wait_recv_cost_stats=wait_c, out=given)
    assert given is None or out is given
    if hook:
        ch()
    else:
        cevent.current_stream_wait()
    recv_x, scales = recv if use_fp8 else (recv, None)
    return recv_x, scales, count, handle, out


def _compare(ref, got, E_loc):
    """Returns a list of mismatch descriptions (empty = equal)."""
    errs = []
    r_x, r_s, r_cnt, r_h, r_out = ref
    g_x, g_s, g_cnt, g_h, g_out = got
    g_x, g_cnt, g_out = g_x.cpu(), g_cnt.cpu(), g_out.cpu()
    g_s = g_s.cpu() if g_s is not None else None
    g_h = (g_h[0].cpu(), g_h[1].cpu())
    if not torch.equal(r_cnt, g_cnt):
        errs.append(f'recv_count {r_cnt.tolist()} != {g_cnt.tolist()}')
        return errs
    if not torch.equal(r_h[1], g_h[1]):
        errs.append('layout_range differs')
    for le in range(E_loc):
        n = int(r_cnt[le])
        if n == 0:
            continue
        if not torch.equal(r_h[0][le, :n], g_h[0][le, :n]):
            errs.append(f'src_info differs for local expert {le}')
        a, b = r_x[le, :n].view(torch.uint8), g_x[le, :n].view(torch.uint8)
        if not torch.equal(a, b):
            bad = (a != b).nonzero()
            errs.append(f'recv_x differs for local expert {le}: {bad.size(0)} bytes, first at {bad[0].tolist()}')
        if r_s is not None:
            sa, sb = r_s[le, :n].contiguous().view(torch.uint8), g_s[le, :n].contiguous().view(torch.uint8)
            if not torch.equal(sa, sb):
                errs.append(f'scales differ for local expert {le}')
        if len(errs) > 6:
            break
    if not torch.equal(r_out.view(torch.int16), g_out.view(torch.int16)):
        diff = (r_out.float() - g_out.float()).abs()
        rel = (diff / r_out.float().abs().clamp_min(1e-6)).max().item()
        errs.append(f'combine out differs: max abs {diff.max().item():.3g}, max rel {rel:.3g}')
    return errs


def _expected_paths(rank, R, ranks_per_node):
    if ranks_per_node <= 0:
        return ['self' if p == rank else 'nvlink' for p in range(R)]
    return ['self' if p == rank else 'nvlink' if p // ranks_per_node == rank // ranks_per_node else 'proxy'
            for p in range(R)]


def _check_paths(buf, rank, R, ranks_per_node, ops):
    """The topology the buffer chose, and that its proxy carried traffic exactly when some peer is remote."""
    errs = []
    paths = buf.runtime.peer_paths()
    want = _expected_paths(rank, R, ranks_per_node)
    if paths != want:
        errs.append(f'peer paths {paths} != {want}')
    st = buf.runtime.proxy_stats()
    if 'proxy' in want:
        # Per step and proxy peer at least: dispatch route block + signal, combine signal (sent and received).
        n_proxy = want.count('proxy')
        if st['commands'] < 3 * ops * n_proxy or st['immediates'] < 3 * ops * n_proxy or not st['transport']:
            errs.append(f'proxy carried too little for {ops} dispatches + combines: {st}')
    elif st['commands'] != 0 or st['transport']:
        errs.append(f'no proxy peers, but proxy stats {st}')
    return errs


def _buffer_pair(gloo):
    """(gpu, cpu): a Buffer on the NVLink kernels and one on the CPU backend (the oracle), on one gloo group."""
    gpu = llep.Buffer(gloo, low_latency_mode=True, explicitly_destroy=True)
    gpu.backend = 'cuda'
    cpu = llep.Buffer(gloo, low_latency_mode=True, explicitly_destroy=True)
    cpu.backend = 'cpu'
    return gpu, cpu


def _case(rank, case, gloo, log):
    name, R, n, T, H, E, K, mode, routing, hook, zero_copy, logfmt, iters, reduce = case
    E_loc, rows = E // R, R * T
    gpu, cpu = _buffer_pair(gloo)
    dev = torch.device('cuda', torch.cuda.current_device())
    errs = []
    refs = []
    cpu_stats = torch.zeros(E_loc, dtype=torch.int32)
    seeds = (1, 2, 3)
    modes = MIXED_MODES if mode == 'mixed' else (mode,)
    for seed in seeds:  # CPU references for three distinct inputs, in each mode the case uses
        x, topk, w = _inputs(rank, seed, n, H, E, K, routing)
        y = _expert_out(rank, seed, E_loc, rows, H)
        refs.append((x, topk, w, y, {m: _run(cpu, x, topk, w, y, T, E, m, False, False, False, cpu_stats, None, None,
                                             reduce) for m in modes}))
    gpu_stats = torch.zeros(E_loc, dtype=torch.int32, device=dev)
    wait_d = torch.zeros(R, dtype=torch.int64, device=dev)
    wait_c = torch.zeros(R, dtype=torch.int64, device=dev)
    t0 = time.time()
    expected_stats = torch.zeros(E_loc, dtype=torch.int32)
    expected_sent = torch.zeros(R, dtype=torch.int64)
    for it in range(iters):
        x, topk, w, y, by_mode = refs[it % len(refs)]
        it_mode, it_hook = _iteration_mode(mode, hook, it)
        ref = by_mode[it_mode]
        got = _run(gpu, x.to(dev), topk.to(dev), w.to(dev), y.to(dev), T, E, it_mode, it_hook, zero_copy, logfmt,
                   gpu_stats, wait_d, wait_c, reduce)
        torch.cuda.synchronize()
        gpu.check_errors()
        expected_stats += ref[2]
        ids = topk[topk >= 0]
        expected_sent += torch.bincount(ids // E_loc, minlength=R)
        e = _compare(ref, got, E_loc)
        if e:
            errs.extend(f'iter {it}: {m}' for m in e)
            break
    if not errs and not torch.equal(gpu_stats.cpu(), expected_stats):
        errs.append('cumulative_local_expert_recv_stats differs')
    if not errs and (int(wait_d.min()) < 0 or int(wait_c.min()) < 0):
        errs.append('negative wait stats')
    if not errs:
        errs.extend(_check_metrics(gpu, iters, expected_stats, expected_sent))
    if not errs:
        errs.extend(_check_paths(gpu, rank, R, int(os.environ.get('LLEP_RANKS_PER_NODE', '0')), iters))
    gpu.destroy()
    cpu.destroy()
    log({'case': name, 'rank': rank, 'ok': not errs, 'errors': errs[:8], 'gpu_iters': iters,
         'seconds': round(time.time() - t0, 2)})


def _check_metrics(buf, ops, expected_recv, expected_sent):
    """The kernels' own counters (metrics_layout.h) after `ops` dispatches and combines: exact token counts, one
    latency entry per operation and phase, plausible latencies (send and wait within total)."""
    errs = []
    snap = buf.metrics_snapshot()
    if not torch.equal(snap['expert_recv_tokens'], expected_recv.to(torch.int64)):
        errs.append(f'metrics expert_recv_tokens {snap["expert_recv_tokens"].tolist()} != '
                    f'{expected_recv.tolist()}')
    if not torch.equal(snap['dispatch_selections'], expected_sent):
        errs.append(f'metrics dispatch_selections {snap["dispatch_selections"].tolist()} != {expected_sent.tolist()}')
    if snap['ops'] != {'dispatch': ops, 'combine': ops} or snap['timeouts'] != {'dispatch': 0, 'combine': 0}:
        errs.append(f'metrics ops {snap["ops"]} timeouts {snap["timeouts"]}, expected {ops} ops each')
    for op, phases in snap['latency'].items():
        counts = {ph: h['count'] for ph, h in phases.items()}
        if any(c != ops for c in counts.values()):
            errs.append(f'metrics {op} histogram counts {counts} != {ops}')
        total = phases['total']['sum_s']
        if not (0 < phases['send']['sum_s'] <= total and 0 <= phases['recv_wait']['sum_s'] <= total and
                total < ops * 1.0):
            errs.append(f'metrics {op} latency sums implausible: { {ph: h["sum_s"] for ph, h in phases.items()} }')
    return errs


def _carried_plan_cases(rank, R, gloo, log):
    """A combine takes its rows' positions from its dispatch's plan kept on the device (CarriedPlanArea,
    kernels/cuda/ll_kernels.h), named by the plan key the handle carries, and counts them when that plan is gone or
    the handle has no key. Against the CPU backend, bit for bit:
      1. three dispatches of different routings, then their three combines: the first dispatch's plan was replaced
         by the third's (same half), so its combine counts; the other two find their own plans;
      2. a copied handle (tensors cloned: other addresses, the key kept) and a handle rebuilt with a plain int
         (no key: counts)."""
    n, H, E, K = 64, 2048, 16 * R, 8
    E_loc, rows = E // R, R * n
    dev = torch.device('cuda', torch.cuda.current_device())
    gpu, cpu = _buffer_pair(gloo)

    def staged(seed, topk=None):
        x, t, w = _inputs(rank, seed, n, H, E, K, 'random')
        t = t if topk is None else topk
        y = _expert_out(rank, seed, E_loc, rows, H)
        ref = _run(cpu, x, t, w, y, n, E, 'bf16', False, False, False, None, None, None)
        return [a.to(dev) for a in (x, t, w, y)], ref

    def dispatch(inputs):
        recv, count, handle, _, _ = gpu.low_latency_dispatch(inputs[0], inputs[1], n, E, use_fp8=False)
        return recv, count, handle

    def combine_and_compare(what, inputs, sent, ref):
        _, t, w, y = inputs
        recv, count, handle = sent
        out, _, _ = gpu.low_latency_combine(y, t, w, handle)
        torch.cuda.synchronize()
        gpu.check_errors()
        return [f'{what}: {m}' for m in _compare(ref, (recv, None, count, handle, out), E_loc)]

    errs = []
    cases = [staged(seed) for seed in (11, 12, 13)]
    sent = [dispatch(inputs) for inputs, _ in cases]
    for i, ((inputs, ref), s) in enumerate(zip(cases, sent)):
        errs.extend(combine_and_compare(f'combine {i} of three', inputs, s, ref))
    log({'case': 'carried_plan_three_dispatches_then_combines', 'rank': rank, 'ok': not errs, 'errors': errs[:8]})

    errs = []
    inputs, ref = staged(21)
    recv, count, handle = dispatch(inputs)
    if not getattr(handle[2], 'plan_key', 0) or handle[2] != n:
        errs.append(f'handle[2] is {handle[2]!r} with plan key {getattr(handle[2], "plan_key", None)}')
    copied = (handle[0].clone(), handle[1].clone(), handle[2], handle[3], handle[4])
    errs.extend(combine_and_compare('a copied handle', inputs, (recv, count, copied), ref))
    plain = (handle[0], handle[1], int(handle[2]), handle[3], handle[4])
    errs.extend(combine_and_compare('a handle without its plan key', inputs, (recv, count, plain), ref))
    log({'case': 'carried_plan_copied_and_keyless_handles', 'rank': rank, 'ok': not errs, 'errors': errs[:8]})
    gpu.destroy()
    cpu.destroy()


def _call_both(gpu, cpu, rank, R, seed, n, T, H, E, K, mode, routing, hook, dev):
    """One dispatch + combine of the same inputs (n tokens, T the buffers' maximum) on the GPU buffer (hooks as
    asked) and on the CPU oracle; the differences (_compare), after the GPU's errors were checked."""
    E_loc = E // R
    x, topk, w = _inputs(rank, seed, n, H, E, K, routing)
    y = _expert_out(rank, seed, E_loc, R * T, H)
    ref = _run(cpu, x, topk, w, y, T, E, mode, False, False, False, None, None, None)
    got = _run(gpu, x.to(dev), topk.to(dev), w.to(dev), y.to(dev), T, E, mode, hook, False, False, None, None, None)
    torch.cuda.synchronize()
    gpu.check_errors()
    return _compare(ref, got, E_loc)


def _split_at_the_grid_boundary(rank, R, gloo, log):
    """The dispatch send splits each token by destination when T * P <= CTAs (P = R rounded up to a power of two;
    kernels/cuda/ll_dispatch_send.cuh): with exactly T * P CTAs, CTA b carries token b / P's copy to rank b % P (none
    where b % P >= R) and the last CTAs also count a destination's routes; with one CTA fewer no token is split. Grids
    set by LLEP_NUM_CTAS, FP8 and BF16, hooks off and on, against the CPU backend bit for bit."""
    n, H, E, K = 8, 2048, 16 * R, 8
    P = 1 << (R - 1).bit_length()
    dev = torch.device('cuda', torch.cuda.current_device())
    cpu = llep.Buffer(gloo, low_latency_mode=True, explicitly_destroy=True)
    cpu.backend = 'cpu'
    errs = []
    before = os.environ.get('LLEP_NUM_CTAS')
    for ctas, what in ((n * P, 'split, the last CTAs also counting'), (n * P - 1, 'one CTA fewer: not split')):
        os.environ['LLEP_NUM_CTAS'] = str(ctas)
        try:
            gpu = llep.Buffer(gloo, low_latency_mode=True, explicitly_destroy=True)
        finally:
            if before is None:
                del os.environ['LLEP_NUM_CTAS']
            else:
                os.environ['LLEP_NUM_CTAS'] = before
        gpu.backend = 'cuda'
        for it, (mode, hook) in enumerate((('fp8', False), ('bf16', True), ('fp8', True))):
            diffs = _call_both(gpu, cpu, rank, R, 30 + it, n, n, H, E, K, mode, 'hot' if it == 1 else 'random', hook,
                               dev)
            if gpu.runtime.num_ctas != ctas:
                errs.append(f'the buffer runs {gpu.runtime.num_ctas} CTAs, {ctas} asked')
            errs.extend(f'{ctas} CTAs ({what}), {mode}{" hook" if hook else ""}: {m}' for m in diffs)
        gpu.destroy()
    cpu.destroy()
    log({'case': 'dispatch_split_at_the_grid_boundary', 'rank': rank, 'ok': not errs, 'errors': errs[:8]})


def _receive_grids_vary(rank, R, gloo, log):
    """A hook's receive launches its own grid, fewer CTAs at small T (kernels/cuda/ll_kernels.h ReceiveOnlyCtas), and
    every CTA of it also counts the launch for the CTAs it stands for (TakeReceiveCall): one buffer whose calls change
    their token count, so the receive grids follow each other in every order (a quarter, half and all of the CTAs,
    the combine's own), between fused launches, FP8 and BF16, against the CPU backend bit for bit. A count left
    behind in a CTA the smaller grid did not run would pair a later receive with the wrong call."""
    T, H, E, K = 128, 7168, 16 * R, 8
    dev = torch.device('cuda', torch.cuda.current_device())
    gpu, cpu = _buffer_pair(gloo)
    errs = []
    calls = ((1, True), (128, True), (8, True), (1, False), (40, True), (1, True), (3, True), (128, False), (2, True),
             (32, True), (1, True))
    for it, (n, hook) in enumerate(calls):
        mode = 'fp8' if it % 2 == 0 else 'bf16'
        diffs = _call_both(gpu, cpu, rank, R, 90 + it, n, T, H, E, K, mode, 'hot' if it % 3 == 1 else 'random', hook,
                           dev)
        errs.extend(f'call {it} ({n} tokens, {mode}{" hook" if hook else ""}): {m}' for m in diffs)
        if errs:
            break
    gpu.destroy()
    cpu.destroy()
    log({'case': 'receive_grids_vary_between_calls', 'rank': rank, 'ok': not errs, 'errors': errs[:8]})


def _expert_side_uneven_batches(rank, R, gloo, log, backend='cuda'):
    """combine_weights with a rank that has no tokens (an empty micro-batch: its weights tensor's data_ptr() is 0, and
    it must still say it carries weights, or its peers' messages disagree with it) and ranks of different sizes,
    hooks and not, against the CPU backend bit for bit."""
    T, H, E, K = 8, 2048, 16 * R, 8
    E_loc, rows = E // R, R * T
    dev = torch.device('cuda', torch.cuda.current_device()) if backend == 'cuda' else torch.device('cpu')
    gpu = llep.Buffer(gloo, low_latency_mode=True, explicitly_destroy=True)
    gpu.backend = backend
    cpu = llep.Buffer(gloo, low_latency_mode=True, explicitly_destroy=True)
    cpu.backend = 'cpu'
    errs = []
    for it, hook in enumerate((False, True, False)):
        n = 0 if rank == (1 + it) % R else 1 + (rank + it) % T
        # Cloned: an empty tensor of its own has data_ptr() 0, as an engine's empty micro-batch does.
        x, topk, w = (t[:n].clone() for t in _inputs(rank, 70 + it, max(n, 1), H, E, K, 'random'))
        y = _expert_out(rank, 70 + it, E_loc, rows, H)
        ref = _run(cpu, x, topk, w, y, T, E, 'fp8', False, False, False, None, None, None, True)
        got = _run(gpu, x.to(dev), topk.to(dev), w.to(dev), y.to(dev), T, E, 'fp8', hook, False, False, None, None,
                   None, True)
        if backend == 'cuda':
            torch.cuda.synchronize()
        gpu.check_errors()
        errs.extend(f'call {it} ({n} tokens here): {m}' for m in _compare(ref, got, E_loc))
    gpu.destroy()
    cpu.destroy()
    log({'case': 'expert_side_uneven_and_empty_batches', 'rank': rank, 'ok': not errs, 'errors': errs[:8]})


def _profiler_sees_one_kernel_per_op(rank, R, gloo, log):
    """The kernel-naming contract as a profiler-based benchmark checks it (shared/spec/deepep-ll-api.md section 8.1;
    DeepEP's bench_kineto): with hooks, the profiler's table has exactly one row naming `dispatch` and one naming
    `combine`, and the trace holds a send and a receive launch of each per call, under `::dispatch` / `::combine`.
    The receive-only launches run a second compilation of the kernels (kernels/cuda/ll_kernels_recv.cu) that must keep
    the kernels' names."""
    from torch.profiler import ProfilerActivity, profile
    T, H, E, K, calls = 8, 2048, 16 * R, 8, 3
    dev = torch.device('cuda', torch.cuda.current_device())
    buf = llep.Buffer(gloo, low_latency_mode=True, explicitly_destroy=True)
    buf.backend = 'cuda'
    x, topk, w = (t.to(dev) for t in _inputs(rank, 90, T, H, E, K, 'random'))
    y = _expert_out(rank, 90, E // R, R * T, H).to(dev)
    _run(buf, x, topk, w, y, T, E, 'fp8', True, False, False, None, None, None)  # warm-up, outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            _run(buf, x, topk, w, y, T, E, 'fp8', True, False, False, None, None, None)
        torch.cuda.synchronize()
    buf.check_errors()
    buf.destroy()
    errs = []
    table = prof.key_averages().table(sort_by='cuda_time_total', max_name_column_width=100).split('\n')
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    for word in ('dispatch', 'combine'):
        rows = [ln.strip()[:100] for ln in table if word in ln]
        if len(rows) != 1:
            errs.append(f'{len(rows)} profiler table rows name {word!r} (want 1): {rows}')
        launches = sum(f'::{word}' in n for n in names)
        if launches != 2 * calls:
            errs.append(f'{launches} launches named ::{word} in the trace (want {2 * calls}: a send and a receive '
                        f'per call)')
    log({'case': 'profiler_sees_one_kernel_per_op', 'rank': rank, 'ok': not errs, 'errors': errs[:8]})


def _expect_input_error(buf, words):
    """check_errors must raise LlepInvalidArgumentError containing `words`; returns the mismatch, if any."""
    torch.cuda.synchronize()
    try:
        buf.check_errors()
    except llep.LlepInvalidArgumentError as e:
        return [] if words in str(e) else [f'error without {words!r}: {e}']
    return [f'not reported: {words!r}']


def _error_cases(rank, R, gloo, log):
    """Bad expert id and the expert-side combine's input errors (recoverable), a silent peer (timeout, not a hang)."""
    T, H, E, K = 8, 2048, 16 if 16 % R == 0 else 2 * R, 4
    dev = torch.device('cuda', torch.cuda.current_device())
    buf = llep.Buffer(gloo, low_latency_mode=True, explicitly_destroy=True)
    buf.backend = 'cuda'
    x, topk, w = _inputs(rank, 5, T, H, E, K, 'random')
    x, topk = x.to(dev), topk.to(dev)
    errs = []
    bad = topk.clone()
    bad[0, 0] = E + 5
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, bad, T, E, use_fp8=False)
    torch.cuda.synchronize()
    # The next call must not raise it (ranks would raise at different calls as their kernels finish, and
    # desynchronise): its combine runs, and check_errors raises it afterwards.
    buf.low_latency_combine(recv, bad, w.to(dev), handle)
    torch.cuda.synchronize()
    try:
        buf.check_errors()
        errs.append('bad expert id not reported')
    except llep.LlepInvalidArgumentError as e:
        if str(E + 5) not in str(e):
            errs.append(f'bad expert id message lacks the id: {e}')
    # Still usable: a clean round trip afterwards, and the record was cleared by the check that raised it.
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, topk, T, E, use_fp8=False)
    out, _, _ = buf.low_latency_combine(recv, topk, w.to(dev), handle)
    torch.cuda.synchronize()
    buf.check_errors()
    log({'case': 'bad_expert_id_reported_and_recovered', 'rank': rank, 'ok': not errs, 'errors': errs})

    # The expert-side combine's two input errors (kernels/EXPERT_SIDE_COMBINE.md), reported by check_errors on every
    # rank, each followed by a clean expert-side round trip: other weights than the dispatch carried; a handle whose
    # dispatch's plan a later dispatch into the same half replaced (A, B, C: C takes A's half).
    wd = w.to(dev)
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, topk, T, E, use_fp8=False, combine_weights=wd)
    buf.low_latency_combine(recv, topk, wd * 2, handle)
    errs.extend(_expect_input_error(buf, 'differ from the combine_weights its dispatch carried'))
    sent = [buf.low_latency_dispatch(x, topk, T, E, use_fp8=False, combine_weights=wd) for _ in range(3)]
    buf.low_latency_combine(sent[0][0], topk, wd, sent[0][2])
    errs.extend(_expect_input_error(buf, 'no longer holds the plan'))
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, topk, T, E, use_fp8=False, combine_weights=wd)
    out, _, _ = buf.low_latency_combine(recv, topk, wd, handle)
    torch.cuda.synchronize()
    buf.check_errors()
    log({'case': 'expert_side_combine_input_errors_reported_and_recovered', 'rank': rank, 'ok': not errs,
         'errors': errs})

    # Rank 1 skips a dispatch: everyone else must get LlepTimeoutError within the configured timeout.
    errs = []
    t0 = time.time()
    if rank != 1:
        buf.low_latency_dispatch(x, topk, T, E)
        torch.cuda.synchronize()
        waited = time.time() - t0
        try:
            buf.check_errors()
            errs.append('silent peer not reported')
        except llep.LlepTimeoutError as e:
            if 'rank 1' not in str(e):
                errs.append(f'timeout does not name rank 1: {e}')
        if waited > 30:
            errs.append(f'timeout took {waited:.1f} s')
        try:
            buf.low_latency_dispatch(x, topk, T, E)
            errs.append('buffer still accepted calls after a timeout')
        except llep.LlepError:
            pass
        timeouts = buf.metrics_snapshot()['timeouts']
        if timeouts['dispatch'] < 1:
            errs.append(f'metrics timeouts {timeouts}: the timed-out dispatch was not counted')
    log({'case': 'silent_peer_times_out', 'rank': rank, 'ok': not errs, 'errors': errs,
         'seconds': round(time.time() - t0, 2)})
    buf.destroy()


def _worker(rank, R, port, cases, results_path, ranks_per_node):
    os.environ['LLEP_TIMEOUT_S'] = os.environ.get('LLEP_TIMEOUT_S', '20')
    if ranks_per_node > 0:
        os.environ['LLEP_RANKS_PER_NODE'] = str(ranks_per_node)
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=R,
                            timeout=datetime.timedelta(seconds=180))
    gloo = dist.group.WORLD

    def log(rec):
        with open(results_path, 'a') as f:
            f.write(json.dumps(rec) + '\n')

    for case in cases:
        try:
            _case(rank, case, gloo, log)
        except Exception:  # record and stop: the ranks are out of step now
            log({'case': case[0], 'rank': rank, 'ok': False, 'errors': [traceback.format_exc()[-1500:]]})
            raise
    _carried_plan_cases(rank, R, gloo, log)
    _split_at_the_grid_boundary(rank, R, gloo, log)
    _receive_grids_vary(rank, R, gloo, log)
    _expert_side_uneven_batches(rank, R, gloo, log)
    _profiler_sees_one_kernel_per_op(rank, R, gloo, log)
    os.environ['LLEP_TIMEOUT_S'] = '3'
    _error_cases(rank, R, gloo, log)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--results', default='gpu_vs_cpu.jsonl')
    ap.add_argument('--quick', action='store_true')
    ap.add_argument('--ranks', type=int, nargs='*', default=[4, 2],
                    help='rank counts to run, each with the cases whose experts it divides (e.g. 9: the '
                         'E = 288 cases; more sources per receive than 2 or 4)')
    ap.add_argument('--only', default='', help='run only the cases whose name contains this string')
    ap.add_argument('--ranks-per-node', type=int, default=0,
                    help='virtual nodes of N ranks: inter-node traffic through the CPU proxy (0 = one node)')
    args = ap.parse_args()
    if not torch.cuda.is_available() or not getattr(llep._llep, 'HAVE_CUDA', False):
        print('gpu_vs_cpu: SKIPPED (no CUDA device or llep built without CUDA)')
        return 0
    open(args.results, 'w').close()
    all_cases = [c for c in _cases(args.quick, args.ranks) if args.only in c[0]]
    rc = 0
    for R in args.ranks:
        cases = [c for c in all_cases if c[1] == R]
        try:
            mp.spawn(_worker, args=(R, free_port(), cases, args.results, args.ranks_per_node), nprocs=R, join=True)
        except Exception as e:
            print(f'R={R}: worker failed: {e}', flush=True)
            rc = 1
    recs = [json.loads(l) for l in open(args.results)]
    by_case = {}
    for r in recs:
        by_case.setdefault(r['case'], []).append(r)
    print(f'\n{"case":<58} {"ranks":>5} {"iters":>5} {"result":>6}')
    for name, rs in by_case.items():
        ok = all(r['ok'] for r in rs)
        rc |= 0 if ok else 1
        print(f'{name:<58} {len(rs):>5} {rs[0].get("gpu_iters", "-"):>5} {"PASS" if ok else "FAIL":>6}')
        for r in rs:
            for e in r['errors'][:3]:
                print(f'    rank {r["rank"]}: {e}')
    n_ok = sum(all(r['ok'] for r in rs) for rs in by_case.values())
    print(f'gpu_vs_cpu: {n_ok}/{len(by_case)} cases passed')
    return rc


if __name__ == '__main__':
    sys.exit(main())
