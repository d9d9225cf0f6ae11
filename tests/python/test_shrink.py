#!/usr/bin/env python3
"""Rank masking and recovery through the Python API (issue #15), on the CPU backend (CI) or the GPU one (--device
cuda, scripts/gpu_test.sh).

shrink: DeepEP's shrink scenario (its test_low_latency.py --shrink-test) on R = 5 ranks with enable_shrink=True:
rank 1 fails at its first dispatch, rank 3 at its first combine, rank 4 at its first clean_low_latency_buffer. On the
CPU backend a failing rank is SIGKILLed (a real death inside the job: its transport endpoints die with it); on GPUs it
stops calling (its process, memory and mappings stay). The others must not fail: each call that waits for a failed
rank times out (LLEP_TIMEOUT_S), masks it and completes; after every call low_latency_query_mask_buffer must report
exactly the ranks failed so far; every dispatch must receive exactly the tokens the unmasked ranks routed (counts,
layout ranges, source tokens, values) and every combine must equal the weighted sum over the top-k experts of
unmasked ranks. Later rounds must not wait (each call well under the timeout). Then low_latency_clean_mask_buffer
unmasks all, and update_mask_buffer masks a rank by hand (its tokens disappear at once).

recover: no shrink, R = 3: rank 2 stalls past the timeout before its dispatch, so ranks 0 and 1 get
LlepTimeoutError; then every rank calls clean_low_latency_buffer and the next rounds must be exact again, on the
same buffer.

Usage: test_shrink.py [--device cpu|cuda] [--scenario shrink|recover|all]   (exit 0 = pass)"""
import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from llep.utils import free_port

T, H, K = 8, 1024, 4
TIMEOUT_S = 3.0
FAIL_AT = {'dispatch': 1, 'combine': 3, 'clean': 4}



def _inputs(rank, rnd, R, E, dev):
    import torch
    g = torch.Generator().manual_seed(1000 * rnd + rank)
    n = T - (rnd % 2)
    x = torch.full((n, H), float(rank - 128), dtype=torch.bfloat16)
    x[:, -128:] = torch.arange(n, dtype=torch.float32).view(-1, 1).to(torch.bfloat16)
    topk = torch.topk(torch.rand((n, E), generator=g), K, dim=-1).indices.to(torch.int64)
    topk.view(-1)[torch.randint(0, n * K, (2,), generator=g)] = -1
    w = torch.rand((n, K), generator=g) + 0.5  # every term >= ~8% of a row's sum: a wrongly kept one shows
    return x.to(dev), topk.to(dev), w.to(dev)


class _Failed(Exception):
    pass


def _sync(workdir, tag, ranks, rank):
    """Waits until every rank in `ranks` reached `tag` (files in the work folder, no transport, no timeout of
    llep's). Before each timed call, so that a live rank slowed by a loaded machine (CI: five Python processes on two
    cores, checks in Python between the calls) is never silent long enough to be masked: only the failures the test
    makes may time out. Returns the seconds spent waiting, which the "rounds do not wait" check leaves out."""
    t0 = time.time()
    open(os.path.join(workdir, f'sync.{tag}.{rank}'), 'w').close()
    while not all(os.path.exists(os.path.join(workdir, f'sync.{tag}.{r}')) for r in ranks):
        time.sleep(0.005)
    return time.time() - t0


def _check(cond, what):
    if not cond:
        raise _Failed(what)


def _round(buf, rank, rnd, R, E, dev, masked, hook):
    """One dispatch of round `rnd`'s inputs (BF16, so values are exact), received."""
    x, topk, w = _inputs(rank, rnd, R, E, dev)
    recv, count, handle, event, h = buf.low_latency_dispatch(x, topk, T, E, use_fp8=False, return_recv_hook=hook,
                                                             async_finish=not hook)
    h() if hook else event.current_stream_wait()
    return recv, count, handle, x, topk, w


def _check_dispatch(buf, rank, rnd, R, E, dev, masked, recv, count, handle):
    """recv_count, layout ranges, src_info and values against the routing of the unmasked ranks, exactly."""
    import torch
    E_loc = E // R
    src_info, layout_range = handle[0].cpu(), handle[1].cpu()
    recv, count = recv.float().cpu(), count.cpu()
    for le in range(E_loc):
        g = rank * E_loc + le
        total = 0
        for src in range(R):
            cnt, begin = int(layout_range[le, src] & 0xFFFFFFFF), int(layout_range[le, src] >> 32)
            if src in masked:
                _check(cnt == 0, f'round {rnd}: expert {g} got {cnt} tokens from masked rank {src}')
                continue
            _, topk, _ = _inputs(src, rnd, R, E, 'cpu')
            want = (topk == g).any(dim=1).nonzero().flatten()
            _check(cnt == want.numel(), f'round {rnd}: expert {g} from rank {src}: {cnt} tokens, routed {want.numel()}')
            _check(begin == total, f'round {rnd}: expert {g} block of rank {src} starts at {begin}, expected {total}')
            _check(torch.equal(src_info[le, begin:begin + cnt].long(), want), f'round {rnd}: src_info of rank {src}')
            block = recv[le, begin:begin + cnt]
            _check(bool(torch.all(block[:, :-128] == src - 128)), f'round {rnd}: values from rank {src}')
            _check(torch.equal(block[:, -128:], want.float().view(-1, 1).expand(-1, 128)), f'round {rnd}: token ids')
            total += cnt
        _check(int(count[le]) == total, f'round {rnd}: recv_count[{le}] = {int(count[le])}, expected {total}')


def _check_combine(rnd, R, E, masked, x, topk, w, out):
    import torch
    E_loc = E // R
    topk, w, x, out = topk.cpu(), w.cpu(), x.float().cpu(), out.float().cpu()
    keep = (topk >= 0) & ~torch.isin(topk.clamp(min=0) // E_loc, torch.tensor(sorted(masked), dtype=torch.int64))
    want = x * (w * keep).sum(dim=1, keepdim=True)
    err = ((out - want).abs() / want.abs().clamp(min=1e-3)).max().item()
    _check(not torch.isnan(out).any() and err < 1e-2, f'round {rnd}: combine off by {err:.3g} (relative)')


def _masks(buf, R, dev):
    import torch
    m = torch.zeros(R, dtype=torch.int32, device=dev)
    buf.low_latency_query_mask_buffer(m)
    return set(m.cpu().nonzero().flatten().tolist())


def _fail(rank, api, failed, device, workdir):
    """Rank `FAIL_AT[api]` fails now: SIGKILL (CPU) or stop calling until the test ends (GPU)."""
    failed.add(FAIL_AT[api])
    if rank != FAIL_AT[api]:
        return False
    if device == 'cpu':
        os.kill(os.getpid(), signal.SIGKILL)
    open(os.path.join(workdir, f'stopped{rank}'), 'w').close()
    while not os.path.exists(os.path.join(workdir, 'done')):
        time.sleep(0.1)
    os._exit(0)  # no collective: the others never wait for this rank again


def _shrink_rank(rank, R, device, workdir):
    import torch
    import llep
    dev = torch.device('cuda', 0) if device == 'cuda' else torch.device('cpu')
    E = 4 * R
    buf = llep.Buffer(_group(rank, R, workdir), low_latency_mode=True, explicitly_destroy=True, enable_shrink=True,
                      num_rdma_bytes=llep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E))
    buf.backend = device
    failed = set()
    took = []

    def sync(tag):
        return _sync(workdir, tag, set(range(R)) - failed, rank)

    # Every live rank past a call before a rank dies after it (the syncs after the first clean, each dispatch and each
    # combine). A call returns on a rank once it has received every rank's signal, not once its own signals have left
    # its proxy: rank 1, which dies right after the first clean (FAIL_AT), took its barrier signal with it on a loaded
    # machine, so a survivor masked it in the clean instead of at the first dispatch, counted no dispatch timeout and
    # failed the timeouts check (seen twice in full test runs on two cores).
    buf.clean_low_latency_buffer(T, H, E)
    sync('setup')
    _check(_masks(buf, R, dev) == set(), 'a live rank was masked in the first clean')

    for rnd in range(4):
        hook = rnd % 2 == 1
        _fail(rank, 'dispatch', failed, device, workdir)
        sync(f'd{rnd}')
        t0 = time.time()
        recv, count, handle, x, topk, w = _round(buf, rank, rnd, R, E, dev, failed, hook)
        got = _masks(buf, R, dev)
        _check(got == failed, f'round {rnd} dispatch: masked {sorted(got)}, expected {sorted(failed)}')
        _check_dispatch(buf, rank, rnd, R, E, dev, failed, recv, count, handle)
        t0 += sync(f'd{rnd}-done')
        _fail(rank, 'combine', failed, device, workdir)
        t0 += sync(f'c{rnd}')
        out = torch.empty((x.size(0), H), dtype=torch.bfloat16, device=dev)
        y = recv  # experts return their inputs
        _, event, h = buf.low_latency_combine(y, topk, w, handle, out=out, return_recv_hook=hook, async_finish=not hook)
        h() if hook else event.current_stream_wait()
        got = _masks(buf, R, dev)
        _check(got == failed, f'round {rnd} combine: masked {sorted(got)}, expected {sorted(failed)}')
        _check_combine(rnd, R, E, failed, x, topk, w, out)
        t0 += sync(f'c{rnd}-done')
        _fail(rank, 'clean', failed, device, workdir)
        t0 += sync(f'k{rnd}')
        buf.clean_low_latency_buffer(T, H, E)
        got = _masks(buf, R, dev)
        _check(got == failed, f'round {rnd} clean: masked {sorted(got)}, expected {sorted(failed)}')
        took.append(time.time() - t0)
    # Rounds after the last failure never wait for the masked ranks.
    _check(max(took[1:]) < TIMEOUT_S * 0.8, f'rounds after the failures took {took} s (timeout {TIMEOUT_S} s)')
    # Masking by hand: each survivor masks the other, so no tokens cross between them, then unmasks everything.
    survivors = sorted(set(range(R)) - failed)
    other = [r for r in survivors if r != rank][0]
    buf.low_latency_update_mask_buffer(other, True)
    _check(_masks(buf, R, dev) == failed | {other}, 'update_mask_buffer did not mask')
    sync('d10')
    recv, count, handle, x, topk, w = _round(buf, rank, 10, R, E, dev, failed | {other}, False)
    _check_dispatch(buf, rank, 10, R, E, dev, failed | {other}, recv, count, handle)
    sync('c10')
    out, _, _ = buf.low_latency_combine(recv, topk, w, handle)
    _check_combine(10, R, E, failed | {other}, x, topk, w, out)
    buf.low_latency_clean_mask_buffer()
    _check(_masks(buf, R, dev) == set(), 'clean_mask_buffer left masks')
    for r in failed:  # the failed ranks are gone for good: mask them again
        buf.low_latency_update_mask_buffer(r, True)
    sync('d11')
    recv, count, handle, x, topk, w = _round(buf, rank, 11, R, E, dev, failed, False)
    _check_dispatch(buf, rank, 11, R, E, dev, failed, recv, count, handle)
    sync('c11')
    out, _, _ = buf.low_latency_combine(recv, topk, w, handle)
    _check_combine(11, R, E, failed, x, topk, w, out)
    snap = buf.metrics_snapshot()
    # One timeout per silent rank at a user's call: rank 1 at a dispatch, rank 3 at a combine (rank 4 went silent at
    # the clean barrier, which is not counted as an operation).
    _check(snap['timeouts'] == {'dispatch': 1, 'combine': 1}, f'timeouts {snap["timeouts"]}')
    # A rank's last combine returns once it has received, which may be before its own sends left its proxy: exiting
    # at once (os._exit, no teardown) could drop them and leave the other survivor waiting until it masks a live rank.
    sync('end')
    return {'rounds_s': took, 'timeouts': snap['timeouts']}


def _recover_rank(rank, R, device, workdir):
    import torch
    import llep
    dev = torch.device('cuda', 0) if device == 'cuda' else torch.device('cpu')
    E = 4 * R
    buf = llep.Buffer(_group(rank, R, workdir), low_latency_mode=True, explicitly_destroy=True)
    buf.backend = device
    buf.clean_low_latency_buffer(T, H, E)
    recv, count, handle, x, topk, w = _round(buf, rank, 0, R, E, dev, set(), False)
    _check_dispatch(buf, rank, 0, R, E, dev, set(), recv, count, handle)
    buf.low_latency_combine(recv, topk, w, handle)
    if rank == R - 1:
        time.sleep(TIMEOUT_S * 1.5)  # stalls past the others' timeout
    timed_out = False
    try:
        _round(buf, rank, 1, R, E, dev, set(), False)
        if dev.type == 'cuda':
            torch.cuda.synchronize()
            buf.check_errors()
    except llep.LlepTimeoutError:
        timed_out = True
    except llep.LlepError as e:  # a later check may report the timeout as the buffer's earlier error
        timed_out = 'timed out' in str(e)
    _check(timed_out or rank == R - 1, f'rank {rank}: the stall raised no timeout')
    buf.clean_low_latency_buffer(T, H, E)  # every rank: the buffer is usable again
    for rnd in (2, 3, 4):
        _sync(workdir, f'd{rnd}', range(R), rank)
        recv, count, handle, x, topk, w = _round(buf, rank, rnd, R, E, dev, set(), rnd % 2 == 1)
        _check_dispatch(buf, rank, rnd, R, E, dev, set(), recv, count, handle)
        _sync(workdir, f'c{rnd}', range(R), rank)
        out, event, _ = buf.low_latency_combine(recv, topk, w, handle)
        _check_combine(rnd, R, E, set(), x, topk, w, out)
    _sync(workdir, 'end', range(R), rank)  # as in _shrink_rank: no rank leaves while another still receives from it
    buf.destroy()
    return {'timed_out': timed_out}


def _group(rank, R, workdir):
    import torch.distributed as dist
    port = int(open(os.path.join(workdir, 'port')).read())
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=R,
                            timeout=datetime.timedelta(seconds=120))
    return dist.group.WORLD


def _rank_main(a):
    if a.device == 'cuda':
        import torch
        torch.cuda.set_device(0)  # ranks share one GPU when the machine has one (the protocol test)
    fn = _shrink_rank if a.scenario == 'shrink' else _recover_rank
    try:
        result = {'ok': True, **fn(a.rank, a.ranks, a.device, a.workdir)}
    except Exception as e:  # noqa: BLE001 - the result file carries any failure
        result = {'ok': False, 'error': f'{type(e).__name__}: {e}'}
    with open(os.path.join(a.workdir, f'rank{a.rank}.json'), 'w') as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)  # no teardown collectives: in the shrink scenario some ranks are gone


def _run(scenario, device, provider='tcp;ofi_rxm'):
    R = 5 if scenario == 'shrink' else 3
    workdir = tempfile.mkdtemp(prefix='llep-shrink-')
    open(os.path.join(workdir, 'port'), 'w').write(str(free_port()))
    env = dict(os.environ, LLEP_TIMEOUT_S=str(TIMEOUT_S))
    env.pop('LLEP_METRICS_PORT', None)
    if device == 'cpu':
        # Known limit (README): over libfabric's shm provider a survivor's connection to a *live* peer can fail with
        # EIO after another peer was SIGKILLed (seen once in three runs); the survivor then masks that live peer too.
        # Over tcp;ofi_rxm a killed peer only breaks its own connections. Set here, not defaulted: the environment
        # may carry another test's choice (a CI run over shm failed that way). `--provider shm` reproduces the limit.
        env['LLEP_FABRIC_PROVIDER'] = provider
    procs = [subprocess.Popen([sys.executable, __file__, '--rank', str(r), '--ranks', str(R), '--device', device,
                               '--scenario', scenario, '--workdir', workdir], env=env) for r in range(R)]
    failed_ranks = set(FAIL_AT.values()) if scenario == 'shrink' else set()
    survivors = [r for r in range(R) if r not in failed_ranks]
    failures = []
    deadline = time.time() + 240
    while time.time() < deadline and not all(os.path.exists(os.path.join(workdir, f'rank{r}.json'))
                                              for r in survivors):
        time.sleep(0.2)
    open(os.path.join(workdir, 'done'), 'w').close()
    for r, p in enumerate(procs):
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            failures.append(f'rank {r} did not exit')
    results = {}
    for r in survivors:
        path = os.path.join(workdir, f'rank{r}.json')
        if not os.path.exists(path):
            failures.append(f'rank {r} never finished (exit {procs[r].returncode})')
            continue
        results[r] = json.load(open(path))
        if not results[r]['ok']:
            failures.append(f'rank {r}: {results[r]["error"]}')
    if scenario == 'shrink' and device == 'cpu':
        for r in failed_ranks:
            if procs[r].returncode != -signal.SIGKILL:
                failures.append(f'rank {r} was to die by SIGKILL, exit {procs[r].returncode}')
    shutil.rmtree(workdir, ignore_errors=True)
    if failures:
        print(f'test_shrink {scenario} ({device}): FAIL\n  ' + '\n  '.join(failures))
        return False
    print(f'test_shrink {scenario} ({device}): PASS {results}')
    return True


def test_shrink_on_the_cpu_backend():
    assert _run('shrink', 'cpu')


def test_recover_on_the_cpu_backend():
    assert _run('recover', 'cpu')


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--device', choices=('cpu', 'cuda'), default='cpu')
    ap.add_argument('--scenario', choices=('shrink', 'recover', 'all'), default='all')
    ap.add_argument('--rank', type=int, help=argparse.SUPPRESS)
    ap.add_argument('--ranks', type=int, help=argparse.SUPPRESS)
    ap.add_argument('--workdir', help=argparse.SUPPRESS)
    ap.add_argument('--provider', default='tcp;ofi_rxm', help='libfabric provider of the CPU scenario')
    a = ap.parse_args()
    if a.rank is not None:
        _rank_main(a)
    ok = True
    for scenario in ('shrink', 'recover') if a.scenario == 'all' else (a.scenario,):
        ok = _run(scenario, a.device, a.provider) and ok
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
