#!/usr/bin/env python3
"""A/B over interleaved rounds of bench/ll_side_by_side.py (scripts/gpu_sbs_rounds.sh): llep's columns of each variant
against a reference variant, round by round, so the spread of this machine shows beside the change.

  compare_rounds.py DIR REF VARIANT [VARIANT ...] [--columns k_disp,h_dr,...]

DIR holds sbs_<variant>_<round>.json. For each VARIANT and T it prints variant / REF per round ("0.79 / 0.87 / 0.81")
for every column, then the variant's and REF's medians over the rounds in µs. Rounds missing either file are skipped.
One round is the plain before / after of two runs (it replaced compare_side_by_side.py). Rounds run at different
data placements (gpu_sbs_rounds.sh's LLEP_SBS_PLACEMENTS) are labelled with the MiB held before the buffers. The
default columns include the cold receives (h_drc / h_crc, '-' for files from before session 55): a receive change is
judged with L2 cold as well as warm (kernels/SMALL_T_CODE.md).
"""
import argparse
import glob
import json
import os
import re
import statistics
import sys

DEFAULT_COLUMNS = ('k_disp', 'k_comb', 'h_ds', 'h_dr', 'h_cs', 'h_cr', 'h_drc', 'h_crc', 'graph16')


def variant_files(directory, variant):
    """{round: path} of variant's files in directory: sbs_<variant>_<round>.json exactly, so variant `base` does not
    take the files of a variant named `base_es`."""
    files = {}
    for path in glob.glob(os.path.join(directory, f'sbs_{variant}_*.json')):
        m = re.fullmatch(rf'sbs_{re.escape(variant)}_(\d+)\.json', os.path.basename(path))
        if m:
            files[int(m.group(1))] = path
    return files


def load_runs(directory, variant):
    """{round: the file's JSON} of variant's files in directory, each read once."""
    runs = {}
    for n, path in variant_files(directory, variant).items():
        with open(path) as f:
            runs[n] = json.load(f)
    return runs


def rows_by_t(data):
    """{T: row} of one run's JSON (ll_side_by_side.py --json)."""
    return {r['T']: r for r in data['rows']}


def rows_of(runs):
    """{round: {T: row}} of load_runs' runs."""
    return {n: rows_by_t(data) for n, data in runs.items()}


def placements_of(runs):
    """{round: MiB held before the buffers} of load_runs' runs (ll_side_by_side.py's placement_pad_mb; files before it
    have none)."""
    return {n: data['placement_pad_mb'] for n, data in runs.items() if data.get('placement_pad_mb') is not None}


def load_rounds(directory, variant):
    """{round: {T: row}} of variant's files in directory."""
    return rows_of(load_runs(directory, variant))


def table(ref_name, ref, name, var, columns, placements=None):
    """placements: {round: MiB} of the rounds (LLEP_SBS_PLACEMENTS), named beside each round when any is not 0."""
    rounds = sorted(set(ref) & set(var))
    if not rounds:
        return [f'{name} / {ref_name}: no round has both files']
    placements = placements or {}
    shown = any(placements.get(r, 0) for r in rounds)
    labels = [f'{r} ({placements[r]} MiB)' if shown and r in placements else str(r) for r in rounds]
    lines = [f'{name} / {ref_name}, rounds {", ".join(labels)} (cells: ratio per round)',
             '| T | ' + ' | '.join(columns) + ' |', '|---' * (len(columns) + 1) + '|']
    tokens = sorted(set.intersection(*(set(ref[r]) & set(var[r]) for r in rounds)))
    for t in tokens:
        cells = []
        for c in columns:
            key = f'llep_{c}'
            ratios = [var[r][t][key] / ref[r][t][key] for r in rounds
                      if ref[r][t].get(key) and var[r][t].get(key) is not None]
            cells.append(' / '.join(f'{x:.2f}' for x in ratios) if ratios else '-')
        lines.append(f'| {t} | ' + ' | '.join(cells) + ' |')
    lines.append(f'medians over the rounds, µs ({name} / {ref_name}):')
    for t in tokens:
        cells = []
        for c in columns:
            key = f'llep_{c}'
            a = [ref[r][t][key] for r in rounds if ref[r][t].get(key) is not None]
            b = [var[r][t][key] for r in rounds if var[r][t].get(key) is not None]
            cells.append(f'{c} {statistics.median(b):.1f}/{statistics.median(a):.1f}' if a and b else f'{c} -')
        lines.append(f'  T={t}: ' + ', '.join(cells))
    return lines


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('directory')
    ap.add_argument('ref')
    ap.add_argument('variants', nargs='+')
    ap.add_argument('--columns', default=','.join(DEFAULT_COLUMNS))
    args = ap.parse_args(argv)
    columns = [c for c in args.columns.split(',') if c]
    ref_runs = load_runs(args.directory, args.ref)
    ref, placements = rows_of(ref_runs), placements_of(ref_runs)
    if not ref:
        print(f'compare_rounds: no sbs_{args.ref}_<round>.json in {args.directory}', file=sys.stderr)
        return 2
    for name in args.variants:
        print('\n'.join(table(args.ref, ref, name, load_rounds(args.directory, name), columns, placements)))
        print()
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
