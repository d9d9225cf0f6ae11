#!/usr/bin/env python3
"""Tables from bench/ll_side_by_side.py --json files of llep + DeepEP runs (one call's A/B, or a README table).

  sbs_tables.py ranges DIR VARIANT [VARIANT ...] [--columns h_ds,k_disp,...]
      per T and column, each variant's llep range over its runs (DIR/sbs_<variant>_*.json, as
      scripts/gpu_sbs_rounds.sh names them) and DeepEP's range over all of them: "min–max" in µs. The A/B table of an
      interleaved call, DeepEP beside every run, so the machine's drift shows in its column.
  sbs_tables.py ratios FILE [FILE ...]
      per T the range over the files of llep / DeepEP per column, each ratio taken within one run (the README's
      table): kernels, hook send and receive, the paired eager round trip, one graph replay (paired; the unpaired
      column, marked, for files without it), graph16 (with both systems' µs at T=1 and the hook dispatch receive's),
      host CPU per dispatch / combine (paired), and the cold hook receives (h_drc / h_crc) where the files have them.
  sbs_tables.py settled FILE [FILE ...]  |  sbs_tables.py settled --variant DIR VARIANT
      per T the settled hook receives (h_drs / h_crs: launched once every rank's send finished, the receive launch's
      own cost; and h_drc / h_crc, the same with the caches evicted first, where the files have them), both systems'
      µs ranges over the files and the range of llep / DeepEP taken within each run (the "settled" figures of the
      README and bench/RESULTS.md). --variant takes VARIANT's files in DIR, as `ranges` does.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_rounds import load_rounds, rows_by_t, variant_files  # noqa: E402  (bench/: the same files and naming)

RANGE_COLUMNS = ('h_ds', 'k_disp', 'h_dr', 'h_dra', 'h_drs', 'h_drc', 'h_cs', 'h_cr', 'h_cra', 'h_crs', 'h_crc',
                 'k_comb', 'graph16', 'eager', 'cpu_d', 'cpu_c')


def _rows(path):
    with open(path) as f:
        return rows_by_t(json.load(f))


def span(values, digits):
    """'a–b' (or 'a' when equal at that precision) of the non-missing values; '-' when none."""
    vals = [v for v in values if v is not None]
    if not vals:
        return '-'
    lo, hi = f'{min(vals):.{digits}f}', f'{max(vals):.{digits}f}'
    return lo if lo == hi else f'{lo}–{hi}'


def ranges(directory, variants, columns):
    runs = {v: list(load_rounds(directory, v).values()) for v in variants}
    missing = [v for v in variants if not runs[v]]
    if missing:
        raise SystemExit(f'sbs_tables: no sbs_<variant>_*.json in {directory} for {", ".join(missing)}')
    all_runs = [r for v in variants for r in runs[v]]
    tokens = sorted(set.intersection(*(set(r) for r in all_runs)))
    lines = ['| T | column | ' + ' | '.join(variants) + ' | DeepEP |', '|---' * (len(variants) + 3) + '|']
    for t in tokens:
        for c in columns:
            cells = [span([r[t].get(f'llep_{c}') for r in runs[v]], 1) for v in variants]
            lines.append(f'| {t} | {c} | ' + ' | '.join(cells) +
                         f' | {span([r[t].get(f"deepep_{c}") for r in all_runs], 1)} |')
    return lines


def _ratio(row, c):
    a, b = row.get(f'llep_{c}'), row.get(f'deepep_{c}')
    return a / b if a is not None and b else None


def _per_token(paths):
    """[(T, [row of T in each file])] for the T every file has."""
    runs = [_rows(p) for p in paths]
    tokens = sorted(set.intersection(*(set(r) for r in runs)))
    return [(t, [r[t] for r in runs]) for t in tokens]


def _has(per_token, c):
    """Whether any run has llep's column c (older files lack the newer columns)."""
    return any(r.get(f'llep_{c}') is not None for _, rs in per_token for r in rs)


def ratios(paths):
    per_token = _per_token(paths)
    first = per_token[0][0] if per_token else None
    lines = ['| T | dispatch kernel | combine kernel | hook dispatch send / receive | hook combine send / receive | '
             'eager round trip (paired) | one graph replay (paired) | graph16 | host CPU dispatch / combine (paired) |',
             '|---' * 9 + '|']
    # The cold receives (h_drc / h_crc, L2 evicted between send and receive) as a last column when the files have them.
    cold = _has(per_token, 'h_drc')
    if cold:
        lines[0] += ' cold hook receive dispatch / combine |'
        lines[1] += '---|'
    for t, rs in per_token:

        def rr(c):
            return span([_ratio(r, c) for r in rs], 2)

        def us(c):
            return f'{span([r.get(f"llep_{c}") for r in rs], 1)} vs {span([r.get(f"deepep_{c}") for r in rs], 1)} µs'

        d_recv = rr('h_dr') + (f' ({us("h_dr")})' if t == first else '')
        g16 = rr('graph16') + (f' ({us("graph16")})' if t == first else '')
        # One replay, paired (the systems' replays alternating, ratio per iteration) in files that have it; the
        # unpaired column of older files, marked, whose systems ran minutes apart in the host's drifting speed modes.
        one_replay = (span([r.get('ratio_graph_p') for r in rs], 2) if any('ratio_graph_p' in r for r in rs)
                      else rr('graph') + ' (unpaired)')
        cells = [rr('k_disp'), rr('k_comb'), f'{rr("h_ds")}, {d_recv}', f'{rr("h_cs")}, {rr("h_cr")}',
                 span([r.get('ratio_eager_p') for r in rs], 2), one_replay, g16,
                 f'{span([r.get("ratio_cpu_d_p") for r in rs], 2)}, {span([r.get("ratio_cpu_c_p") for r in rs], 2)}']
        if cold:
            cells.append(f'{rr("h_drc")}, {rr("h_crc")}')
        lines.append(f'| {t} | ' + ' | '.join(cells) + ' |')
    return lines


SETTLED_COLUMNS = (('h_drs', 'dispatch receive'), ('h_crs', 'combine receive'),
                   ('h_drc', 'cold dispatch receive'), ('h_crc', 'cold combine receive'))


def settled(paths):
    """The settled receives' table; the cold ones (h_drc / h_crc) too when the files have them (since session 55)."""
    per_t = _per_token(paths)
    cols = [(c, name) for c, name in SETTLED_COLUMNS if _has(per_t, c)]
    lines = ['| T | ' + ' | '.join(f'{name} llep / DeepEP (µs) | llep / DeepEP' for _, name in cols) + ' |',
             '|---' * (1 + 2 * len(cols)) + '|']
    for t, rs in per_t:
        cells = []
        for c, _ in cols:
            cells += [f'{span([r.get(f"llep_{c}") for r in rs], 2)} / {span([r.get(f"deepep_{c}") for r in rs], 2)}',
                      span([_ratio(r, c) for r in rs], 2)]
        lines.append(f'| {t} | ' + ' | '.join(cells) + ' |')
    return lines


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest='mode', required=True)
    a = sub.add_parser('ranges')
    a.add_argument('dir')
    a.add_argument('variants', nargs='+')
    a.add_argument('--columns', default=','.join(RANGE_COLUMNS))
    sub.add_parser('ratios').add_argument('files', nargs='+')
    st = sub.add_parser('settled')
    st.add_argument('files', nargs='*')
    st.add_argument('--variant', nargs=2, metavar=('DIR', 'VARIANT'))
    args = ap.parse_args(argv)
    if args.mode == 'settled' and args.variant:
        args.files = [path for _, path in sorted(variant_files(*args.variant).items())]
        if not args.files:
            raise SystemExit(f'sbs_tables: no sbs_{args.variant[1]}_<round>.json in {args.variant[0]}')
    if args.mode == 'settled' and not args.files:
        ap.error('settled: FILE ... or --variant DIR VARIANT')
    if args.mode == 'ranges':
        lines = ranges(args.dir, args.variants, args.columns.split(','))
    elif args.mode == 'ratios':
        lines = ratios(args.files)
    else:
        lines = settled(args.files)
    print('\n'.join(lines))
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
