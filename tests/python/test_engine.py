"""llep.engine on CPU ranks (llep's CPU backend over libfabric on loopback), tiny DeepSeek-V3-style config: every
request's greedy tokens must equal those of the single-process dense reference of the same weights (issue #16).

- BF16 dispatch, receive hooks on, 2 ranks; FP8 dispatch, hooks off, 4 ranks (the reference rounds the experts' input
  rows through FP8 exactly as the codec does, so tokens must be identical there too); batches padded to the graph
  sizes 1, 2, 4 (what --graphs replays on GPUs; padding rows must reach no expert); two-batch overlap (two
  micro-batches interleaved per layer in SGLang's decode schedule; idle ranks make both micro-batches' calls in the same
  order), padded, 4 ranks.
- The two-batch schedule itself (one process, a MoE that records its calls): per layer A's dispatch, A's combine, B's
  dispatch, B's combine, each received before the next is sent (DeepEP's double buffer needs it), with B's attention
  between A's send and A's receive, A's next layer's attention inside B's combine; the hidden states equal forward()'s.
- Batch 1 on 2 ranks: the Buffer is sized for 2 tokens per rank (R * T must be a multiple of 4, as in DeepEP).
- With --metrics-port, each rank's exporter shows one llep_decode_step_seconds observation per step with a batch and
  llep_decode_tokens_total = the tokens it fed (the launcher checks both).
- With every check, the tokens all ranks' experts received per layer (llep's per-layer counters) must equal top-k
  times the tokens fed: idle ranks' dummy tokens and padding rows add nothing.
- The same weights written to a .safetensors file and loaded give the same tokens; a file missing a tensor is a
  ValueError naming it.
- The all-to-all baseline (--system nccl: torch.distributed all_to_all_single, gloo on CPU ranks) gives the same
  tokens too (FP8 rounding, padded, two-batch overlap, 4 ranks).
- The check itself can fail: the reference of other weights (another seed) must differ from a run's tokens.
- The exact (fp64) expert path, which converts a bounded number of weight bytes at a time, gives the result of one
  batched product when it splits the groups, also for zero groups (an idle micro-batch).
Each case: 8 requests per rank, 32 new tokens each (prompts of 1..8 tokens, prefilled token by token), batch 4."""
import json
import os
import subprocess
import sys
import tempfile

import pytest

ENGINE = [sys.executable, '-m', 'llep.engine', '--device', 'cpu', '--model', 'tiny', '--requests', '8',
          '--new-tokens', '32', '--max-batch', '4']


def _run(*extra, workdir=None):
    workdir = workdir or tempfile.mkdtemp(prefix='llep-engine-test-')
    env = dict(os.environ, LLEP_FABRIC_PROVIDER=os.environ.get('LLEP_FABRIC_PROVIDER', 'tcp;ofi_rxm'))
    env.pop('LLEP_METRICS_PORT', None)
    p = subprocess.run([*ENGINE, *extra, '--workdir', workdir], env=env, capture_output=True, text=True, timeout=600)
    return p, workdir


def _results(workdir, ranks):
    return [json.load(open(os.path.join(workdir, f'rank{r}.json'))) for r in range(ranks)]


@pytest.mark.parametrize('extra,ranks', [(('--ranks', '2', '--metrics-port', '0'), 2),
                                         (('--ranks', '4', '--fp8', '--no-hooks'), 4),
                                         (('--ranks', '2', '--pad'), 2), (('--ranks', '4', '--pad', '--tbo'), 4),
                                         (('--ranks', '2', '--max-batch', '1'), 2),
                                         (('--ranks', '4', '--fp8', '--pad', '--tbo', '--expert-side-combine'), 4)],
                         ids=['bf16-hooks-2ranks', 'fp8-nohooks-4ranks', 'bf16-padded-2ranks', 'bf16-padded-tbo-4ranks',
                              'batch1-2ranks', 'fp8-padded-tbo-expert-side-4ranks'])
def test_engine_tokens_equal_the_dense_reference(extra, ranks):
    p, workdir = _run(*extra, '--check')
    assert p.returncode == 0 and 'check: PASS' in p.stdout, p.stdout + p.stderr[-3000:]
    results = _results(workdir, ranks)
    assert all(len(r['tokens']) == 8 and all(len(t) == 32 for t in r['tokens'].values()) for r in results)
    assert all(r['steps'] >= 32 for r in results)
    assert all(len(r['received_per_layer']) == 2 for r in results)  # the load check above ran (tiny: 2 layers)
    if '--metrics-port' in extra:  # the exporter check above ran: decode steps and tokens on the exporter
        assert all(r['exported']['llep_decode_step_seconds_count'] == len(r['step_ms']) > 0 for r in results)
    if '--expert-side-combine' in extra:
        # The reference followed the expert-side order, and that mattered: against the per-expert order (DeepEP's)
        # these tokens differ (one more bf16 rounding per (token, rank) flips a greedy choice within 32 tokens).
        from llep.engine.__main__ import _args, compare
        per_expert = _args([*ENGINE[3:], *(a for a in extra if a != '--expert-side-combine')])
        assert 'differs from the reference' in compare(per_expert, results)


def test_engine_on_the_all_to_all_baseline_equals_the_dense_reference():
    """--system nccl (a2a_moe.AllToAllMoE over gloo here): the same requests, the same tokens as the reference, FP8
    rounding, padded batches and two micro-batches per step, 4 ranks; it has no per-layer counters to check."""
    p, workdir = _run('--ranks', '4', '--system', 'nccl', '--fp8', '--pad', '--tbo', '--check')
    assert p.returncode == 0 and 'check: PASS' in p.stdout and 'over nccl' in p.stdout, p.stdout + p.stderr[-3000:]
    results = _results(workdir, 4)
    assert all(len(r['tokens']) == 8 and all(len(t) == 32 for t in r['tokens'].values()) for r in results)
    assert all('received_per_layer' not in r for r in results)


def test_expert_side_combine_is_refused_on_other_systems():
    p, _ = _run('--ranks', '2', '--system', 'nccl', '--expert-side-combine')
    assert p.returncode == 2 and "--expert-side-combine is llep's" in p.stdout, p.stdout + p.stderr[-2000:]


def test_engine_loads_safetensors_and_the_check_can_fail():
    from llep.engine import ModelConfig, init_weights, load_safetensors, save_safetensors
    from llep.engine.__main__ import _args, compare
    cfg = ModelConfig.tiny()
    d = tempfile.mkdtemp(prefix='llep-weights-')
    w = init_weights(cfg, seed=0)
    save_safetensors(w, os.path.join(d, 'model.safetensors'))
    back = load_safetensors(d, cfg)
    assert set(back) == set(w) and all(back[k].dtype == w[k].dtype and bool((back[k] == w[k]).all()) for k in w)

    p_file, wd_file = _run('--ranks', '2', '--weights', d, '--check')
    assert p_file.returncode == 0 and 'check: PASS' in p_file.stdout, p_file.stdout + p_file.stderr[-3000:]
    p_rand, wd_rand = _run('--ranks', '2')
    assert p_rand.returncode == 0, p_rand.stderr[-3000:]
    assert [r['tokens'] for r in _results(wd_file, 2)] == [r['tokens'] for r in _results(wd_rand, 2)]

    # The comparison is not vacuous: other weights (seed 1) decode other tokens.
    other = _args([*ENGINE[3:], '--ranks', '2', '--seed', '1'])
    assert 'differs from the reference' in compare(other, _results(wd_rand, 2))

    missing = {k: v for k, v in w.items() if k != 'lm_head.weight'}
    d2 = tempfile.mkdtemp(prefix='llep-weights-')
    save_safetensors(missing, os.path.join(d2, 'model.safetensors'))
    with pytest.raises(ValueError, match='lm_head.weight'):
        load_safetensors(d2, cfg)


class _RecordingMoE:
    """A staged MoE that logs each stage (and the model's attention stages, through the wrapped methods) and returns
    a deterministic function of its input rows, so forward() and forward_two_batches() can be compared."""

    def __init__(self, log):
        self.log = log

    def send(self, layer, x, idx, w, shared, mb=0):
        self.log.append(('send', layer, mb))
        return (layer, x, shared, mb)

    def middle(self, st):
        self.log.append(('middle', st[0], st[3]))

    def finish(self, st):
        self.log.append(('finish', st[0], st[3]))
        return (st[1].float() * 0.5 + st[2]().float()).to(st[1].dtype)

    def __call__(self, layer, x, idx, w, shared):
        return self.finish(self.send(layer, x, idx, w, shared))


def test_two_batch_schedule_matches_sglang_decode():
    import torch
    from llep.engine.config import ModelConfig
    from llep.engine.model import Model
    from llep.engine.weights import init_weights
    cfg = ModelConfig.named('tiny', 2)
    log = []
    model = Model(cfg, init_weights(cfg), _RecordingMoE(log), torch.device('cpu'), 8)
    for name in ('_attention_prepare', '_attention_core'):
        inner = getattr(model, name)

        def wrapped(layer, h, *rest, _inner=inner, _name=name):
            log.append((_name.lstrip('_'), layer, h.shape[0]))
            return _inner(layer, h, *rest)
        setattr(model, name, wrapped)
    tokens, pos, slots = torch.tensor([3, 5, 7, 9, 11]), torch.zeros(5, dtype=torch.int64), torch.arange(5)
    two = model.forward_two_batches(tokens, pos, slots)
    rows_to_mb = {3: 0, 2: 1}  # A holds ceil(5 / 2) rows, B the rest
    got = [(kind, layer, rows_to_mb[mb] if kind.startswith('attention') else mb) for kind, layer, mb in log]
    prep, core = 'attention_prepare', 'attention_core'
    want = [(prep, 0, 0), (core, 0, 0)]
    for layer in range(cfg.num_layers):
        want += [('send', layer, 0), (prep, layer, 1), ('middle', layer, 0), (core, layer, 1), ('finish', layer, 0),
                 ('send', layer, 1), ('middle', layer, 1)]
        if layer + 1 < cfg.num_layers:  # A's next layer's attention runs while B's combine travels
            want += [(prep, layer + 1, 0), ('finish', layer, 1), (core, layer + 1, 0)]
        else:
            want += [('finish', layer, 1)]
    assert got == want
    log.clear()
    one = model.forward(tokens, pos, slots)
    assert torch.equal(one, two)


def test_exact_expert_path_splits_groups_without_changing_results(monkeypatch):
    import torch
    from llep.engine import experts
    monkeypatch.setattr(experts, '_EXACT', True)
    exact_mlp, calls = experts._exact_mlp, []

    def counted(x, gate_up, down):
        calls.append(x.shape[0])
        return exact_mlp(x, gate_up, down)

    monkeypatch.setattr(experts, '_exact_mlp', counted)
    g = torch.Generator().manual_seed(3)
    for groups, want_calls in ((0, [0]), (1, [1]), (5, [2, 2, 1])):
        x = torch.randn((groups, 3, 16), generator=g).to(torch.bfloat16)
        gate_up = torch.randn((groups, 16, 8), generator=g).to(torch.bfloat16)
        down = torch.randn((groups, 4, 16), generator=g).to(torch.bfloat16)
        whole = exact_mlp(x, gate_up, down)  # one batched product
        # Two groups' fp64 weights per product: 5 groups run as 2 + 2 + 1.
        monkeypatch.setattr(experts, '_EXACT_WEIGHT_BYTES', 2 * 8 * (16 * 8 + 4 * 16))
        calls.clear()
        split = experts.expert_mlp(x, gate_up, down)
        assert calls == want_calls
        assert split.shape == (groups, 3, 16) and split.dtype == torch.bfloat16
        assert torch.equal(split, whole)


def test_dense_reference_follows_the_expert_side_order():
    """DenseMoE(expert_side_ranks=R), the reference of --expert-side-combine: with one rank it is the per-expert order
    (the partial is the whole sum, rounding it to bf16 twice changes nothing); with one expert per rank, each
    selection's w * y rounded to bf16 on its own and the ranks added in fp32 in expert order, computed here apart; and
    it differs from the per-expert order somewhere, or the engine check could not tell the two apart."""
    import torch
    from llep.engine import ModelConfig, init_weights
    from llep.engine.moe import DenseMoE
    cfg = ModelConfig.tiny()
    weights = init_weights(cfg, seed=3)
    cpu = torch.device('cpu')
    B, E, K = 64, cfg.num_experts, cfg.top_k
    g = torch.Generator().manual_seed(5)
    x = torch.randn((B, cfg.hidden), generator=g).to(torch.bfloat16)
    idx = torch.topk(torch.rand((B, E), generator=g), K, dim=-1).indices
    idx[torch.rand((B, K), generator=g) < 0.2] = -1
    w = torch.rand((B, K), generator=g)

    def no_shared():
        return torch.zeros((B, cfg.hidden), dtype=torch.bfloat16)

    per_expert = DenseMoE(cfg, weights, cpu)(0, x, idx, w, no_shared)
    assert torch.equal(DenseMoE(cfg, weights, cpu, expert_side_ranks=1)(0, x, idx, w, no_shared), per_expert)
    one_each = DenseMoE(cfg, weights, cpu, expert_side_ranks=E)(0, x, idx, w, no_shared)
    from llep.engine.experts import expert_mlp
    gu, dn = DenseMoE(cfg, weights, cpu).experts[0]
    want = torch.zeros((B, cfg.hidden), dtype=torch.float32)
    for t in range(B):
        for k in sorted(range(K), key=lambda k: int(idx[t, k])):  # rank order = expert order here
            e = int(idx[t, k])
            if e >= 0:
                y = expert_mlp(x[t].view(1, -1), gu[e], dn[e]).view(-1)
                want[t] += (w[t, k].double() * y.double()).float().to(torch.bfloat16).float()
    assert torch.equal(one_each, want.to(torch.bfloat16))
    assert not torch.equal(one_each, per_expert)
