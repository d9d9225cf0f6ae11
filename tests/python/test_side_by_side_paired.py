"""bench/ll_side_by_side.py's paired phase on CPU with fake systems, events and clock: the two systems' calls alternate
with the order swapped every iteration, each system is called as often as the other, and each cell's ratio is the
median of per-iteration ratios, so a host that changes speed between iterations (here 3x, every 15 iterations) moves
both sides of every ratio and none of the ratios, while the per-system medians mix the two speeds."""
import json
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', '..', 'bench'))
import ll_side_by_side as sbs  # noqa: E402

COST_US = {'llep': (3.0, 1.0), 'deepep': (4.0, 5.0)}  # (dispatch, combine) host µs at speed 1


class _Clock:
    ns = 0


class _Event:
    def __init__(self, enable_timing=True):
        self.ms = None

    def record(self):
        self.ms = _Clock.ns / 1e6

    def elapsed_time(self, end):
        return end.ms - self.ms


class _FakeSystem:
    def __init__(self, name, calls):
        self.name, self.calls, self.n = name, calls, 0

    def _advance(self, us):
        slow = 3.0 if (self.n // 15) % 2 else 1.0  # the host's speed mode, by this system's call count
        _Clock.ns += int(us * slow * 1000)

    def dispatch(self, x, topk, w, T_max, **kw):  # ll_side_by_side._System.dispatch
        self.calls.append(self.name)
        self._advance(COST_US[self.name][0])
        return None, None, ('handle', self.name), None, None

    def combine(self, y, topk, w, handle, **kw):
        assert handle == ('handle', self.name)
        self._advance(COST_US[self.name][1])
        self.n += 1
        return None, None, None


class _FakeGraph:
    """A captured graph of one round trip: replaying it runs the round trip (its host time on _Clock)."""

    def __init__(self, round_trip, n):
        assert n == 1, 'the paired phase captures one round trip per graph'
        self.replay = round_trip


@pytest.fixture
def fake_gpu(monkeypatch):
    """CUDA events, synchronisation, the GPU sleep, the ranks' barrier, the host clock (all on _Clock) and graph
    capture."""
    monkeypatch.setattr(sbs, '_captured', _FakeGraph)
    monkeypatch.setattr(torch.cuda, 'Event', _Event)
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, '_sleep', lambda *a, **k: None)
    monkeypatch.setattr(dist, 'barrier', lambda *a, **k: None)
    monkeypatch.setattr(sbs.time, 'perf_counter_ns', lambda: _Clock.ns)


def test_paired_phase_alternates_the_systems_and_takes_per_iteration_ratios(fake_gpu):
    calls = []
    objs = {name: _FakeSystem(name, calls) for name in ('llep', 'deepep')}
    iters = 60
    per, ratio = sbs._paired_host(objs, 0, 2, 2, 4, torch.device('cpu'), iters)

    assert objs['llep'].n == objs['deepep'].n == 20 + 3 * iters  # warm-up, eager, cpu, one graph replay
    measured = calls[2 * 20:]
    for i in range(3 * iters):  # eager, cpu, then replay iterations: the order swaps every iteration
        pair = measured[2 * i:2 * i + 2]
        assert pair == (['llep', 'deepep'] if (i % iters) % 2 == 0 else ['deepep', 'llep']), (i, pair)

    (ld, lc), (dd, dc) = COST_US['llep'], COST_US['deepep']
    assert ratio['eager_p'] == pytest.approx((ld + lc) / (dd + dc))
    assert ratio['graph_p'] == pytest.approx((ld + lc) / (dd + dc))
    assert ratio['cpu_d_p'] == pytest.approx(ld / dd)
    assert ratio['cpu_c_p'] == pytest.approx(lc / dc)
    # The per-system medians see both speeds; the cells print them beside the ratio.
    assert per['llep']['cpu_d_p'] in (pytest.approx(ld), pytest.approx(3 * ld), pytest.approx(2 * ld))
    assert per['deepep']['eager_p'] >= dd + dc


def test_paired_report_prints_every_row_and_adds_the_cells_to_the_json(tmp_path, capsys):
    path = tmp_path / 'sbs.json'
    path.write_text('{"rows": [], "ranks": 2}')
    rows = [{'T': T, 'T_max': T, 'llep_eager_p': 20.0, 'deepep_eager_p': 40.0, 'ratio_eager_p': 0.5,
             'llep_graph_p': 15.0, 'deepep_graph_p': 20.0, 'ratio_graph_p': 0.75,
             'llep_cpu_d_p': 30.0, 'deepep_cpu_d_p': 60.0, 'ratio_cpu_d_p': 0.5, 'llep_cpu_c_p': 10.0,
             'deepep_cpu_c_p': 40.0, 'ratio_cpu_c_p': 0.25} for T in (8, 32)]
    sbs._report_paired(200, rows, str(path))
    out = capsys.readouterr().out
    assert out.count('  20.0/ 40.0 0.50') == 2 and '  10.0/ 40.0 0.25' in out and out.count('  15.0/ 20.0 0.75') == 2
    import json
    data = json.loads(path.read_text())
    assert data['ranks'] == 2 and data['rows'] == rows


def test_one_system_columns_use_the_same_sampling(fake_gpu):
    """The main table's eager and cpu columns (_eager_times, _cpu_times) take the paired phase's samplers with one
    system: every iteration called once, the medians of its own costs."""
    calls = []
    llep = _FakeSystem('llep', calls)

    def dispatch():
        return llep.dispatch(None, None, None, 4)[2]

    def combine(h):
        llep.combine(None, None, None, h)

    ld, lc = COST_US['llep']
    iters = 10  # below the 15 calls after which the fake host slows down
    assert sbs._eager_times(lambda: combine(dispatch()), iters) == pytest.approx(ld + lc)
    assert llep.n == iters
    llep.n = 0
    d_us, c_us = sbs._cpu_times(dispatch, combine, iters)
    assert (d_us, c_us) == (pytest.approx(ld), pytest.approx(lc))
    assert llep.n == iters


def _every_rank_worker(rank, port, out_dir):
    from local_group import init_gloo  # bench/local_group.py (on the path through the module import above)
    init_gloo(rank, 2, port, 60)
    try:
        vs = sbs._every_rank(1.25 + 2 * rank)
        with open(os.path.join(out_dir, f'r{rank}.txt'), 'w') as f:
            json.dump([vs, sbs._max_over_ranks(1.25 + 2 * rank)], f)
    finally:
        dist.destroy_process_group()


def test_every_rank_returns_each_ranks_value_in_rank_order(tmp_path):
    """The JSON's per-rank columns (<system>_<column>_ranks): every rank gets all values in rank order, and the table's
    maximum is their max. Two gloo processes on loopback."""
    import torch.multiprocessing as mp
    from local_group import free_port
    mp.spawn(_every_rank_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        vs, mx = json.loads((tmp_path / f'r{rank}.txt').read_text())
        assert vs == [1.25, 3.25]
        assert mx == max(vs) == 3.25
