"""llep.Buffer on the CPU backend: 4 processes, gloo group, DeepEP V1 test-style checks (counts, layout ranges,
src_info, values, combine vs sum_k w * x) for BF16, FP8, FP8 round_scale and UE8M0 dispatch, with and without
receive hooks, a hook run from another thread, zero-copy combine, determinism, metrics and argument errors."""
import datetime
import os
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.overrides import TorchFunctionMode

import llep
from llep.engine.moe import e4m3_values
from llep.utils import free_port

T, H, E, K, R = 16, 2048, 16, 4, 4



def _dequant(recv, scales, use_fp8, use_ue8m0):
    """[E_loc, rows, H] float values of a dispatch result (DeepEP's per_token_cast_back)."""
    if not use_fp8:
        return recv.float()
    codes = recv.view(torch.uint8).long() if recv.dtype != torch.uint8 else recv.long()
    vals = e4m3_values(torch.device('cpu'))[codes]
    if use_ue8m0:
        b = scales.contiguous().view(torch.uint8).int()  # [E_loc, rows, H/512 * 4] = one byte per 128 channels
        s = (b << 23).view(torch.float32)
    else:
        s = scales.contiguous()
    return vals * s.repeat_interleave(128, dim=-1)


def _calc_diff(x, y):
    x, y = x.double() + 1, y.double() + 1
    return (1 - 2 * (x * y).sum() / (x * x + y * y).sum()).item()


def _inputs(rank, seed):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    n = T - (seed % 3)  # ranks may send fewer than T tokens
    x = torch.full((n, H), float(rank - 128), dtype=torch.bfloat16)
    x[:, -128:] = torch.arange(n, dtype=torch.float32).view(-1, 1).to(torch.bfloat16)
    scores = torch.rand((n, E), generator=g)
    topk = torch.topk(scores, K, dim=-1).indices.to(torch.int64)
    holes = torch.randint(0, n * K, (3,), generator=g)
    topk.view(-1)[holes] = -1
    w = torch.rand((n, K), generator=g) + 0.1
    return x, topk, w


def _check_round(buf, rank, seed, use_fp8, round_scale, use_ue8m0, hook_mode, threaded_hook, zero_copy):
    E_loc, rows = E // R, R * T
    x, topk, w = _inputs(rank, seed)
    all_topk = [None] * R
    dist.all_gather_object(all_topk, topk)
    stats = torch.zeros(E_loc, dtype=torch.int32)
    wait = torch.zeros(R, dtype=torch.int64)
    recv, count, handle, event, hook = buf.low_latency_dispatch(
        x, topk, T, E, cumulative_local_expert_recv_stats=stats, dispatch_wait_recv_cost_stats=wait, use_fp8=use_fp8,
        round_scale=round_scale, use_ue8m0=use_ue8m0, async_finish=not hook_mode, return_recv_hook=hook_mode,
        layer=seed % 3)
    if hook_mode:
        assert callable(hook) and event.event is None
        if threaded_hook:  # vLLM runs receive hooks on another CPU thread
            t = threading.Thread(target=hook)
            t.start()
            t.join()
        else:
            hook()
        with pytest.raises(llep.LlepFailedPreconditionError):
            hook()
    else:
        assert hook is None
        event.current_stream_wait()
    recv_x, scales = recv if use_fp8 else (recv, None)
    assert recv_x.shape == (E_loc, rows, H)
    if use_fp8:
        assert scales.shape == (E_loc, rows, H // (512 if use_ue8m0 else 128))
        assert scales.stride() == (scales.size(1) * scales.size(2), 1, rows)  # column-major in the last two dims
    src_info, layout_range = handle[0], handle[1]
    assert handle[2:] == (T, H, E)
    deq = _dequant(recv_x, scales, use_fp8, use_ue8m0)
    for i in range(E_loc):
        g = rank * E_loc + i
        expected = sum(int((t == g).sum()) for t in all_topk)
        assert int(count[i]) == expected == int(stats[i])
        assert int((layout_range[i] & 0xFFFFFFFF).sum()) == expected
        for src in range(R):
            cnt, begin = int(layout_range[i, src] & 0xFFFFFFFF), int(layout_range[i, src] >> 32)
            assert cnt == int((all_topk[src] == g).sum())
            block = deq[i, begin:begin + cnt]
            want_tokens = (all_topk[src] == g).any(dim=1).nonzero().flatten()
            assert torch.equal(src_info[i, begin:begin + cnt].long(), want_tokens)  # token order: deterministic
            if cnt == 0:
                continue
            if use_fp8:
                # Power-of-two scales (round_scale) cost real precision: DeepEP's own test allows 0.007 there.
                tol = 7e-3 if round_scale else 1e-5
                assert _calc_diff(block[:, :-128], torch.full_like(block[:, :-128], src - 128.0)) < tol
                assert _calc_diff(block[:, -128:], want_tokens.float().view(-1, 1).expand(-1, 128)) < tol
            else:
                assert torch.all(block[:, :-128] == src - 128)
                assert torch.equal(block[:, -128:], want_tokens.float().view(-1, 1).expand(-1, 128))
    assert int(wait.min()) >= 0

    # Combine: experts return their dequantised inputs; out[t] must be sum_k w[t,k] * deq(x[t]).
    y = deq.to(torch.bfloat16)
    out = torch.full((x.size(0), H), float('nan'), dtype=torch.bfloat16)
    if zero_copy:
        buf.get_next_low_latency_combine_buffer(handle)[:] = y
    combined, cevent, chook = buf.low_latency_combine(y, topk, w, handle, zero_copy=zero_copy,
                                                      async_finish=not hook_mode, return_recv_hook=hook_mode, out=out)
    if hook_mode:
        chook()
    else:
        cevent.current_stream_wait()
    assert combined is out and not torch.isnan(combined.float()).any()
    x_ref = _dequant(x.unsqueeze(0), None, False, False)[0] if not use_fp8 else x.float()
    ref = x_ref * w.masked_fill(topk < 0, 0).sum(dim=1, keepdim=True)
    if not round_scale:
        assert _calc_diff(ref, combined) < (9e-4 if use_fp8 else 1e-5)
    # Bitwise deterministic: the same combine again gives the same bits.
    again, _, h2 = buf.low_latency_combine(y, topk, w, handle, return_recv_hook=True)
    h2()
    assert torch.equal(again.view(torch.int16), combined.view(torch.int16))


def _check_expert_reduced(buf, rank, seed, use_fp8, hook_mode, zero_copy):
    """combine_weights at dispatch (kernels/EXPERT_SIDE_COMBINE.md): the combine reduces each token's rows on the
    experts' ranks and returns one row per (token, rank): out[t] = bf16(sum over the ranks r holding a selection of t,
    ascending, of bf16(sum of w * y over t's selections on r in top-k order)). Checked against that order computed here
    in float64 (BF16 dispatch, whose rows are x itself), against DeepEP's combine of the same rows, for determinism,
    and for the weights check."""
    E_loc = E // R
    x, topk, w = _inputs(rank, seed)
    recv, _, handle, _, hook = buf.low_latency_dispatch(x, topk, T, E, use_fp8=use_fp8, return_recv_hook=hook_mode,
                                                        combine_weights=w)
    if hook_mode:
        hook()
    y = _dequant(*(recv if use_fp8 else (recv, None)), use_fp8, False).to(torch.bfloat16)
    if zero_copy:
        buf.get_next_low_latency_combine_buffer(handle)[:] = y
    out, _, chook = buf.low_latency_combine(y, topk, w, handle, zero_copy=zero_copy, return_recv_hook=hook_mode)
    if hook_mode:
        chook()
    if not use_fp8:
        ref = torch.zeros((x.size(0), H), dtype=torch.float64)
        for t in range(x.size(0)):
            for r in sorted({int(g) // E_loc for g in topk[t] if int(g) >= 0}):
                part = sum(x[t].double() * float(w[t, k]) for k in range(K)
                           if int(topk[t, k]) >= 0 and int(topk[t, k]) // E_loc == r)
                ref[t] += part.to(torch.bfloat16).double()
        # Exact but for the fp32 accumulation and the final rounding: within a bf16 ulp of the float64 order.
        assert torch.allclose(out.double(), ref, rtol=2 ** -7, atol=0), (out.double() - ref).abs().max()
    # Bitwise deterministic (the handle's dispatch is still the last one of its buffer half: kept), and the combine's
    # weights must be the dispatch's, bit for bit.
    again, _, _ = buf.low_latency_combine(y, topk, w, handle)
    assert torch.equal(again.view(torch.int16), out.view(torch.int16))
    with pytest.raises(ValueError, match='differ from the topk_weights its dispatch carried'):
        buf.low_latency_combine(y, topk, w * 2, handle)
    # DeepEP's combine of the same rows (a plain dispatch and combine) differs only by the partials' rounding. That
    # dispatch takes the half of the handle's (two calls later): the handle's plan is gone.
    recv2, _, handle2, _, _ = buf.low_latency_dispatch(x, topk, T, E, use_fp8=use_fp8)
    y2 = _dequant(*(recv2 if use_fp8 else (recv2, None)), use_fp8, False).to(torch.bfloat16)
    plain, _, _ = buf.low_latency_combine(y2, topk, w, handle2)
    assert handle[2].expert_reduced and not handle2[2].expert_reduced
    assert _calc_diff(plain, out) < 1e-5


def _check_metrics(buf, rank, rounds):
    """The counters after `rounds` rounds of _check_round (one dispatch and two combines each) are exact: tokens
    per (layer, local expert) = every source's selections of them in that layer's dispatches (round s is layer
    s % 3), selections per destination = this rank's routing, one histogram entry per operation and phase; the
    exporter serves the same numbers on loopback."""
    import urllib.request
    E_loc = E // R
    want_layer = torch.zeros((3, E_loc), dtype=torch.int64)
    want_sent = torch.zeros(R, dtype=torch.int64)
    for s in range(1, rounds + 1):
        for src in range(R):
            ids = _inputs(src, s)[1]
            ids = ids[ids >= 0]
            mine = ids[ids // E_loc == rank] - rank * E_loc
            want_layer[s % 3] += torch.bincount(mine, minlength=E_loc)
            if src == rank:
                want_sent += torch.bincount(ids // E_loc, minlength=R)
    want_recv = want_layer.sum(dim=0)
    snap = buf.metrics_snapshot()
    per_layer = snap['layer_expert_recv_tokens']
    assert per_layer.shape == (128, E_loc), per_layer.shape  # LLEP_METRICS_LAYERS' default
    assert torch.equal(per_layer[:3], want_layer) and not per_layer[3:].any()
    assert torch.equal(snap['expert_recv_tokens'], want_recv)
    assert torch.equal(snap['dispatch_selections'], want_sent)
    assert snap['ops'] == {'dispatch': rounds, 'combine': 2 * rounds}
    assert snap['timeouts'] == {'dispatch': 0, 'combine': 0}
    for op, n in snap['ops'].items():
        for phase, h in snap['latency'][op].items():
            assert h['count'] == n and len(h['counts']) == len(h['bounds_s']) + 1, (op, phase)
            assert h['sum_s'] > 0, (op, phase)
        wait = snap['recv_wait_s'][op]
        assert wait.shape == (R,) and bool((wait >= 0).all())
    port = buf.start_metrics_exporter(port=0, labels={'model_name': 'cpu-test'})
    assert port > 0 and buf.metrics_port == port
    with pytest.raises(llep.LlepFailedPreconditionError, match='already running'):
        buf.start_metrics_exporter(port=0)
    text = urllib.request.urlopen(f'http://127.0.0.1:{port}/metrics', timeout=10).read().decode()
    assert f'llep_ops_total{{model_name="cpu-test",rank="{rank}",op="dispatch"}} {rounds}' in text
    for layer in range(3):
        for le in range(E_loc):
            g = rank * E_loc + le
            assert (f'llep_expert_recv_tokens_total{{model_name="cpu-test",rank="{rank}",expert="{g}",'
                    f'layer="{layer}",local_expert="{le}"}} {int(want_layer[layer, le])}') in text
    assert 'layer="3"' not in text
    buf.stop_metrics_exporter()
    with pytest.raises(ValueError, match='interval_s'):
        buf.start_metrics_exporter(interval_s=0)


def _worker(rank, port, provider):
    os.environ['LLEP_FABRIC_PROVIDER'] = provider
    os.environ['LLEP_TIMEOUT_S'] = '30'
    # A short gloo timeout: if one rank fails an assertion, the others must not wait 30 minutes in a collective.
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=R,
                            timeout=datetime.timedelta(seconds=60))
    group = dist.group.WORLD
    hint = llep.Buffer.get_low_latency_rdma_size_hint(2 * T, H, R, E)  # sized for the largest T used below
    buf = llep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=E // R,
                      explicitly_destroy=True)
    seed = 0
    for use_fp8, round_scale, use_ue8m0 in ((False, False, False), (True, False, False), (True, True, False),
                                            (True, True, True)):
        for hook_mode in (False, True):
            seed += 1
            _check_round(buf, rank, seed, use_fp8, round_scale, use_ue8m0, hook_mode,
                         threaded_hook=hook_mode and seed % 2 == 0, zero_copy=seed % 3 == 0)

    _check_metrics(buf, rank, seed)

    for i, (use_fp8, hook_mode) in enumerate(((False, False), (True, True), (False, True))):
        _check_expert_reduced(buf, rank, 50 + i, use_fp8, hook_mode, zero_copy=i == 2)
    # A handle whose dispatch's messages a later dispatch into the same buffer half replaced (the second after it): a
    # typed error on every rank, raised before anything is sent.
    x, topk, w = _inputs(rank, 60)
    old = buf.low_latency_dispatch(x, topk, T, E, use_fp8=False, combine_weights=w)
    for _ in range(2):
        buf.low_latency_dispatch(x, topk, T, E, use_fp8=False, combine_weights=w)
    with pytest.raises(llep.LlepFailedPreconditionError, match='no longer kept'):
        buf.low_latency_combine(old[0], topk, w, old[2])
    with pytest.raises(ValueError, match='combine_weights must have shape'):
        buf.low_latency_dispatch(x, topk, T, E, combine_weights=w[:, :-1])

    # Argument errors are raised before anything is sent (all ranks make the same bad call, nobody hangs).
    x, topk, w = _inputs(rank, 99)
    with pytest.raises(llep.LlepInvalidArgumentError, match='dtype'):
        buf.low_latency_dispatch(x.float(), topk, T, E)
    with pytest.raises(ValueError, match='out of range'):
        bad = topk.clone()
        bad[0, 0] = E
        buf.low_latency_dispatch(x, bad, T, E)
    with pytest.raises(ValueError, match=r'layer 128 is outside \[0, 128\)'):
        buf.low_latency_dispatch(x, topk, T, E, layer=128)
    with pytest.raises(ValueError, match='layer -1'):
        buf.low_latency_dispatch(x, topk, T, E, layer=-1)
    with pytest.raises(ValueError, match='num_tokens'):
        big = torch.zeros((T + 1, H), dtype=torch.bfloat16)
        buf.low_latency_dispatch(big, torch.zeros((T + 1, K), dtype=torch.int64), T, E)
    with pytest.raises(ValueError, match='mutually exclusive'):
        buf.low_latency_dispatch(x, topk, T, E, async_finish=True, return_recv_hook=True)
    # Every per-call check is a few attribute reads; a failing one still gets the detailed message.
    with pytest.raises(ValueError, match='topk_idx must have dtype'):
        buf.low_latency_dispatch(x, topk.int(), T, E)
    with pytest.raises(ValueError, match='x must be contiguous'):
        buf.low_latency_dispatch(x.t().contiguous().t(), topk, T, E)
    with pytest.raises(ValueError, match=r'topk_idx must have shape \(%d' % x.size(0)):
        buf.low_latency_dispatch(x, topk[1:], T, E)
    with pytest.raises(ValueError, match='cumulative_local_expert_recv_stats must have shape'):
        buf.low_latency_dispatch(x, topk, T, E, cumulative_local_expert_recv_stats=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match='dispatch_wait_recv_cost_stats must have dtype'):
        buf.low_latency_dispatch(x, topk, T, E, dispatch_wait_recv_cost_stats=torch.zeros(R, dtype=torch.int32))
    (_, _), _, good, _, _ = buf.low_latency_dispatch(x, topk, T, E)
    y = torch.zeros((E // R, R * T, H), dtype=torch.bfloat16)
    good_out = torch.empty((x.size(0), H), dtype=torch.bfloat16)
    for bad_call, message in (
            (lambda: buf.low_latency_combine(y.float(), topk, w, good), 'x must have dtype'),
            (lambda: buf.low_latency_combine(y[:, :-1], topk, w, good), 'x must have shape'),
            (lambda: buf.low_latency_combine(y, topk, w[:, :-1], good), 'topk_weights must have shape'),
            (lambda: buf.low_latency_combine(y, topk, w.double(), good), 'topk_weights must have dtype'),
            (lambda: buf.low_latency_combine(y, topk, w, (good[0][:1],) + good[1:]), r'src_info\) must have shape'),
            (lambda: buf.low_latency_combine(y, topk, w, (good[0], good[1].int()) + good[2:]),
             r'layout_range\) must have dtype'),
            (lambda: buf.low_latency_combine(y, topk, w, good, out=torch.empty((1, H), dtype=torch.bfloat16)),
             'out must have shape'),
            (lambda: buf.low_latency_combine(y, topk, w, good, combine_wait_recv_cost_stats=torch.zeros(R + 1,
                                                                                                          dtype=torch.int64)),
             'combine_wait_recv_cost_stats must have shape'),
            (lambda: buf.low_latency_combine(y, topk, w, list(good)), 'handle must be the 5-tuple'),
            # With out given, the dispatch's handle and topk_idx (vLLM's call): the other tensors are still checked.
            (lambda: buf.low_latency_combine(y.float(), topk, w, good, out=good_out), 'x must have dtype'),
            (lambda: buf.low_latency_combine(y.transpose(1, 2).contiguous().transpose(1, 2), topk, w, good,
                                             out=good_out), 'x must be contiguous'),
            (lambda: buf.low_latency_combine(y[:, :-1], topk, w, good, out=good_out), 'x must have shape'),
            (lambda: buf.low_latency_combine(y.tolist(), topk, w, good, out=good_out), 'x must be a torch.Tensor'),
            (lambda: buf.low_latency_combine(y, topk, w[:, :-1], good, out=good_out), 'topk_weights must have shape'),
            (lambda: buf.low_latency_combine(y, topk, w.double(), good, out=good_out), 'topk_weights must have dtype'),
            (lambda: buf.low_latency_combine(y, topk, w, good, out=good_out.float()), 'out must have dtype'),
            (lambda: buf.low_latency_combine(y, topk, w, good, out=good_out[:1]), 'out must have shape'),
            (lambda: buf.low_latency_combine(y, topk, w, good, out=good_out.to('meta')), 'out is on meta'),
            (lambda: buf.low_latency_combine(y, topk, w, good, out=good_out,
                                             combine_wait_recv_cost_stats=torch.zeros(R, dtype=torch.int32)),
             'combine_wait_recv_cost_stats must have dtype')):
        with pytest.raises(ValueError, match=message):
            bad_call()
    # Nothing above was sent: the buffer still works, also for a caller that set a default device (torch function
    # modes are off inside the calls), and the optional statistics tensors pass their checks when right.
    if hasattr(torch, 'set_default_device'):
        torch.set_default_device('cpu')
    stats = torch.zeros(E // R, dtype=torch.int32)
    try:
        (_, _), count, good, _, _ = buf.low_latency_dispatch(x, topk, T, E, cumulative_local_expert_recv_stats=stats)
        out, _, _ = buf.low_latency_combine(y, topk, w, good, combine_wait_recv_cost_stats=torch.zeros(R,
                                                                                                        dtype=torch.int64))
    finally:
        if hasattr(torch, 'set_default_device'):
            torch.set_default_device(None)
    assert torch.equal(stats, count) and out.shape == (x.size(0), H)
    # Torch-function handling is turned off inside the calls only where an argument would route their tensor calls
    # through Python (_has_torch_function): a tensor subclass with its own __torch_function__ then sees none of them,
    # nor does a torch-function mode on torch >= 2.0 (1.13's DisableTorchFunction leaves modes on); the results are
    # the same either way.
    seen = []

    class _Counting(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    class _Sub(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(func)
            return super().__torch_function__(func, types, args, kwargs)

    y_r = torch.randn(y.shape, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    (_, _), _, handle_r, _, _ = buf.low_latency_dispatch(x, topk, T, E)
    out_r, _, _ = buf.low_latency_combine(y_r, topk, w, handle_r)
    with _Counting():
        (_, _), count_m, handle_m, _, _ = buf.low_latency_dispatch(x, topk, T, E)
        out_m, _, _ = buf.low_latency_combine(y_r, topk, w, handle_m)
    assert not seen or not hasattr(torch._C, 'DisableTorchFunctionSubclass'), seen
    assert torch.equal(count_m, count) and torch.equal(out_m, out_r) and out_r.abs().sum() > 0
    seen.clear()
    (_, _), count_s, handle_s, _, _ = buf.low_latency_dispatch(x.as_subclass(_Sub), topk, T, E)
    out_s, _, _ = buf.low_latency_combine(y_r.as_subclass(_Sub), topk, w, handle_s)
    assert not seen, seen
    assert torch.equal(count_s, count) and torch.equal(out_s.as_subclass(torch.Tensor), out_r)
    with pytest.raises(ValueError, match='every call must agree'):
        buf.low_latency_dispatch(x, topk, T * 2, E)
    with pytest.raises(NotImplementedError, match='use_nvfp4'):
        buf.low_latency_dispatch(x, topk, T, E, use_nvfp4=True)
    with pytest.raises(TypeError, match='unexpected keyword'):
        buf.low_latency_dispatch(x, topk, T, E, no_such_argument=1)
    # Switching the layout is collective and explicit; a layout larger than num_rdma_bytes is refused up front.
    with pytest.raises(ValueError, match='num_rdma_bytes'):
        buf.clean_low_latency_buffer(T * 4, H, E)
    buf.clean_low_latency_buffer(T * 2, H, E)
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, topk, T * 2, E, use_fp8=False)
    assert recv.shape == (E // R, R * T * 2, H)
    buf.destroy()
    with pytest.raises(llep.LlepFailedPreconditionError):
        buf.low_latency_dispatch(x, topk, T * 2, E)

    # metrics_layers (llep keyword): the per-layer counters of a model with more layers than LLEP_METRICS_LAYERS.
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match='metrics_layers must be a positive int'):
            llep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, metrics_layers=bad)
    buf = llep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, explicitly_destroy=True, metrics_layers=200)
    _, count, _, _, _ = buf.low_latency_dispatch(x, topk, T, E, layer=199)
    per_layer = buf.metrics_snapshot()['layer_expert_recv_tokens']
    assert per_layer.shape == (200, E // R) and torch.equal(per_layer[199], count.long()) and not per_layer[:199].any()
    with pytest.raises(ValueError, match=r'layer 200 is outside \[0, 200\)'):
        buf.low_latency_dispatch(x, topk, T, E, layer=200)
    buf.destroy()
    dist.destroy_process_group()


@pytest.mark.parametrize('provider', ['shm', 'tcp;ofi_rxm'])
def test_four_ranks(provider):
    mp.spawn(_worker, args=(free_port(), provider), nprocs=R, join=True)
