"""bench/placement_sweep.py and the hook round it shares with bench/ll_side_by_side.py, on CPU with a fake system:
a hook round is dispatch send, its receive, combine send, its receive, with every rank's send finished before each
receive when asked (the settled receives); the sweep's summary takes each placement's own ratio, not a ratio of
medians."""
import argparse
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', '..', 'bench'))
import ll_side_by_side as sbs  # noqa: E402
import placement_sweep as ps  # noqa: E402


class _HookSystem:
    """ll_side_by_side._System's two calls with return_recv_hook=True, recording each launch and settle()."""

    def __init__(self, log):
        self.log = log

    def dispatch(self, x, topk, w, T_max, **kw):
        assert kw == {'return_recv_hook': True}
        self.log.append('dispatch send')
        return None, None, 'handle', None, lambda: self.log.append('dispatch recv')

    def combine(self, y, topk, w, handle, **kw):
        assert handle == 'handle' and kw['return_recv_hook'] and kw['out'] is not None
        self.log.append('combine send')
        return None, None, lambda: self.log.append('combine recv')


def test_hook_round_launches_in_order_and_settles_before_each_receive_when_asked(monkeypatch):
    log = []
    monkeypatch.setattr(sbs, 'settle', lambda: log.append('settle'))
    monkeypatch.setattr(torch.cuda, '_sleep', lambda cycles: log.append(f'spin {cycles}'))
    inputs = (None, None, None, None, torch.empty(1))
    sbs._hook_round(_HookSystem(log), inputs, 4)
    assert log == ['dispatch send', 'dispatch recv', 'combine send', 'combine recv']
    log.clear()
    sbs._hook_round(_HookSystem(log), inputs, 4, wait_all=True)
    assert log == ['dispatch send', 'settle', 'dispatch recv', 'combine send', 'settle', 'combine recv']
    log.clear()
    sbs._hook_round(_HookSystem(log), inputs, 4, spin=7)
    assert log == ['dispatch send', 'spin 7', 'dispatch recv', 'combine send', 'spin 7', 'combine recv']
    log.clear()
    sbs._hook_round(_HookSystem(log), inputs, 4, wait_all=True, before_recv=lambda: log.append('flush'))
    assert log == ['dispatch send', 'settle', 'flush', 'dispatch recv', 'combine send', 'settle', 'flush',
                   'combine recv']


def test_settled_receives_take_every_second_launch_of_each_op(monkeypatch):
    """kernel_times lists each op's launches in order: send, receive, send, receive ...: the receives are [1::2]."""
    seen = {}

    def fake_kernel_times(fn, iters, ahead):
        seen['iters'], seen['ahead'] = iters, ahead
        return {'dispatch': [9.0, 1.0, 9.0, 2.0, 9.0, 3.0], 'combine': [8.0, 5.0, 8.0, 4.0, 8.0, 6.0]}

    monkeypatch.setattr(sbs, 'kernel_times', fake_kernel_times)
    assert sbs._settled_receives(None, None, 4, 3) == (2.0, 5.0)
    assert seen == {'iters': 3, 'ahead': sbs.settle}
    # before_recv reaches the hook rounds kernel_times runs
    rounds = []
    monkeypatch.setattr(sbs, '_hook_round', lambda *a, **k: rounds.append(k))
    monkeypatch.setattr(sbs, 'kernel_times', lambda fn, iters, ahead: (fn(), fake_kernel_times(fn, iters, ahead))[1])
    flush = object()
    sbs._settled_receives(None, None, 4, 3, before_recv=flush)
    assert rounds == [{'wait_all': True, 'before_recv': flush}]


def test_summary_takes_each_placements_ratio(capsys):
    # llep slow at one placement of three, DeepEP at another: the ratio's spread is per placement.
    rows = [{'pad_mb': 0, 'llep_h_drs_T8': 5.0, 'deepep_h_drs_T8': 4.0, 'llep_h_crs_T8': 5.0, 'deepep_h_crs_T8': 6.0},
            {'pad_mb': 2, 'llep_h_drs_T8': 4.0, 'deepep_h_drs_T8': 4.0, 'llep_h_crs_T8': 5.0, 'deepep_h_crs_T8': 6.0},
            {'pad_mb': 4, 'llep_h_drs_T8': 4.0, 'deepep_h_drs_T8': 5.0, 'llep_h_crs_T8': 5.0, 'deepep_h_crs_T8': 6.0}]
    ps._summary(rows, [8], ['llep', 'deepep'])
    out = capsys.readouterr().out
    assert 'over 3 placements' in out
    assert 'h_drs: llep  4.00 [ 4.00,  5.00], deepep  4.00 [ 4.00,  5.00], ratio  1.00 [ 0.80,  1.25]' in out
    assert 'h_crs: llep  5.00 [ 5.00,  5.00], deepep  6.00 [ 6.00,  6.00], ratio  0.83 [ 0.83,  0.83]' in out
    assert ps._row_line(rows[0], [8]) == 'pad    0 MiB | T=8 drs  5.00/ 4.00 1.25 crs  5.00/ 6.00 0.83'
    one = [{k: v for k, v in r.items() if not k.startswith('deepep')} for r in rows]
    ps._summary(one, [8], ['llep'])
    out = capsys.readouterr().out
    assert 'h_drs: llep  4.00 [ 4.00,  5.00]\n' in out and 'ratio' not in out


def test_systems_argument_keeps_order_and_refuses_unknown_or_none():
    ap = argparse.ArgumentParser()
    assert sbs.parse_systems(ap, 'deepep,llep') == ['deepep', 'llep']
    assert sbs.parse_systems(ap, 'llep,') == ['llep']
    for bad in ('llep,nccl', ',', ''):
        with pytest.raises(SystemExit):
            sbs.parse_systems(ap, bad)


class _FakeBuf:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def clean_low_latency_buffer(self, T_max, hidden, num_experts):
        self.log.append((self.name, 'clean', T_max))

    def _clear_pools(self):
        self.log.append((self.name, 'clear_pools'))

    def destroy(self):
        self.log.append((self.name, 'destroy'))


def _sweep_worker(move, systems, json_path, log, flush_mb=0):
    """placement_sweep._worker in this process (one gloo rank), with every CUDA call and system faked."""
    from local_group import free_port
    made = {'llep': 0, 'deepep': 0}

    class _FakeSystem:
        def __init__(self, name, group, R, T_top):
            made[name] += 1
            self.name = f'{name}{made[name]}'
            self.buf = _FakeBuf(log, self.name)
            log.append((self.name, 'made', T_top))

    held = []
    pad_now = [0]

    def fake_empty(n, dtype=None, device=None):
        held.append(n)
        pad_now[0] = n >> 20
        return object()

    def settled(sysm, inputs, T_max, iters, before_recv=None):  # llep 4 µs + 0.1 per MiB held, DeepEP 4 µs
        log.append((sysm.name, 'flush' if before_recv is not None else 'no flush'))
        return (4.0 + (0.1 * pad_now[0] if sysm.name.startswith('llep') else 0.0), 5.0)

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(torch.cuda, 'device_count', lambda: 1)
        mp.setattr(torch.cuda, 'set_device', lambda d: None)
        mp.setattr(torch.cuda, 'synchronize', lambda *a: None)
        mp.setattr(torch.cuda, 'empty_cache', lambda: log.append(('torch', 'empty_cache')))
        mp.setattr(torch.cuda, 'get_device_name', lambda d: 'fake')
        mp.setattr(ps.torch, 'empty', fake_empty)
        mp.setattr(ps, '_System', _FakeSystem)
        mp.setattr(ps, '_gate', lambda sysm, *a: log.append((sysm.name, 'gate')))
        mp.setattr(ps, '_round_trip_inputs', lambda *a: None)
        mp.setattr(ps, '_hook_round', lambda *a, **k: None)
        mp.setattr(ps, '_settled_receives', settled)
        ps._worker(0, 1, free_port(), [1, 8], [0, 2, 4], 3, systems, move, json_path, flush_mb)
    finally:
        mp.undo()
    return held


@pytest.mark.parametrize('move', ['all', 'outputs'])
def test_sweep_makes_what_it_moves_anew_after_the_held_memory(tmp_path, capsys, move):
    import json
    log = []
    path = tmp_path / 'sweep.json'
    held = _sweep_worker(move, ['llep', 'deepep'], str(path), log)
    assert held == [0, 2 << 20, 4 << 20]
    names = [e for e in log if e[1] == 'made']
    if move == 'all':  # a new llep buffer per placement, each destroyed; DeepEP's once
        assert [n for n, _, _ in names] == ['deepep1', 'llep1', 'llep2', 'llep3']
        assert [n for n, what in (e[:2] for e in log) if what == 'destroy'] == ['llep1', 'llep2', 'llep3', 'deepep1']
    else:  # llep's buffer once too, its pooled outputs dropped before each placement's memory is held
        assert [n for n, _, _ in names] == ['deepep1', 'llep1']
        assert [e for e in log if e[1] == 'clear_pools'] == [('llep1', 'clear_pools')] * 3
        assert [n for n, what in (e[:2] for e in log) if what == 'destroy'] == ['llep1', 'deepep1']
    assert [n for n, what in (e[:2] for e in log) if what == 'gate'] == ['llep1', 'deepep1'] * 2  # first placement
    data = json.loads(path.read_text())
    assert data['move'] == move and [r['pad_mb'] for r in data['rows']] == [0, 2, 4]
    assert [r['llep_h_drs_T8'] for r in data['rows']] == pytest.approx([4.0, 4.2, 4.4])
    assert [r['deepep_h_drs_T1'] for r in data['rows']] == [4.0] * 3
    out = capsys.readouterr().out
    assert 'T=8    h_drs: llep  4.20 [ 4.00,  4.40], deepep  4.00 [ 4.00,  4.00], ratio  1.05 [ 1.00,  1.10]' in out


def test_sweep_flushes_before_every_timed_receive_when_asked(tmp_path):
    """--flush-mb: one scratch of that size, made before the first placement's memory is held, and handed to every
    timed measurement; without it none."""
    import json
    for flush_mb, want in ((0, 'no flush'), (64, 'flush')):
        log = []
        path = tmp_path / f'sweep{flush_mb}.json'
        held = _sweep_worker('outputs', ['llep'], str(path), log, flush_mb)
        assert held == ([64 << 20] if flush_mb else []) + [0, 2 << 20, 4 << 20]
        assert [e[1] for e in log if e[1].endswith('flush')] == [want] * 6  # 3 placements x 2 T
        assert json.loads(path.read_text())['flush_mb'] == flush_mb
