"""bench/sbs_tables.py on made-up ll_side_by_side.py JSON files (no GPU): the A/B ranges per variant with DeepEP's over
all runs, and the README's ratio table with each ratio taken within its own run."""
import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(__file__), '..', '..', 'bench', 'sbs_tables.py')


def _run_file(path, scale, deepep, cold=False, graph_p=False):
    """A run with T in {1, 8}: llep's µs = scale * base, DeepEP's fixed; paired ratios given; cold: with h_drc / h_crc
    (ll_side_by_side.py since session 55); graph_p: with the paired one-replay ratio (since session 64)."""
    rows = []
    for t, base in ((1, 10.0), (8, 20.0)):
        r = {'T': t, 'T_max': t, 'deepep_refuses_T': False}
        for c in ('k_disp', 'k_comb', 'h_ds', 'h_dr', 'h_cs', 'h_cr', 'h_drs', 'h_crs', 'graph', 'graph16', 'eager',
                  'cpu_d', 'cpu_c') + (('h_drc', 'h_crc') if cold else ()):
            r[f'llep_{c}'] = scale * base
            r[f'deepep_{c}'] = deepep * base
        r.update(ratio_eager_p=0.6 * scale, ratio_cpu_d_p=0.4 * scale, ratio_cpu_c_p=0.5 * scale)
        if graph_p:
            r['ratio_graph_p'] = 0.7 * scale
        rows.append(r)
    with open(path, 'w') as f:
        json.dump({'rows': rows}, f)


def _tables(*args):
    out = subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True, check=True).stdout
    return [line.split(' | ') for line in out.splitlines()[2:]]


def test_ranges_per_variant_with_deepep_over_all_runs(tmp_path):
    _run_file(tmp_path / 'sbs_new_1.json', 1.0, 2.0)
    _run_file(tmp_path / 'sbs_new_2.json', 1.1, 2.2)
    _run_file(tmp_path / 'sbs_base_1.json', 1.5, 2.4)
    rows = _tables('ranges', str(tmp_path), 'new', 'base', '--columns', 'k_disp,graph16')
    assert rows[0] == ['| 1', 'k_disp', '10.0–11.0', '15.0', '20.0–24.0 |']
    assert rows[3] == ['| 8', 'graph16', '20.0–22.0', '30.0', '40.0–48.0 |']
    assert len(rows) == 4


def test_ranges_refuses_a_variant_without_files(tmp_path):
    _run_file(tmp_path / 'sbs_new_1.json', 1.0, 2.0)
    r = subprocess.run([sys.executable, BENCH, 'ranges', str(tmp_path), 'new', 'gone'], capture_output=True, text=True)
    assert r.returncode != 0 and 'gone' in r.stderr


def test_ratios_within_each_run(tmp_path):
    # run a: llep 10 vs DeepEP 20 (0.50); run b: 11 vs 20 (0.55): the range 0.50–0.55, not 10–11 over 20 mixed.
    _run_file(tmp_path / 'a.json', 1.0, 2.0)
    _run_file(tmp_path / 'b.json', 1.1, 2.0)
    rows = _tables('ratios', str(tmp_path / 'a.json'), str(tmp_path / 'b.json'))
    t1, t8 = rows
    assert t1[0] == '| 1' and t1[1] == '0.50–0.55' and t1[2] == '0.50–0.55'
    assert t1[3] == '0.50–0.55, 0.50–0.55 (10.0–11.0 vs 20.0 µs)'
    assert t1[5] == '0.60–0.66'
    assert t1[6] == '0.50–0.55 (unpaired)', 'files without the paired replay: the unpaired column, marked'
    assert t1[8] == '0.40–0.44, 0.50–0.55 |'
    assert t8[3] == '0.50–0.55, 0.50–0.55'  # µs shown at the first T only


def test_settled_receives_both_systems_and_ratios_within_each_run(tmp_path):
    # run a: llep 10 vs DeepEP 20 (0.50); run b: 11 vs 16 (0.6875): the ratio range 0.50–0.69 is per run, not 10/16.
    _run_file(tmp_path / 'a.json', 1.0, 2.0)
    _run_file(tmp_path / 'b.json', 1.1, 1.6)
    t1, t8 = _tables('settled', str(tmp_path / 'a.json'), str(tmp_path / 'b.json'))
    assert t1 == ['| 1', '10.00–11.00 / 16.00–20.00', '0.50–0.69', '10.00–11.00 / 16.00–20.00', '0.50–0.69 |']
    assert t8[0] == '| 8' and t8[1] == '20.00–22.00 / 32.00–40.00' and t8[2] == '0.50–0.69'


def test_settled_variant_takes_its_own_rounds_only(tmp_path):
    # base's rounds and those of a variant whose name base prefixes (base_es): --variant DIR base takes base's only.
    _run_file(tmp_path / 'sbs_base_1.json', 1.0, 2.0)
    _run_file(tmp_path / 'sbs_base_2.json', 1.1, 2.0)
    _run_file(tmp_path / 'sbs_base_es_1.json', 3.0, 2.0)
    t1, _ = _tables('settled', '--variant', str(tmp_path), 'base')
    assert t1 == ['| 1', '10.00–11.00 / 20.00', '0.50–0.55', '10.00–11.00 / 20.00', '0.50–0.55 |']
    r = subprocess.run([sys.executable, BENCH, 'settled', '--variant', str(tmp_path), 'gone'], capture_output=True,
                       text=True)
    assert r.returncode != 0 and 'gone' in r.stderr


def test_settled_adds_the_cold_receives_when_a_file_has_them(tmp_path):
    _run_file(tmp_path / 'a.json', 1.0, 2.0)
    _run_file(tmp_path / 'b.json', 1.1, 1.6, cold=True)
    out = subprocess.run([sys.executable, BENCH, 'settled', str(tmp_path / 'a.json'), str(tmp_path / 'b.json')],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert 'cold dispatch receive llep / DeepEP (µs)' in out[0] and out[1] == '|---' * 9 + '|'
    t1 = out[2].split(' | ')
    # a.json has no cold columns: their ranges come from b.json alone
    assert t1[1:5] == ['10.00–11.00 / 16.00–20.00', '0.50–0.69', '10.00–11.00 / 16.00–20.00', '0.50–0.69']
    assert t1[5:] == ['11.00 / 16.00', '0.69', '11.00 / 16.00', '0.69 |']


def test_ratios_add_the_cold_receives_as_a_last_column_when_a_file_has_them(tmp_path):
    _run_file(tmp_path / 'a.json', 1.0, 2.0, cold=True)
    _run_file(tmp_path / 'b.json', 1.1, 2.0)
    out = subprocess.run([sys.executable, BENCH, 'ratios', str(tmp_path / 'a.json'), str(tmp_path / 'b.json')],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0].endswith('| cold hook receive dispatch / combine |') and out[1] == '|---' * 10 + '|'
    t1 = out[2].split(' | ')
    assert len(t1) == 10 and t1[8] == '0.40–0.44, 0.50–0.55' and t1[9] == '0.50, 0.50 |'  # b.json has none
    plain = subprocess.run([sys.executable, BENCH, 'ratios', str(tmp_path / 'b.json')], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    assert 'cold' not in plain[0] and len(plain[2].split(' | ')) == 9


def test_ratios_take_the_paired_one_replay_when_a_file_has_it(tmp_path):
    _run_file(tmp_path / 'a.json', 1.0, 2.0, graph_p=True)
    _run_file(tmp_path / 'b.json', 1.1, 2.0, graph_p=True)
    out = subprocess.run([sys.executable, BENCH, 'ratios', str(tmp_path / 'a.json'), str(tmp_path / 'b.json')],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert 'one graph replay (paired)' in out[0]
    assert out[2].split(' | ')[6] == '0.70–0.77', 'the per-iteration ratios of the paired phase, not graph / graph'
