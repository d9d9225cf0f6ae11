"""bench/compare_rounds.py on files written as bench/ll_side_by_side.py writes them: ratios per round, medians over the
rounds, and each round's data placement named when the rounds sampled placements (LLEP_SBS_PLACEMENTS)."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', '..', 'bench'))
import compare_rounds as cr  # noqa: E402


def _write(d, variant, rnd, drs, pad=None):
    data = {'rows': [{'T': 8, 'llep_h_drs': drs}]}
    if pad is not None:
        data['placement_pad_mb'] = pad
    (d / f'sbs_{variant}_{rnd}.json').write_text(json.dumps(data))


def test_rounds_at_placements_are_named_and_ratios_taken_per_round(tmp_path):
    for rnd, pad, base, new in ((1, 0, 4.0, 3.8), (2, 2, 5.0, 4.5)):
        _write(tmp_path, 'base', rnd, base, pad)
        _write(tmp_path, 'new', rnd, new, pad)
    _write(tmp_path, 'base_es', 1, 9.0)  # another variant's file, not base's
    ref = cr.load_rounds(str(tmp_path), 'base')
    lines = cr.table('base', ref, 'new', cr.load_rounds(str(tmp_path), 'new'), ['h_drs'],
                     cr.placements_of(cr.load_runs(str(tmp_path), 'base')))
    assert lines[0] == 'new / base, rounds 1 (0 MiB), 2 (2 MiB) (cells: ratio per round)'
    assert lines[3] == '| 8 | 0.95 / 0.90 |'
    assert lines[5] == '  T=8: h_drs 4.2/4.5'


def test_rounds_without_placements_are_plain(tmp_path):
    for rnd in (1, 2):
        _write(tmp_path, 'base', rnd, 4.0, 0)
        _write(tmp_path, 'new', rnd, 4.4)
    lines = cr.table('base', cr.load_rounds(str(tmp_path), 'base'), 'new', cr.load_rounds(str(tmp_path), 'new'),
                     ['h_drs'], cr.placements_of(cr.load_runs(str(tmp_path), 'base')))
    assert lines[0] == 'new / base, rounds 1, 2 (cells: ratio per round)'
    assert lines[3] == '| 8 | 1.10 / 1.10 |'
