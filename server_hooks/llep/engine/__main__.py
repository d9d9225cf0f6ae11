"""python3 -m llep.engine: serve a batch of random decode requests on R rank processes (one per GPU, or CPU ranks over
llep's CPU backend), MoE layers expert-parallel over one low-latency Buffer, and optionally check every request's
greedy tokens against a single-process dense reference of the same weights.

  python3 -m llep.engine --ranks 2 --device cpu --model tiny --requests 8 --new-tokens 32 --check
  python3 -m llep.engine --ranks 2 --device cuda --model deepseek-v3-moe --layers 2 --max-batch 64

Each rank writes its requests' tokens and step times to --workdir/rank{r}.json; the launcher prints tokens/s per rank
and, with --check, PASS or the first request whose tokens differ (exit status 1)."""
import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog='python3 -m llep.engine', description=__doc__.split('\n')[0])
    ap.add_argument('--ranks', type=int, default=2)
    ap.add_argument('--device', choices=('cpu', 'cuda'), default='cuda' if torch.cuda.is_available() else 'cpu')
    ap.add_argument('--system', choices=('llep', 'deepep', 'nccl'), default='llep',
                    help='what carries the MoE layers: llep\'s Buffer, DeepEP\'s, or torch.distributed all_to_all_single '
                         '(NCCL on GPUs, gloo on CPU ranks; a2a_moe.py)')
    ap.add_argument('--model', default='tiny', help='tiny or deepseek-v3-moe')
    ap.add_argument('--layers', type=int, default=0, help='MoE layers (default: the config\'s)')
    ap.add_argument('--weights', default='', help='a directory of .safetensors files (default: random weights)')
    ap.add_argument('--seed', type=int, default=0)
    ap.add_argument('--requests', type=int, default=8, help='requests per rank')
    ap.add_argument('--new-tokens', type=int, default=32)
    ap.add_argument('--max-batch', type=int, default=4, help='running requests per rank (the Buffer\'s T)')
    ap.add_argument('--fp8', action='store_true', help='FP8 dispatch (default BF16)')
    ap.add_argument('--no-hooks', action='store_true', help='dispatch/combine without receive hooks')
    ap.add_argument('--graphs', action='store_true', help='one CUDA graph per batch size 1, 2, 4, ... max-batch')
    ap.add_argument('--pad', action='store_true', help='pad batches to those sizes without graphs (CPU ranks)')
    ap.add_argument('--tbo', action='store_true', help='two-batch overlap: each step as two interleaved micro-batches')
    ap.add_argument('--metrics-port', type=int, default=-1,
                    help='llep: each rank\'s Prometheus exporter on this port + rank (0: any free port), with the '
                         'engine\'s decode step latency and token counter beside the communication metrics')
    ap.add_argument('--expert-side-combine', action='store_true',
                    help='llep: dispatch carries the topk weights (combine_weights) and the combine is reduced at the '
                         'experts\' ranks (the reference follows that order)')
    ap.add_argument('--check', action='store_true', help='compare with the dense single-process reference')
    ap.add_argument('--workdir', default='')
    ap.add_argument('--rank', type=int, default=-1, help=argparse.SUPPRESS)  # set for the rank processes
    ap.add_argument('--port', type=int, default=0, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _weights(a, cfg, experts=None):
    from .weights import init_weights, load_safetensors
    if a.weights:
        return load_safetensors(a.weights, cfg, experts)
    return init_weights(cfg, a.seed, experts, device='cuda' if a.device == 'cuda' else 'cpu')


def buffer_tokens(max_batch: int, ranks: int) -> int:
    """The Buffer's tokens per rank for a batch of up to max_batch: rounded up so that ranks * T is a multiple of 4,
    which llep and DeepEP require (the column-major scale tensor's 16-byte stride), e.g. 2 for one token on 2 ranks."""
    step = 4 // math.gcd(ranks, 4)
    return -(-max_batch // step) * step


def _buffer(a, cfg, group, T):
    R = a.ranks
    if a.system == 'llep':
        import llep
        hint = llep.Buffer.get_low_latency_rdma_size_hint(T, cfg.hidden, R, cfg.num_experts)
        # The per-layer receive counters sized to the model: every MoE layer's `layer=` is counted apart.
        buf = llep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, explicitly_destroy=True,
                          metrics_layers=cfg.num_layers)
        buf.backend = a.device
        return buf
    import deep_ep
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, cfg.hidden, R, cfg.num_experts)
    return deep_ep.Buffer(group, 0, hint, low_latency_mode=True, num_qps_per_rank=max(1, cfg.num_experts // R),
                          explicitly_destroy=True)


def _sample(text: str, name: str) -> float:
    """The sum of the samples of `name` (any labels) in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + '{') or line.startswith(name + ' '):
            total += float(line.rsplit(' ', 1)[1])
    return total


def _llep_options() -> dict:
    from llep import _llep
    return _llep.read_options()


def _rank_main(a) -> None:
    import torch.distributed as dist
    from .config import ModelConfig
    from .engine import Engine, make_requests
    from .model import Model
    from .moe import EpMoE
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{a.port}', rank=a.rank, world_size=a.ranks,
                            timeout=datetime.timedelta(seconds=300))
    group = dist.group.WORLD
    if a.device == 'cuda':
        torch.cuda.set_device(a.rank % torch.cuda.device_count())  # ranks share a GPU when there are fewer
    dev = torch.device(a.device, torch.cuda.current_device()) if a.device == 'cuda' else torch.device('cpu')
    from .experts import set_exact
    set_exact(a.check)
    cfg = ModelConfig.named(a.model, a.layers)
    E_loc = cfg.num_experts // a.ranks
    weights = _weights(a, cfg, range(a.rank * E_loc, (a.rank + 1) * E_loc))
    T = buffer_tokens(a.max_batch, a.ranks)
    buf = _buffer(a, cfg, group, T) if a.system != 'nccl' else None
    exporter = a.system == 'llep' and a.metrics_port >= 0
    if exporter:
        buf.clean_low_latency_buffer(T, cfg.hidden, cfg.num_experts)  # the layout the metrics count on
        buf.start_metrics_exporter(port=a.metrics_port + a.rank if a.metrics_port > 0 else 0,
                                   labels={'engine': 'llep.engine', 'model_name': a.model})
    if buf is None:
        from .a2a_moe import AllToAllMoE
        a2a_group = dist.new_group(backend='nccl') if a.device == 'cuda' else group
        moe = AllToAllMoE(cfg, weights, a2a_group, a.rank, a.ranks, a.max_batch, dev, use_fp8=a.fp8)
    else:
        moe = EpMoE(cfg, weights, buf, a.rank, a.ranks, T, dev, use_fp8=a.fp8, hooks=not a.no_hooks,
                    expert_side=a.expert_side_combine)
    model = Model(cfg, weights, moe, dev, a.max_batch)
    engine = Engine(model, a.max_batch, group, idle=moe.idle, pad=a.pad, graphs=a.graphs, two_batches=a.tbo,
                    observe=buf.observe_decode_step if exporter else None)
    for r in make_requests(a.rank, a.requests, cfg.vocab_size, a.new_tokens, a.seed):
        engine.add(r)
    t0 = time.perf_counter()
    done = engine.run()
    wall = time.perf_counter() - t0
    result = {'rank': a.rank, 'steps': engine.steps, 'wall_s': wall,
              'step_ms': sorted(1000 * s for s in engine.step_times),
              'tokens': {str(r.rid): r.output for r in done},
              # tokens this rank fed through the model (each request: its prompt, then all but its last output)
              'fed': sum(len(r.prompt) + len(r.output) - 1 for r in done)}
    if moe.per_layer and _llep_options()['metrics']:
        counts = buf.metrics_snapshot()['layer_expert_recv_tokens']
        result['received_per_layer'] = counts[:cfg.num_layers].sum(1).tolist()
    if exporter:  # what a scrape shows now: the engine's step series next to the communication metrics
        text = buf.runtime.metrics_text()
        result['exported'] = {name: _sample(text, name) for name in ('llep_decode_step_seconds_count',
                                                                     'llep_decode_tokens_total', 'llep_ops_total')}
    with open(os.path.join(a.workdir, f'rank{a.rank}.json'), 'w') as f:
        json.dump(result, f)
    dist.barrier()
    engine.close()
    if buf is not None:
        buf.destroy()
    dist.destroy_process_group()


def compare(a, results) -> str:
    """'' when every request of every rank's results has the reference's tokens, else what differs first."""
    model = reference_model(a)  # built once: the ranks' requests are decoded one rank after the other on it
    for res in results:
        ref = reference_tokens(a, model, res['rank'])
        for rid, want in sorted(ref.items()):
            got = res['tokens'].get(rid)
            if got != want:
                first = next((i for i, (x, y) in enumerate(zip(got or [], want)) if x != y), None)
                return (f'request {rid} of rank {res["rank"]} differs from the reference at token {first}: '
                        f'{got} vs {want}')
    return ''


def reference_model(a):
    """The dense single-process model of the same weights (same device kind as the ranks, fp64 expert arithmetic as
    the checked ranks use). Its KV slots are reused from one rank's requests to the next, as the engine reuses them
    between requests: a step writes a position before any step reads it."""
    from .config import ModelConfig
    from .experts import set_exact
    from .model import Model
    from .moe import DenseMoE
    set_exact(True)
    cfg = ModelConfig.named(a.model, a.layers)
    weights = _weights(a, cfg)
    dev = torch.device('cuda', 0) if a.device == 'cuda' else torch.device('cpu')
    moe = DenseMoE(cfg, weights, dev, use_fp8=a.fp8, expert_side_ranks=a.ranks if a.expert_side_combine else 0)
    return Model(cfg, weights, moe, dev, a.max_batch)


def reference_tokens(a, model, rank: int) -> Dict[str, List[int]]:
    """Rank `rank`'s requests decoded by the reference model (same scheduler, same batches and padding)."""
    from .engine import Engine, make_requests
    engine = Engine(model, a.max_batch, pad=a.pad or a.graphs, two_batches=a.tbo)  # the checked run's shapes
    for r in make_requests(rank, a.requests, model.cfg.vocab_size, a.new_tokens, a.seed):
        engine.add(r)
    return {str(r.rid): r.output for r in engine.run()}


def launch(a, argv: List[str]) -> int:
    from .config import ModelConfig
    cfg = ModelConfig.named(a.model, a.layers)
    if a.ranks < 1 or cfg.num_experts % a.ranks:
        print(f'llep.engine: {a.ranks} ranks cannot share {cfg.num_experts} experts evenly')
        return 2
    if a.expert_side_combine and a.system != 'llep':
        print(f'llep.engine: --expert-side-combine is llep\'s (combine_weights at dispatch), not {a.system}\'s')
        return 2
    workdir = a.workdir or tempfile.mkdtemp(prefix='llep-engine-')
    from llep.utils import free_port
    port = free_port()
    # The rank processes get the launcher's arguments; argparse keeps the last --workdir, this one.
    procs = [subprocess.Popen([sys.executable, '-m', 'llep.engine', *argv, '--rank', str(r), '--port', str(port),
                               '--workdir', workdir]) for r in range(a.ranks)]
    rc = [p.wait(timeout=3600) for p in procs]
    if any(rc):
        print(f'llep.engine: rank exit codes {rc}')
        return 1
    results = [json.load(open(os.path.join(workdir, f'rank{r}.json'))) for r in range(a.ranks)]
    for res in results:
        toks = sum(len(t) for t in res['tokens'].values())
        med = res['step_ms'][len(res['step_ms']) // 2] if res['step_ms'] else float('nan')
        print(f"rank {res['rank']}: {len(res['tokens'])} requests, {toks} tokens in {res['steps']} steps, "
              f"{res['wall_s']:.2f} s ({toks / res['wall_s']:.1f} tokens/s), median step {med:.2f} ms")
    if not a.check:
        return 0
    if all('received_per_layer' in r for r in results):
        # Every fed token's top-k selections reached an expert, and nothing else did (idle ranks' dummy tokens and
        # padding rows go nowhere): per layer, the tokens the experts of all ranks received = K x tokens fed.
        from .config import ModelConfig
        cfg = ModelConfig.named(a.model, a.layers)
        want = cfg.top_k * sum(r['fed'] for r in results)
        got = [sum(r['received_per_layer'][layer] for r in results) for layer in range(cfg.num_layers)]
        if got != [want] * cfg.num_layers:
            print(f'llep.engine check: FAIL: experts received {got} tokens per layer, {want} were routed')
            return 1
    for r in results:
        if 'exported' in r:  # every step with a batch observed once, every fed token counted
            want = {'llep_decode_step_seconds_count': float(len(r['step_ms'])),
                    'llep_decode_tokens_total': float(r['fed'])}
            got = {k: r['exported'][k] for k in want}
            if got != want or not r['exported']['llep_ops_total'] > 0:
                print(f'llep.engine check: FAIL: rank {r["rank"]} exported {r["exported"]}, expected {want}')
                return 1
    diff = compare(a, results)
    if diff:
        print(f'llep.engine check: FAIL: {diff}')
        return 1
    print(f'llep.engine check: PASS: {sum(len(r["tokens"]) for r in results)} requests on {a.ranks} ranks over {a.system}, every '
          f'token equal to the dense reference ({"FP8" if a.fp8 else "BF16"} dispatch, '
          f'hooks {"off" if a.no_hooks else "on"}, {"graphs" if a.graphs else "padded" if a.pad else "eager"}'
          f'{", two-batch overlap" if a.tbo else ""}{", combine reduced at the expert side" if a.expert_side_combine else ""})')
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = _args(argv)
    if a.rank >= 0:
        _rank_main(a)
        return 0
    return launch(a, argv)


if __name__ == '__main__':
    sys.exit(main())
