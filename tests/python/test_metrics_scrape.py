"""The Prometheus exporter of a Python-created Buffer, scraped while calls run (issue #15).

Two ranks run dispatch + combine rounds over several MoE layers (the `layer` keyword) while a thread of each rank
scrapes its own exporter 1,000 times over HTTP. Every scrape must parse; every llep_expert_recv_tokens_total and
llep_ops_total series must never go down between scrapes (no torn or reset counter); each scrape must answer within
a bound. After the calls stop, the exporter must serve per (layer, expert) counts equal to the routed counts, exactly,
and the snapshot tensor [layers, local experts] must hold the same numbers.

On the GPU machine the first scrape of such an exporter used to kill both processes (SIGSEGV in prometheus-cpp's
serializer, which had bound to the module's copy of the C++ runtime); CI runs it on the CPU backend, the GPU test
script as `python3 tests/python/test_metrics_scrape.py --device cuda`.
"""
import argparse
import datetime
import json
import os
import re
import statistics
import sys
import threading
import time
import urllib.request

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import llep
from llep.utils import free_port

R, T, H, E, K = 2, 8, 1024, 16, 4
LAYERS = 3
SCRAPES = 1000
SERIES = re.compile(r'^(llep_expert_recv_tokens_total|llep_ops_total)\{([^}]*)\} ([0-9.e+]+)$')
LABEL = re.compile(r'(\w+)="([^"]*)"')



def _routing(rank, call):
    """The top-k ids rank `rank` sends in call number `call` (every rank can recompute any rank's), with holes."""
    g = torch.Generator().manual_seed(1000 * call + rank)
    topk = torch.topk(torch.rand((T, E), generator=g), K, dim=-1).indices.to(torch.int64)
    topk[torch.rand((T, K), generator=g) < 0.1] = -1
    return topk


def _parse(text):
    """{(name, ((label, value), ...)): value} of the series the test watches; raises on a malformed line."""
    out = {}
    for line in text.splitlines():
        if not line.startswith(('llep_expert_recv_tokens_total{', 'llep_ops_total{')):
            continue
        m = SERIES.match(line)
        if m is None:
            raise AssertionError(f'malformed sample line: {line!r}')
        labels = tuple(sorted(LABEL.findall(m.group(2))))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def _scrape(port):
    t0 = time.perf_counter()
    with urllib.request.urlopen(f'http://127.0.0.1:{port}/metrics', timeout=30) as r:
        body = r.read().decode()
    return body, time.perf_counter() - t0


def _scraper(port, result):
    """SCRAPES scrapes as fast as the exporter answers; records latencies and any counter that went down."""
    last, latencies, errors = {}, [], []
    try:
        for i in range(SCRAPES):
            body, dt = _scrape(port)
            latencies.append(dt)
            for key, v in _parse(body).items():
                if v < last.get(key, 0.0):
                    errors.append(f'scrape {i}: {key} went down from {last[key]} to {v}')
                last[key] = v
    except Exception as e:  # reported by the main thread
        errors.append(f'scrape failed: {type(e).__name__}: {e}')
    result.update(latencies=latencies, errors=errors)


def _worker(rank, port, device, out_dir, R):  # R: the ranks (module default 2; --ranks)
    os.environ.setdefault('LLEP_TIMEOUT_S', '60')
    if device == 'cuda':
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=R,
                            timeout=datetime.timedelta(seconds=120))
    buf = llep.Buffer(dist.group.WORLD, num_rdma_bytes=llep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E),
                      low_latency_mode=True, explicitly_destroy=True)
    buf.backend = 'cuda' if device == 'cuda' else 'cpu'
    buf.clean_low_latency_buffer(T, H, E)
    dev = torch.device(device)
    metrics_port = buf.start_metrics_exporter(port=0, interval_s=0.005, labels={'model_name': 'scrape'})
    result = {}
    scraper = threading.Thread(target=_scraper, args=(metrics_port, result))
    scraper.start()

    E_loc = E // R
    want = torch.zeros((LAYERS, E_loc), dtype=torch.int64)
    x = torch.randn((T, H), dtype=torch.bfloat16, device=dev)
    w = torch.rand((T, K), device=dev) + 0.1
    calls, done = 0, torch.zeros(1, dtype=torch.int32)
    while True:  # calls until every rank's scraper finished (the ranks agree each round, so calls stay collective)
        layer = calls % LAYERS
        topk = _routing(rank, calls).to(dev)
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, topk, T, E, use_fp8=False, layer=layer)
        buf.low_latency_combine(recv_x, topk, w, handle)
        for src in range(R):
            ids = _routing(src, calls)
            mine = ids[(ids >= 0) & (ids // E_loc == rank)] - rank * E_loc
            want[layer] += torch.bincount(mine, minlength=E_loc)
        calls += 1
        done[0] = 0 if scraper.is_alive() else 1
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done[0] == 1 and calls >= 2 * LAYERS:
            break
    scraper.join()
    errors = list(result['errors'])

    # The snapshot (flushed: the GPU bins a call's latencies at its next receive) and then the exporter, exactly.
    snap = buf.metrics_snapshot()
    per_layer = snap['layer_expert_recv_tokens']
    if not torch.equal(per_layer[:LAYERS], want) or per_layer[LAYERS:].any():
        errors.append(f'snapshot per layer {per_layer[:LAYERS + 1].tolist()} != routed {want.tolist()}')
    if snap['ops'] != {'dispatch': calls, 'combine': calls}:
        errors.append(f'snapshot ops {snap["ops"]}, made {calls} of each')
    expected = {}
    for layer in range(LAYERS):
        for le in range(E_loc):
            labels = (('expert', str(rank * E_loc + le)), ('layer', str(layer)), ('local_expert', str(le)),
                      ('model_name', 'scrape'), ('rank', str(rank)))
            expected[('llep_expert_recv_tokens_total', labels)] = float(want[layer, le])
    got = {}
    deadline = time.time() + 10  # the collector thread publishes every 5 ms
    while time.time() < deadline:
        series = _parse(_scrape(metrics_port)[0])
        got = {k: v for k, v in series.items() if k[0] == 'llep_expert_recv_tokens_total'}
        if got == expected:
            break
        time.sleep(0.02)
    if got != expected:
        diff = sorted((k[1], got.get(k), expected.get(k)) for k in set(got) | set(expected)
                      if got.get(k) != expected.get(k))
        errors.append(f'exporter per (layer, expert) differs from the routed counts: {diff[:6]}')
    buf.stop_metrics_exporter()
    lat = sorted(result['latencies'])
    stats = {'scrapes': len(lat), 'calls': calls}
    if len(lat) != SCRAPES:
        errors.append(f'{len(lat)} of {SCRAPES} scrapes answered')
    else:
        stats.update(median_ms=round(statistics.median(lat) * 1e3, 2), p99_ms=round(lat[int(0.99 * len(lat))] * 1e3, 2),
                     max_ms=round(lat[-1] * 1e3, 2))
        # Bounded: a scrape serialises a few hundred series; on a loaded 2-core CI machine it takes milliseconds.
        if lat[int(0.99 * len(lat))] > 1.0 or lat[-1] > 5.0:
            errors.append(f'scrape latency unbounded: {stats}')
    with open(os.path.join(out_dir, f'rank{rank}.txt'), 'w') as f:
        json.dump({'errors': errors, 'stats': stats}, f)
    buf.destroy()
    dist.destroy_process_group()


def run(device, out_dir, ranks=R):
    mp.spawn(_worker, args=(free_port(), device, out_dir, ranks), nprocs=ranks, join=True)
    results = [json.load(open(os.path.join(out_dir, f'rank{r}.txt'))) for r in range(ranks)]
    for r, res in enumerate(results):
        print(f'rank {r}: {res["stats"]}')
    errors = [f'rank {r}: {e}' for r, res in enumerate(results) for e in res['errors']]
    return errors


def test_scrape_python_exporter_under_load(tmp_path):
    errors = run('cpu', str(tmp_path))
    assert not errors, '\n'.join(errors[:10])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--device', default='cpu', choices=('cpu', 'cuda'))
    ap.add_argument('--ranks', type=int, default=R, help=f'ranks (divide {E} experts; default {R})')
    args = ap.parse_args()
    if args.ranks < 1 or E % args.ranks:
        ap.error(f'--ranks must divide the {E} experts')
    if args.device == 'cuda' and not (torch.cuda.is_available() and getattr(llep._llep, 'HAVE_CUDA', False)):
        print('metrics scrape test: SKIPPED (no CUDA device or llep built without CUDA)')
        return 0
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        errors = run(args.device, d, args.ranks)
    for e in errors:
        print('FAIL', e)
    print(f'metrics scrape test ({args.device}, {args.ranks} ranks, {SCRAPES} scrapes each): '
          f'{"PASS" if not errors else "FAIL"}')
    return 1 if errors else 0


if __name__ == '__main__':
    sys.exit(main())
