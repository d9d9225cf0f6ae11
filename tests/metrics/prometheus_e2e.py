#!/usr/bin/env python3
"""A real Prometheus scrapes llep's exporters: 4 CPU-backend ranks (llep.Buffer over gloo, libfabric shm) run
dispatch + combine with known routing and serve /metrics on loopback; a Debian `prometheus` server scrapes them;
its HTTP API must report, per rank and expert, exactly the routed token counts, and histogram counts equal to the
number of operations. Everything binds 127.0.0.1 and the test stops by itself (deadline on every wait).

Usage: prometheus_e2e.py [--prometheus PATH]   (exit 0 = pass)"""
import argparse
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

R, T, H, E, K, ITERS = 4, 16, 2048, 32, 4, 6
DEADLINE_S = 120


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _routing(rank, it):
    import torch
    g = torch.Generator().manual_seed(1000 * it + rank)
    n = T - (it % 3)
    topk = torch.topk(torch.rand((n, E), generator=g), K, dim=-1).indices.to(torch.int64)
    topk.view(-1)[torch.randint(0, n * K, (2,), generator=g)] = -1
    return topk


def _rank(rank, port, workdir):
    import torch
    import torch.distributed as dist
    import llep
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=R,
                            timeout=datetime.timedelta(seconds=60))
    buf = llep.Buffer(dist.group.WORLD, low_latency_mode=True, explicitly_destroy=True)
    buf.backend = 'cpu'
    for it in range(ITERS):
        topk = _routing(rank, it)
        x = torch.ones((topk.size(0), H), dtype=torch.bfloat16)
        w = torch.full(topk.shape, 0.5)
        recv, count, handle, _, hook = buf.low_latency_dispatch(x, topk, T, E, use_fp8=False, return_recv_hook=True)
        hook()
        buf.low_latency_combine(recv, topk, w, handle)
    E_loc = E // R
    expected = [0] * E_loc
    for src in range(R):
        for it in range(ITERS):
            for g in _routing(src, it).flatten().tolist():
                if g >= 0 and g // E_loc == rank:
                    expected[g % E_loc] += 1
    mport = buf.start_metrics_exporter(port=0, labels={'model_name': 'e2e', 'engine': 'llep-test'}, interval_s=0.2)
    time.sleep(0.5)  # one collection after the last operation
    with open(os.path.join(workdir, f'rank{rank}.json.tmp'), 'w') as f:
        json.dump({'port': mport, 'expected': expected, 'ops': ITERS}, f)
    os.rename(os.path.join(workdir, f'rank{rank}.json.tmp'), os.path.join(workdir, f'rank{rank}.json'))
    stop = os.path.join(workdir, 'stop')
    t0 = time.time()
    while not os.path.exists(stop) and time.time() - t0 < DEADLINE_S:
        time.sleep(0.1)
    buf.stop_metrics_exporter()
    buf.destroy()
    dist.destroy_process_group()


def _query(api, promql):
    url = f'{api}/api/v1/query?' + urllib.parse.urlencode({'query': promql})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    if body.get('status') != 'success':
        raise RuntimeError(f'query {promql}: {body}')
    return body['data']['result']


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
        port = _free_port()
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
        with open(os.path.join(workdir, 'prometheus.yml'), 'w') as f:
            f.write('global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: llep\n'
                    f'    metrics_path: /metrics\n    static_configs:\n      - targets: [{targets}]\n')
        prom_port = _free_port()
        api = f'http://127.0.0.1:{prom_port}'
        prom = subprocess.Popen([a.prometheus, f'--config.file={workdir}/prometheus.yml',
                                 f'--storage.tsdb.path={workdir}/tsdb', f'--web.listen-address=127.0.0.1:{prom_port}'],
                                stdout=subprocess.DEVNULL, stderr=open(os.path.join(workdir, 'prometheus.log'), 'w'))
        # Wait until every target was scraped (up == 1 for all four).
        t0 = time.time()
        while True:
            try:
                up = _query(api, 'up{job="llep"}')
                if len(up) == R and all(s['value'][1] == '1' for s in up):
                    break
            except OSError:
                pass
            if time.time() - t0 > DEADLINE_S or prom.poll() is not None:
                raise RuntimeError('Prometheus never scraped all exporters: ' +
                                   open(os.path.join(workdir, 'prometheus.log')).read()[-2000:])
            time.sleep(0.5)
        E_loc = E // R
        got = {}
        for s in _query(api, 'llep_expert_recv_tokens_total{job="llep", model_name="e2e"}'):
            m = s['metric']
            got[(int(m['rank']), int(m['local_expert']))] = (int(m['expert']), float(s['value'][1]))
        for r in range(R):
            for le in range(E_loc):
                want = infos[r]['expected'][le]
                g, v = got.get((r, le), (None, None))
                if v != want or g != r * E_loc + le:
                    failures.append(f'rank {r} expert {le}: Prometheus has {v} (expert id {g}), routed {want}')
        hist = _query(api, 'llep_op_latency_seconds_count{job="llep"}')
        if len(hist) != R * 2 * 3:
            failures.append(f'{len(hist)} latency histogram series, expected {R * 2 * 3}')
        for s in hist:
            if float(s['value'][1]) != ITERS:
                failures.append(f'histogram count {s["value"][1]} != {ITERS} operations for {s["metric"]}')
        for s in _query(api, 'llep_ops_total{job="llep"}'):
            if float(s['value'][1]) != ITERS:
                failures.append(f'llep_ops_total {s["value"][1]} != {ITERS} for {s["metric"]}')
        inf = _query(api, 'llep_op_latency_seconds_bucket{job="llep", le="+Inf"}')
        if len(inf) != R * 2 * 3 or any(float(s['value'][1]) != ITERS for s in inf):
            failures.append('+Inf buckets do not equal the operation counts')
        sent = _query(api, 'sum(llep_dispatch_tokens_total{job="llep"})')
        routed = sum(sum(i['expected']) for i in infos.values())
        if not sent or float(sent[0]['value'][1]) != routed:
            failures.append(f'dispatched selections {sent} != received {routed}')
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
    print(f'prometheus_e2e: PASS ({R} ranks x {E // R} experts exact, {R * 6} histograms with {ITERS} ops each)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
