"""bench/engine_bench.py end to end on CPU ranks (tiny config): every (system, mode, batch) it can run gives a median
step and tokens/s consistent with it, a system it cannot run (DeepEP, not installed here) is reported with its error
instead of stopping the others, a run past --timeout is reported with its output kept in a log, and the JSON holds what
the table printed. No timing is asserted (numbers come from
benchmark runs, bench/RESULTS.md)."""
import json
import os
import subprocess
import sys
import tempfile

BENCH = os.path.join(os.path.dirname(__file__), '..', '..', 'bench', 'engine_bench.py')


def test_engine_bench_runs_every_system_it_can_and_reports_the_others():
    out = os.path.join(tempfile.mkdtemp(prefix='llep-engine-bench-'), 'e.json')
    env = dict(os.environ, LLEP_FABRIC_PROVIDER=os.environ.get('LLEP_FABRIC_PROVIDER', 'tcp;ofi_rxm'))
    env.pop('LLEP_METRICS_PORT', None)
    p = subprocess.run([sys.executable, BENCH, '--device', 'cpu', '--model', 'tiny', '--batches', '1', '2',
                        '--systems', 'llep', 'nccl', 'deepep', '--modes', 'eager', 'eager+tbo', '--new-tokens', '3',
                        '--json', out], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.load(open(out))['results']
    for system in ('llep', 'nccl'):
        for mode in ('eager', 'eager+tbo'):
            for b in (1, 2):
                r = res[system][mode][str(b)]
                assert 'error' not in r, (system, mode, b, r)
                assert r['step_ms'] > 0 and abs(r['tokens_per_s_per_rank'] - b / r['step_ms'] * 1e3) < 1e-6
                assert r['steps'] >= 3
                assert len(r['rank_step_ms']) == 2 and r['step_ms'] == max(x[len(x) // 2] for x in r['rank_step_ms'])
    assert 'llep eager' in p.stdout and 'nccl eager+tbo' in p.stdout  # the table
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        assert all('deep_ep' in res['deepep'][m][str(b)]['error'] for m in ('eager', 'eager+tbo') for b in (1, 2))
        assert 'failed: deepep eager' in p.stdout


def test_engine_bench_keeps_the_output_of_a_timed_out_run():
    out = os.path.join(tempfile.mkdtemp(prefix='llep-engine-bench-'), 'e.json')
    # 200 tiny layers: the ranks start within the limit and are still decoding when it passes. The engine sizes its
    # buffer's per-layer counters to the model (Buffer(metrics_layers=...); LLEP_METRICS_LAYERS' default, 128, refused
    # layer 128 with an error when the ranks started fast).
    p = subprocess.run([sys.executable, BENCH, '--device', 'cpu', '--model', 'tiny', '--layers', '200', '--batches', '2',
                        '--systems', 'llep', '--modes', 'eager+tbo', '--timeout', '5', '--json', out],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]  # nothing measured
    r = json.load(open(out))['results']['llep']['eager+tbo']['2']
    assert r['error'].startswith('timed out after 5 s'), r
    cmd = open(r['log']).readline().split()
    assert r['log'].endswith('e.llep.eager_tbo.2.log') and cmd[1:3] == ['-m', 'llep.engine']
    # its rank processes (their command lines hold the run's --workdir) were killed with it: left behind, they would
    # hold the GPUs and slow the next runs down
    workdir = cmd[cmd.index('--workdir') + 1]
    left = subprocess.run(['pgrep', '-f', workdir], capture_output=True, text=True)
    assert left.stdout == '', left.stdout
