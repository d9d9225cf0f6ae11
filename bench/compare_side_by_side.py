#!/usr/bin/env python3
"""A/B of two bench/ll_side_by_side.py JSON files (same machine, same run): llep's columns before (base) and after
(new), the ratio new / base, and DeepEP's where the new file has them. Usage: compare_side_by_side.py BASE NEW"""
import json
import sys

def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    base, new = (json.load(open(p)) for p in sys.argv[1:3])
    rows_b = {r['T']: r for r in base['rows']}
    # the columns both files measured, in the benchmark's order (a column added later is absent from older files)
    columns = [k[5:] for k in new['rows'][0] if k.startswith('llep_') and any(k in r for r in base['rows'])]
    print(f'llep A/B on {new["ranks"]} ranks, {new["gpu"]}: cells base / new (new/base); DeepEP in brackets (µs)')
    print(f'{"T":>4} | ' + ' '.join(f'{c:>22}' for c in columns))
    for r in new['rows']:
        b = rows_b.get(r['T'], {})
        cells = []
        for c in columns:
            x, y, d = b.get(f'llep_{c}'), r.get(f'llep_{c}'), r.get(f'deepep_{c}')
            cell = '-' if x is None or y is None else f'{x:.1f}/{y:.1f} ({y / x:.2f})'
            cells.append(f'{cell + (f" [{d:.1f}]" if d is not None else ""):>22}')
        print(f'{r["T"]:>4} | ' + ' '.join(cells))
    return 0


if __name__ == '__main__':
    sys.exit(main())
