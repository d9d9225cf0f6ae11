#!/usr/bin/env python3
"""Before/after table from ll_gpu_bench.py --json files: `compare_runs.py base=a1.json,a2.json new=b1.json,...`.
Each label's value per (T, metric) is the median over its runs (runs of the two labels alternate in
scripts/gpu_bench_ab.sh, so drift of the machine hits both); the last column is new / base."""
import json
import statistics
import sys

METRICS = ['dispatch_us', 'combine_us', 'dispatch_send_us', 'dispatch_recv_us', 'combine_send_us',
           'combine_recv_us', 'ev_round_trip_us']


def load(spec):
    label, files = spec.split('=', 1)
    runs = [json.load(open(f))['rows'] for f in files.split(',') if f]
    by_t = {}
    for rows in runs:
        for r in rows:
            for m in METRICS:
                by_t.setdefault(r['T'], {}).setdefault(m, []).append(r[m])
    return label, {t: {m: statistics.median(v) for m, v in ms.items()} for t, ms in by_t.items()}


def main(argv):
    if len(argv) != 2:
        print(__doc__)
        return 2
    (la, a), (lb, b) = load(argv[0]), load(argv[1])
    print(f'{"T":>4} {"metric":<18} {la:>9} {lb:>9} {lb + "/" + la:>10}')
    for t in sorted(set(a) & set(b)):
        for m in METRICS:
            va, vb = a[t][m], b[t][m]
            print(f'{t:>4} {m:<18} {va:>9.1f} {vb:>9.1f} {vb / va:>10.3f}')
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
