"""The call sequences SGLang and vLLM make against `deep_ep` in low-latency mode (shared/spec/engines.md §2.2-2.4,
§3.2, §3.5, §3.7), replayed against llep through its `deep_ep` stand-in on the CPU backend (2 ranks, gloo), and the
packaging that puts llep there (issue #16 item 4):

- SGLang: the Buffer as DeepEPBuffer builds it; clean_low_latency_buffer on the switch to low-latency mode; the
  low-latency dispatcher's stage machine (dispatch_a / dispatch_b / combine_a / combine_b, async_finish and
  return_recv_hook as SGLang passes them, masked_m accumulated per layer as its expert-distribution recorder does);
  two-batch overlap: two dispatchers on one Buffer, two operations in flight, in the order of SGLang's decode schedule.
- vLLM: the Buffer as DeepEPLLAll2AllManager builds it (CPU gloo group, num_nvl_bytes of 1 GiB, explicitly_destroy);
  DeepEPLLPrepareAndFinalize's prepare_async / finalize with FP8 + round_scale + use_ue8m0 and
  dispatch_wait_recv_cost_stats, one handle slot per micro-batch, receive hooks run on the other micro-batch's thread
  (DBO), combine into `out`.
- Fork-only keywords (SBO) raise NotImplementedError naming the switch to turn off, and the buffer keeps working.
- `pip install --no-build-isolation .` (into a target folder, reusing this build) registers the vLLM plugin in
  `vllm.general_plugins` and the `llep-sglang` script; the plugin makes `import deep_ep` return llep in a fresh
  process; llep-sglang's argument check and PYTHONPATH shim do the same for SGLang's spawned processes.
Every round checks recv_count exactly against the routed counts and the combined rows against sum_k w * f_e(x)."""
import datetime
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llep.utils import free_port

R, T, H, E, K = 2, 8, 2048, 8, 4
E_loc = E // R


def _inputs(rank, step, n):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = (torch.randn((n, H), generator=g) * 0.5).to(torch.bfloat16)
    ids = torch.topk(torch.rand((n, E), generator=g), K, dim=-1).indices
    ids[0, K - 1] = -1  # a padded selection, as engines send
    w = torch.rand((n, K), generator=g) + 0.1
    return x, ids, w


def _routed_counts(ids):
    every = [None] * R
    dist.all_gather_object(every, ids)
    rank = dist.get_rank()
    allids = torch.cat(every).flatten()
    return torch.stack([(allids == rank * E_loc + le).sum() for le in range(E_loc)]).to(torch.int32)


def _expert(rows, le):
    """The stand-in expert: local expert le scales its rows by (le + 1)."""
    return (rows.float() * (le + 1)).to(torch.bfloat16)


def _experts(recv_rows):
    return torch.stack([_expert(recv_rows[le], le) for le in range(E_loc)])


def _dequant_fp8(q, scales, ue8m0):
    """FP8 rows back to bf16 with the engine's decoder; UE8M0 scales (int32 [E_loc, rows, H/512], column-major as
    DeepEP's: byte g % 4 of word g / 4 = group g's exponent) first become fp32 scale_inv."""
    from llep.engine.moe import dequantize_fp8
    if ue8m0:
        scales = (scales.contiguous().view(torch.uint8).int() << 23).view(torch.float32)
    return dequantize_fp8(q, scales)


def _check_combined(out, x, ids, w, fp8, what):
    want = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(K):
        scale = torch.where(ids[:, k] >= 0, (ids[:, k] % E_loc + 1).float() * w[:, k], torch.zeros(()))
        want += scale[:, None] * x.float()
    err = ((out.float() - want).norm() / want.norm()).item()
    assert err < (0.06 if fp8 else 0.01), f'{what}: combined rows differ from sum_k w f(x) by {err:.3g}'


class SglangLowLatencyDispatcher:
    """SGLang's _DeepEPDispatcherImplLowLatency as the engine drives it (async_finish=True, return_recv_hook=True
    from create_moe_dispatcher): INITIAL -> AFTER_DISPATCH_A -> AFTER_DISPATCH_B -> AFTER_COMBINE_A -> INITIAL."""

    def __init__(self, buffer, use_fp8, recorder):
        self.buffer, self.use_fp8, self.recorder, self.stage = buffer, use_fp8, recorder, 'INITIAL'
        self.return_recv_hook = True

    def dispatch_a(self, hidden_states, topk_ids, layer):
        assert self.stage == 'INITIAL'
        topk_ids = topk_ids.to(torch.int64)
        self.expected_m = (hidden_states.shape[0] * R * K + E) // E
        recv, self.masked_m, self.handle, self.event, self.hook = self.buffer.low_latency_dispatch(
            hidden_states, topk_ids, T, E, use_fp8=self.use_fp8, async_finish=not self.return_recv_hook,
            return_recv_hook=self.return_recv_hook, round_scale=False, use_ue8m0=False)
        self.recv, self.layer, self.stage = recv, layer, 'AFTER_DISPATCH_A'

    def dispatch_b(self):
        assert self.stage == 'AFTER_DISPATCH_A'
        self.hook() if self.return_recv_hook else self.event.current_stream_wait()
        self.recorder[self.layer] += self.masked_m  # on_deepep_dispatch_low_latency(masked_m)
        self.stage = 'AFTER_DISPATCH_B'
        hidden, scale = self.recv if self.use_fp8 else (self.recv, None)
        return hidden, scale, self.masked_m, self.expected_m

    def combine_a(self, hidden_states, topk_ids, topk_weights):
        assert self.stage == 'AFTER_DISPATCH_B'
        self.out, self.event, self.hook = self.buffer.low_latency_combine(
            x=hidden_states, topk_idx=topk_ids, topk_weights=topk_weights, handle=self.handle,
            async_finish=not self.return_recv_hook, return_recv_hook=self.return_recv_hook)
        self.stage = 'AFTER_COMBINE_A'

    def combine_b(self):
        assert self.stage == 'AFTER_COMBINE_A'
        self.hook() if self.return_recv_hook else self.event.current_stream_wait()
        self.stage = 'INITIAL'
        return self.out


def _sglang(rank):
    import deep_ep
    import llep
    assert deep_ep.Buffer is llep.Buffer
    group = dist.group.WORLD
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, group.size(), E)
    buf = deep_ep.Buffer(group, 0, num_rdma_bytes, low_latency_mode=True, num_qps_per_rank=E // group.size(),
                         allow_mnnvl=True)
    buf.clean_low_latency_buffer(T, H, E)  # set_dispatch_mode_as_low_latency() on the NORMAL -> LL switch
    recorder = torch.zeros((2, E_loc), dtype=torch.int32)
    want_recorded = torch.zeros((2, E_loc), dtype=torch.int32)
    for step in range(4):
        use_fp8 = step % 2 == 1
        # Two micro-batches (TBO), in the order of SGLang's decode schedule (tbo_delta_stages=2): B's dispatch is sent
        # before A's is received, so two operations are in flight on the one Buffer.
        a, b = SglangLowLatencyDispatcher(buf, use_fp8, recorder), SglangLowLatencyDispatcher(buf, use_fp8, recorder)
        ins = {'A': _inputs(rank, step, T), 'B': _inputs(rank, 100 + step, T // 2 + rank)}
        layer = step % 2
        a.dispatch_a(ins['A'][0], ins['A'][1], layer)
        b.dispatch_a(ins['B'][0], ins['B'][1], layer)
        outs = {}
        for name, d in (('A', a), ('B', b)):
            x, ids, w = ins[name]
            hidden, scale, masked_m, _ = d.dispatch_b()
            routed = _routed_counts(ids)
            assert torch.equal(masked_m, routed), f'step {step} {name}: recv_count {masked_m} != routed {routed}'
            want_recorded[layer] += routed
            rows = _dequant_fp8(hidden, scale, False) if use_fp8 else hidden
            d.combine_a(_experts(rows), ids, w)
        for name, d in (('A', a), ('B', b)):
            outs[name] = d.combine_b()
            x, ids, w = ins[name]
            _check_combined(outs[name], x, ids, w, use_fp8, f'sglang step {step} micro-batch {name}')
    assert torch.equal(recorder, want_recorded)
    # SBO's fork-only combine arguments: a clear error naming the switch; the buffer still serves the next round.
    d = SglangLowLatencyDispatcher(buf, False, recorder)
    x, ids, w = _inputs(rank, 99, T)
    d.dispatch_a(x, ids, 0)
    hidden, _, _, _ = d.dispatch_b()
    with pytest.raises(NotImplementedError, match='--enable-single-batch-overlap'):
        buf.low_latency_combine(_experts(hidden), ids, w, d.handle, return_recv_hook=True, overlap=True,
                                packed_recv_count=d.masked_m, block_m=64, threshold=0, num_sms=3)
    d.combine_a(_experts(hidden), ids, w)
    _check_combined(d.combine_b(), x, ids, w, False, 'sglang after the refused SBO call')
    dist.barrier()  # SGLang never destroys its Buffer (no explicitly_destroy): it goes with the process


def _vllm(rank):
    import deep_ep
    cpu_group = dist.new_group(backend='gloo')
    buf = deep_ep.Buffer(group=cpu_group, num_nvl_bytes=1024 * 2 ** 20,
                         num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E),
                         low_latency_mode=True, num_qps_per_rank=E_loc, allow_nvlink_for_low_latency_mode=True,
                         allow_mnnvl=False, explicitly_destroy=True)
    wait_stats = torch.zeros(R, dtype=torch.int64)
    for step in range(3):
        handles, receivers, ins = [None, None], [None, None], {}
        for a2a_idx in (0, 1):  # prepare_async of both micro-batches (DBO): their dispatches are in flight together
            x, ids, w = ins[a2a_idx] = _inputs(rank, 10 + step, T - a2a_idx)
            expert_x, _count, handle, _event, hook = buf.low_latency_dispatch(
                x, ids, T, E, dispatch_wait_recv_cost_stats=wait_stats, use_fp8=True, round_scale=True,
                use_ue8m0=True, async_finish=False, return_recv_hook=True)
            handles[a2a_idx], receivers[a2a_idx] = handle, (hook, expert_x, _count)
        for a2a_idx in (0, 1):
            hook, (q, scales), count = receivers[a2a_idx]
            t = threading.Thread(target=hook)  # dbo_register_recv_hook: the other micro-batch's thread runs it
            t.start()
            t.join()
            x, ids, w = ins[a2a_idx]
            assert scales.dtype == torch.int32 and scales.shape == (E_loc, R * T, H // 512)
            assert torch.equal(count, _routed_counts(ids))
            fused = _experts(_dequant_fp8(q, scales, True))
            output = torch.empty((x.shape[0], H), dtype=torch.bfloat16)
            combined, _event, chook = buf.low_latency_combine(fused, ids, w, handles[a2a_idx], async_finish=False,
                                                              zero_copy=False, return_recv_hook=True, out=output)
            t = threading.Thread(target=chook)
            t.start()
            t.join()
            assert combined.data_ptr() == output.data_ptr()
            _check_combined(output, x, ids, w, True, f'vllm step {step} micro-batch {a2a_idx}')
    assert bool((wait_stats >= 0).all())
    buf.destroy()


def _worker(rank, port, which):
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=R,
                            timeout=datetime.timedelta(seconds=120))
    from llep.integrations.vllm import register
    register()  # what vLLM's plugin loader runs; SGLang gets the same module through llep-sglang's shim
    {'sglang': _sglang, 'vllm': _vllm}[which](rank)
    dist.destroy_process_group()


@pytest.mark.parametrize('which', ['sglang', 'vllm'])
def test_engine_call_sequences(which):
    os.environ.setdefault('LLEP_FABRIC_PROVIDER', 'tcp;ofi_rxm')
    os.environ.setdefault('LLEP_TIMEOUT_S', '30')  # a rank that fails leaves its peer waiting: fail fast, not hang
    ctx = mp.spawn(_worker, args=(free_port(), which), nprocs=R, join=False)
    deadline = time.time() + 240
    while not ctx.join(timeout=1):  # raises the first rank's exception, after terminating the others
        if time.time() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f'{which}: ranks still running after 240 s')


def test_pip_install_registers_the_entry_points():
    import llep
    build_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(llep.__file__))))
    source = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    target = tempfile.mkdtemp(prefix='llep-pip-')
    env = dict(os.environ, LLEP_BUILD_DIR=build_dir)
    p = subprocess.run([sys.executable, '-m', 'pip', 'install', '--no-build-isolation', '--no-deps', '--no-index',
                        '--target', target, source], env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    # A fresh process that sees only the installed package loads the plugin as vLLM does, then imports deep_ep.
    probe = ('import importlib.metadata as m, sys\n'
             'eps = [e for d in m.distributions(path=[sys.argv[1]]) if d.metadata["Name"] == "llep"\n'
             '       for e in d.entry_points if e.group == "vllm.general_plugins"]\n'
             'assert [(e.name, e.value) for e in eps] == [("llep", "llep.integrations.vllm:register")], eps\n'
             'eps[0].load()()\n'
             'import deep_ep, llep\n'
             'assert deep_ep.Buffer is llep.Buffer and llep.__file__.startswith(sys.argv[1]), llep.__file__\n'
             'print("ok")\n')
    clean = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    p = subprocess.run([sys.executable, '-c', probe, target], env=dict(clean, PYTHONPATH=target), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and 'ok' in p.stdout, p.stdout + p.stderr[-3000:]
    assert os.path.exists(os.path.join(target, 'bin', 'llep-sglang'))
    p = subprocess.run([sys.executable, '-c', probe, target], env=dict(clean, PYTHONPATH=target, LLEP_AS_DEEP_EP='0'),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and 'deep_ep' in p.stderr, 'LLEP_AS_DEEP_EP=0 must leave deep_ep alone'


def test_llep_sglang_checks_arguments_and_shims_deep_ep():
    from llep.integrations import sglang
    good = ['--model-path', 'm', '--moe-a2a-backend', 'deepep', '--deepep-mode', 'low_latency']
    assert sglang.check_args(good) == []
    assert any('--deepep-mode low_latency' in p for p in sglang.check_args(good[:4] + ['--deepep-mode', 'auto']))
    assert any('--moe-a2a-backend deepep' in p for p in sglang.check_args(['--model-path', 'm']))
    assert any('--enable-single-batch-overlap' in p for p in sglang.check_args(good + ['--enable-single-batch-overlap']))
    assert any('NVFP4' in p for p in sglang.check_args(good + ['--deepep-dispatcher-output-dtype=nvfp4']))
    assert sglang.main(['--model-path', 'm']) == 2
    # What SGLang's spawned processes see: `import deep_ep` finds the shim, which is llep.
    p = subprocess.run([sys.executable, '-c', 'import deep_ep, llep; assert deep_ep.Buffer is llep.Buffer; print(1)'],
                       env=sglang.environment(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == '1', p.stderr[-2000:]
