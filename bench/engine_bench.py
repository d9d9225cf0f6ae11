#!/usr/bin/env python3
"""Decode step latency and tokens/s of llep.engine per rank, for llep, DeepEP and the NCCL all-to-all baseline, at
batch sizes per rank, eager / CUDA graphs / graphs + two-batch overlap (issue #16).

Each (system, mode, batch B) is one `python3 -m llep.engine` run: B requests per rank, all running at once (max-batch
B), prompts of 1..8 tokens prefilled token by token, then --new-tokens greedy tokens. Reported per run: the median
decode step over the ranks' steps (max over ranks, ms) and tokens/s per rank = B / that median (the steady state;
the launcher's own tokens/s also counts graph capture and the tail where requests finish). A run that fails (a
system not importable, NCCL refusing two ranks on one GPU, ...) is reported with its error, never stops the others.

  python3 bench/engine_bench.py --device cuda --ranks 2 --model deepseek-v3-moe --layers 1 \\
      --batches 1 8 32 128 --systems llep deepep nccl --modes eager graphs graphs+tbo --json e.json --png e.png

Output: a table (step ms; tokens/s per rank; ratio to llep), the JSON (written after every run), a PNG (step latency vs
batch size), and beside the JSON the whole output of each failed or timed-out run (NAME.SYSTEM.MODE.B.log, "+" in MODE
as "_"), and per run every rank's sorted step times (rank_step_ms)."""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

# llep-xs: llep with the combine reduced at the expert side (llep.engine --expert-side-combine).
SYSTEMS = {'llep': ['--system', 'llep'], 'llep-xs': ['--system', 'llep', '--expert-side-combine'],
           'deepep': ['--system', 'deepep'], 'nccl': ['--system', 'nccl']}
MODES = {'eager': [], 'graphs': ['--graphs'], 'graphs+tbo': ['--graphs', '--tbo'], 'eager+tbo': ['--pad', '--tbo']}


def run_one(a, system: str, mode: str, batch: int) -> dict:
    workdir = tempfile.mkdtemp(prefix='llep-engine-bench-')
    cmd = [sys.executable, '-m', 'llep.engine', '--device', a.device, '--ranks', str(a.ranks), '--model', a.model,
           *SYSTEMS[system], '--requests', str(batch), '--max-batch', str(batch), '--new-tokens',
           str(a.new_tokens), '--workdir', workdir, *MODES[mode], *(['--layers', str(a.layers)] if a.layers else []),
           *(['--fp8'] if a.fp8 else [])]
    t0 = time.time()
    # Its own process group: a run past the time limit is killed with its rank processes, which would otherwise
    # stay behind, hung on the GPUs, and slow the next runs down.
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out = p.communicate(timeout=a.timeout)[0]
        error = '' if p.returncode == 0 else f'exit {p.returncode}'
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out = p.communicate()[0]  # what it printed until then (a hang's last words) still goes to the log
        error = f'timed out after {a.timeout} s'
    if error:
        tail = [line for line in out.splitlines() if line.strip()][-3:]
        log = ''
        if a.json:  # the whole output beside the JSON: the table keeps only its last lines
            log = f'{os.path.splitext(a.json)[0]}.{system}.{mode.replace("+", "_")}.{batch}.log'
            with open(log, 'w') as f:
                f.write(' '.join(cmd) + '\n' + out)
        return {'error': (error + ': ' + ' | '.join(tail))[-400:], 'log': log}
    ranks = [json.load(open(os.path.join(workdir, f'rank{r}.json'))) for r in range(a.ranks)]
    medians = [r['step_ms'][len(r['step_ms']) // 2] for r in ranks if r['step_ms']]
    step = max(medians)
    return {'step_ms': step, 'tokens_per_s_per_rank': batch / step * 1e3, 'steps': max(r['steps'] for r in ranks),
            'run_s': time.time() - t0, 'rank_step_ms': [r['step_ms'] for r in ranks]}


def table(a, res) -> str:
    cols = [(s, m) for s in a.systems for m in a.modes]
    head = f'{"B":>4} | ' + ' '.join(f'{s + " " + m:>24}' for s, m in cols)
    lines = [f'llep.engine decode step, {a.model}{f" ({a.layers} layers)" if a.layers else ""}, {a.ranks} ranks on '
             f'{a.device}, {"FP8" if a.fp8 else "BF16"} dispatch: median step ms / tokens/s per rank '
             f'[step ratio to llep, same mode]', head]
    for b in a.batches:
        cells = []
        for s, m in cols:
            r = res[s][m][str(b)]
            if 'error' in r:
                cells.append(f'{"failed":>24}')
                continue
            ref = res['llep'][m][str(b)] if 'llep' in res else {}
            ratio = f' [{r["step_ms"] / ref["step_ms"]:.2f}]' if 'step_ms' in ref and s != 'llep' else ''
            cells.append(f'{r["step_ms"]:.2f}/{r["tokens_per_s_per_rank"]:.0f}{ratio}'.rjust(24))
        lines.append(f'{b:>4} | ' + ' '.join(cells))
    errors = sorted({f'{s} {m}: {res[s][m][str(b)]["error"]}' for s, m in cols for b in a.batches
                     if 'error' in res[s][m][str(b)]})
    return '\n'.join(lines + [f'failed: {e}' for e in errors])


def plot(a, res, png: str) -> None:
    from plot_axes import new_axes  # bench/, the script's own folder (on sys.path when run as a script)
    axes = new_axes()
    if axes is None:
        return
    fig, ax = axes
    for s in a.systems:
        for m in a.modes:
            pts = [(b, res[s][m][str(b)]['step_ms']) for b in a.batches if 'step_ms' in res[s][m][str(b)]]
            if pts:
                ax.plot(*zip(*pts), marker='o', label=f'{s} {m}')
    ax.set_xscale('log', base=2)
    ax.set_xlabel('batch size per rank')
    ax.set_ylabel('decode step (ms, median)')
    ax.set_title(f'llep.engine, {a.model}, {a.ranks} ranks ({a.device})')
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.savefig(png, dpi=110, bbox_inches='tight')


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--device', choices=('cpu', 'cuda'), default='cuda')
    ap.add_argument('--ranks', type=int, default=2)
    ap.add_argument('--model', default='deepseek-v3-moe')
    ap.add_argument('--layers', type=int, default=0)
    ap.add_argument('--batches', type=int, nargs='+', default=[1, 8, 32, 128])
    ap.add_argument('--systems', nargs='+', choices=tuple(SYSTEMS), default=['llep', 'deepep', 'nccl'])
    ap.add_argument('--modes', nargs='+', choices=tuple(MODES), default=['eager', 'graphs', 'graphs+tbo'])
    ap.add_argument('--new-tokens', type=int, default=16)
    ap.add_argument('--fp8', action='store_true')
    ap.add_argument('--timeout', type=int, default=600, help='seconds per run')
    ap.add_argument('--json', default='')
    ap.add_argument('--png', default='')
    a = ap.parse_args(argv)
    res = {s: {m: {} for m in a.modes} for s in a.systems}
    for b in a.batches:
        for s in a.systems:
            for m in a.modes:
                res[s][m][str(b)] = r = run_one(a, s, m, b)
                print(f'{s} {m} B={b}: {r}', flush=True)
                if a.json:  # after every run: a run cut short by a time limit keeps what it measured
                    with open(a.json, 'w') as f:
                        json.dump({'args': vars(a), 'results': res}, f, indent=1)
    print(table(a, res))
    if a.png:
        plot(a, res, a.png)
    ok = sum('step_ms' in res[s][m][str(b)] for s in a.systems for m in a.modes for b in a.batches)
    return 0 if ok > 0 else 1


if __name__ == '__main__':
    sys.exit(main())
