#!/usr/bin/env python3
"""A real Prometheus scrapes llep's exporters: 4 CPU-backend ranks (llep.Buffer over gloo, libfabric shm) run
dispatch + combine with known routing over several MoE layers (the dispatch's `layer` keyword) and serve /metrics on
loopback; a Debian `prometheus` server scrapes them with the project's recording rules loaded. Its HTTP API must
report, per rank, layer and expert, exactly the routed token counts, and histogram counts equal to the number of
operations (each operation also reported as an engine's decode step, for the engine panels); then every query of the Grafana dashboard (metrics/grafana/llep_dashboard.json) is run against it and
must return data, and the per-layer ones must show what the routing implies: the layer x expert heatmap the load of
the traffic phase per (layer, expert) (zero where nothing was routed), the per-layer imbalance panel max/mean per
layer (layer 1's routing is skewed on purpose, layer 0's is not). Everything binds 127.0.0.1 and the test stops by
itself (deadline on every wait).

Phases: each rank dispatches once per layer before its exporter starts (so every layer's series exist from the first
scrape: Prometheus counts increases only between samples), Prometheus scrapes that baseline, then the ranks run the
traffic phase. increase()/rate() extrapolate to the window's ends, so a rate-based value is the traffic count times a
factor between 1 and window / (time between the series' first and last samples in it), read from the samples
themselves; each heatmap cell must equal its one series' increase, each imbalance ratio max/mean of its layer's.

Usage: prometheus_e2e.py [--prometheus PATH]   (exit 0 = pass)"""
import argparse
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

from llep.utils import free_port  # the ranks import llep from the same PYTHONPATH

R, T, H, E, K, ITERS, LAYERS = 4, 16, 2048, 32, 4, 6, 2
E_LOC = E // R
DEADLINE_S = 120
HERE = os.path.dirname(os.path.abspath(__file__))
DASHBOARD = os.path.join(HERE, '..', '..', 'metrics', 'grafana', 'llep_dashboard.json')
RULES = os.path.join(HERE, '..', '..', 'metrics', 'prometheus', 'llep_rules.yml')



def _routing(rank, it, layer):
    """Top-k of (rank, round, layer). Layer 1 favours experts 0..5 (skewed load), layer 0 is uniform."""
    import torch
    g = torch.Generator().manual_seed(1000 * it + 10 * layer + rank)
    n = T - (it % 3)
    scores = torch.rand((n, E), generator=g)
    if layer == 1:
        scores[:, :6] += 0.6
    topk = torch.topk(scores, K, dim=-1).indices.to(torch.int64)
    topk.view(-1)[torch.randint(0, n * K, (2,), generator=g)] = -1
    return topk


WARMUP = [(-1, layer) for layer in range(LAYERS)]  # (round, layer): one dispatch per layer before the exporter
TRAFFIC = [(it, it % LAYERS) for it in range(ITERS)]


def _received(rank, calls):
    """[layer][local expert] tokens this rank receives over `calls` (every rank's routing)."""
    got = [[0] * E_LOC for _ in range(LAYERS)]
    for src in range(R):
        for it, layer in calls:
            for g in _routing(src, it, layer).flatten().tolist():
                if g >= 0 and g // E_LOC == rank:
                    got[layer][g % E_LOC] += 1
    return got


def _wait_file(path, what):
    t0 = time.time()
    while not os.path.exists(path):
        if time.time() - t0 > DEADLINE_S:
            raise RuntimeError(f'timed out waiting for {what}')
        time.sleep(0.05)


def _rank(rank, port, workdir):
    import torch
    import torch.distributed as dist
    import llep
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=R,
                            timeout=datetime.timedelta(seconds=60))
    buf = llep.Buffer(dist.group.WORLD, low_latency_mode=True, explicitly_destroy=True)
    buf.backend = 'cpu'

    def run(calls):
        for it, layer in calls:
            topk = _routing(rank, it, layer)
            x = torch.ones((topk.size(0), H), dtype=torch.bfloat16)
            w = torch.full(topk.shape, 0.5)
            recv, count, handle, _, hook = buf.low_latency_dispatch(x, topk, T, E, use_fp8=False,
                                                                     return_recv_hook=True, layer=layer)
            hook()
            buf.low_latency_combine(recv, topk, w, handle)
            # as an engine reports its decode steps (a no-op before the exporter starts): the engine panels' series
            buf.observe_decode_step(0.001 * (1 + it % 3), topk.size(0))

    def publish(name, info):
        with open(os.path.join(workdir, f'{name}.tmp'), 'w') as f:
            json.dump(info, f)
        os.rename(os.path.join(workdir, f'{name}.tmp'), os.path.join(workdir, name))

    run(WARMUP)
    mport = buf.start_metrics_exporter(port=0, labels={'model_name': 'e2e', 'engine': 'llep-test'}, interval_s=0.2)
    publish(f'rank{rank}.json', {'port': mport})
    _wait_file(os.path.join(workdir, 'go'), 'the baseline scrape')
    run(TRAFFIC)
    time.sleep(0.5)  # one collection after the last operation
    publish(f'done{rank}.json', {'ops': len(WARMUP) + len(TRAFFIC)})
    _wait_file(os.path.join(workdir, 'stop'), 'the end of the test')
    buf.stop_metrics_exporter()
    buf.destroy()
    dist.destroy_process_group()


def _query(api, promql, at=None):
    """An instant query's result (evaluated now, or at the Unix time `at`)."""
    params = {'query': promql} if at is None else {'query': promql, 'time': f'{at:.3f}'}
    url = f'{api}/api/v1/query?' + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    if body.get('status') != 'success':
        raise RuntimeError(f'query {promql}: {body}')
    return body['data']['result']


def _poll(api, promql, done, what):
    """Queries until done(result) holds (Prometheus scrapes every second)."""
    t0 = time.time()
    while True:
        try:
            result = _query(api, promql)
            if done(result):
                return result
        except OSError:
            pass
        if time.time() - t0 > DEADLINE_S:
            raise RuntimeError(f'timed out waiting for {what}')
        time.sleep(0.25)


def _dashboard_queries():
    """(panel title, expr) of every target of the Grafana dashboard."""
    with open(DASHBOARD) as f:
        d = json.load(f)
    return [(p['title'], t['expr']) for p in d['panels'] for t in p.get('targets', []) if t.get('expr')]


def _check_dashboard(api, window_s, traffic, failures):
    """Every dashboard query returns data; the per-layer heatmap and imbalance panels match the traffic phase."""
    subst = {'$model_name': 'e2e', '$layer': '.*', '$__rate_interval': f'{window_s}s', '$__range': f'{window_s}s'}
    at = time.time()  # every query below is evaluated at the same instant (the windows' ends)
    heatmap = imbalance = None
    for title, expr in _dashboard_queries():
        for k, v in subst.items():
            expr = expr.replace(k, v)
        result = _query(api, expr, at)
        if not result:
            failures.append(f'dashboard panel "{title}": no data for {expr}')
        if title.startswith('Layer x expert load'):
            heatmap = result
        elif title.startswith('Imbalance per layer'):
            imbalance = result
    if heatmap is None or imbalance is None:
        failures.append('the dashboard has no layer x expert heatmap or per-layer imbalance panel')
        return
    # Heatmap: one cell per (layer, global expert), equal to that one series' increase over the window, and zero
    # exactly where nothing was routed. The series' samples in the window go from the baseline scrape to one after
    # the traffic, so their difference is the traffic count exactly; increase() extrapolates it towards the window's
    # ends by a factor between 1 and window / (time between those samples), which depends on the scrape times (a
    # fixed bound of 1.6 failed now and then), so that is the range each cell must lie in.
    key_of = lambda s: (int(s['metric']['layer']), int(s['metric']['expert']))  # noqa: E731
    cells = {key_of(s): float(s['value'][1]) for s in heatmap}
    raw = {key_of(s): float(s['value'][1]) for s in _query(
        api, f'increase(llep_expert_recv_tokens_total{{job="llep", model_name="e2e"}}[{window_s}s])', at)}
    samples = {key_of(s): [(float(t), float(v)) for t, v in s['values']] for s in _query(
        api, f'llep_expert_recv_tokens_total{{job="llep", model_name="e2e"}}[{window_s}s]', at)}
    stretch = {}  # the largest extrapolation factor increase() may apply to each series
    if len(cells) != LAYERS * E:
        failures.append(f'heatmap has {len(cells)} cells, expected {LAYERS} layers x {E} experts')
    for r in range(R):
        for layer in range(LAYERS):
            for le in range(E_LOC):
                key = (layer, r * E_LOC + le)
                want, got, ss = traffic[r][layer][le], cells.get(key), samples.get(key, [])
                delta = ss[-1][1] - ss[0][1] if len(ss) >= 2 else None
                stretch[key] = window_s / (ss[-1][0] - ss[0][0]) if len(ss) >= 2 else float('inf')
                ok = (got is not None and delta == want and
                      (got == 0 if want == 0 else want * (1 - 1e-9) <= got <= want * stretch[key] * (1 + 1e-9)))
                if not ok or raw.get(key) is None or abs(got - raw[key]) > 1e-9 * max(1.0, got):
                    failures.append(f'heatmap layer {layer} expert {key[1]}: {got} (its series: {raw.get(key)}, '
                                    f'{delta} between its samples in the window, stretch up to '
                                    f'{stretch[key]:.3f}), routed {want} in the traffic phase')
    # Imbalance: max / mean over the E experts of each layer. Exactly (1e-9) that of the layer's series' increases at
    # the same instant; and, as each series' increase is its traffic count times its own factor in [1, stretch], within
    # the layer's largest stretch of the routing's max / mean either way.
    got = {int(s['metric']['layer']): float(s['value'][1]) for s in imbalance}
    for layer in range(LAYERS):
        series = [raw.get((layer, e), 0.0) for e in range(E)]
        exact = max(series) / (sum(series) / len(series)) if sum(series) > 0 else float('nan')
        loads = [traffic[r][layer][le] for r in range(R) for le in range(E_LOC)]
        routed = max(loads) / (sum(loads) / len(loads))
        v = got.get(layer)
        f = max(stretch.get((layer, e), float('inf')) for e in range(E))
        if v is None or not math.isfinite(v) or abs(v - exact) > 1e-9 * exact or not routed / f <= v <= routed * f:
            failures.append(f'imbalance of layer {layer}: Prometheus {v}, its series imply {exact:.6f}, the routing '
                            f'{routed:.3f} (x/÷ {f:.3f} for the extrapolation)')
    if len(got) == LAYERS and not got[1] > 1.5 * got[0]:
        failures.append(f'the skewed layer 1 ({got[1]:.3f}) does not stand out of layer 0 ({got[0]:.3f})')


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--prometheus', default=shutil.which('prometheus') or '/usr/bin/prometheus')
    ap.add_argument('--rank', type=int, help=argparse.SUPPRESS)
    ap.add_argument('--port', type=int, help=argparse.SUPPRESS)
    ap.add_argument('--workdir', help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank is not None:  # a rank process
        _rank(a.rank, a.port, a.workdir)
        return 0
    if not os.path.exists(a.prometheus):
        print(f'prometheus_e2e: FAIL: no Prometheus server at {a.prometheus} (scripts/install_deps.sh installs it)')
        return 1
    workdir = tempfile.mkdtemp(prefix='llep-prom-')
    ranks, prom = [], None
    failures = []
    try:
        port = free_port()
        ranks = [subprocess.Popen([sys.executable, __file__, '--rank', str(r), '--port', str(port), '--workdir',
                                   workdir]) for r in range(R)]
        infos = {}
        t0 = time.time()
        while len(infos) < R:
            if time.time() - t0 > DEADLINE_S or any(p.poll() not in (None, 0) for p in ranks):
                raise RuntimeError('ranks did not start their exporters')
            for r in range(R):
                path = os.path.join(workdir, f'rank{r}.json')
                if r not in infos and os.path.exists(path):
                    infos[r] = json.load(open(path))
            time.sleep(0.1)
        targets = ', '.join(f"'127.0.0.1:{infos[r]['port']}'" for r in range(R))
        shutil.copy(RULES, os.path.join(workdir, 'llep_rules.yml'))
        with open(os.path.join(workdir, 'prometheus.yml'), 'w') as f:
            f.write('global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - llep_rules.yml\n'
                    'scrape_configs:\n  - job_name: llep\n'
                    f'    metrics_path: /metrics\n    static_configs:\n      - targets: [{targets}]\n')
        prom_port = free_port()
        api = f'http://127.0.0.1:{prom_port}'
        t_prom = time.time()
        prom = subprocess.Popen([a.prometheus, f'--config.file={workdir}/prometheus.yml',
                                 f'--storage.tsdb.path={workdir}/tsdb', f'--web.listen-address=127.0.0.1:{prom_port}'],
                                stdout=subprocess.DEVNULL, stderr=open(os.path.join(workdir, 'prometheus.log'), 'w'))
        # Baseline: every target scraped with every layer's series (the warm-up dispatches), twice.
        _poll(api, 'up{job="llep"}', lambda up: len(up) == R and all(s['value'][1] == '1' for s in up),
              'Prometheus to scrape all exporters')
        _poll(api, 'count(count_over_time(llep_expert_recv_tokens_total{job="llep"}[1m]) >= 2)',
              lambda res: res and int(float(res[0]['value'][1])) == R * LAYERS * E_LOC,
              f'{R * LAYERS * E_LOC} per-(layer, expert) series scraped twice')
        open(os.path.join(workdir, 'go'), 'w').close()
        for r in range(R):
            _wait_file(os.path.join(workdir, f'done{r}.json'), f'rank {r} to finish its calls')
        ops = len(WARMUP) + len(TRAFFIC)
        _poll(api, 'min(llep_ops_total{job="llep"})', lambda res: res and float(res[0]['value'][1]) == ops,
              'the last collection to be scraped')
        time.sleep(1.5)  # one more scrape of the final values: the windows below end after it
        # Raw counters: per (rank, layer, local expert), warm-up plus traffic, exactly.
        total = {r: _received(r, WARMUP + TRAFFIC) for r in range(R)}
        got = {}
        for s in _query(api, 'llep_expert_recv_tokens_total{job="llep", model_name="e2e"}'):
            m = s['metric']
            got[(int(m['rank']), int(m['layer']), int(m['local_expert']))] = (int(m['expert']), float(s['value'][1]))
        if len(got) != R * LAYERS * E_LOC:
            failures.append(f'{len(got)} llep_expert_recv_tokens_total series, expected {R * LAYERS * E_LOC}')
        for r in range(R):
            for layer in range(LAYERS):
                for le in range(E_LOC):
                    want = total[r][layer][le]
                    g, v = got.get((r, layer, le), (None, None))
                    if v != want or g != r * E_LOC + le:
                        failures.append(f'rank {r} layer {layer} expert {le}: Prometheus has {v} (expert id {g}), '
                                        f'routed {want}')
        hist = _query(api, 'llep_op_latency_seconds_count{job="llep"}')
        if len(hist) != R * 2 * 3:
            failures.append(f'{len(hist)} latency histogram series, expected {R * 2 * 3}')
        for s in hist:
            if float(s['value'][1]) != ops:
                failures.append(f'histogram count {s["value"][1]} != {ops} operations for {s["metric"]}')
        for s in _query(api, 'llep_ops_total{job="llep"}'):
            if float(s['value'][1]) != ops:
                failures.append(f'llep_ops_total {s["value"][1]} != {ops} for {s["metric"]}')
        inf = _query(api, 'llep_op_latency_seconds_bucket{job="llep", le="+Inf"}')
        if len(inf) != R * 2 * 3 or any(float(s['value'][1]) != ops for s in inf):
            failures.append('+Inf buckets do not equal the operation counts')
        sent = _query(api, 'sum(llep_dispatch_tokens_total{job="llep"})')
        routed = sum(sum(map(sum, t)) for t in total.values())
        if not sent or float(sent[0]['value'][1]) != routed:
            failures.append(f'dispatched selections {sent} != received {routed}')
        # The dashboard, over a window that starts before the first scrape (so it holds the whole traffic phase).
        _check_dashboard(api, int(time.time() - t_prom) + 10, {r: _received(r, TRAFFIC) for r in range(R)},
                         failures)
        if not _poll(api, 'llep:expert_load_imbalance:5m', lambda res: bool(res), 'the recording rule'):
            failures.append('the recording rule llep:expert_load_imbalance:5m has no value')
    except Exception as e:  # noqa: BLE001 - report any failure as the test result
        failures.append(f'{type(e).__name__}: {e}')
    finally:
        open(os.path.join(workdir, 'stop'), 'w').close()
        if prom is not None:
            prom.terminate()
            try:
                prom.wait(timeout=20)
            except subprocess.TimeoutExpired:
                prom.kill()
        for p in ranks:
            try:
                if p.wait(timeout=60) != 0:
                    failures.append(f'rank process exited with {p.returncode}')
            except subprocess.TimeoutExpired:
                p.kill()
                failures.append('rank process did not exit')
        shutil.rmtree(workdir, ignore_errors=True)
    if failures:
        print('prometheus_e2e: FAIL\n  ' + '\n  '.join(failures[:20]))
        return 1
    print(f'prometheus_e2e: PASS ({R} ranks x {LAYERS} layers x {E_LOC} experts exact, {R * 6} histograms with {ops} '
          f'ops each, {len(_dashboard_queries())} dashboard queries with data, per-layer heatmap and imbalance as '
          'routed)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
