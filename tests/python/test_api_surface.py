"""llep.Buffer against DeepEP V1's low-latency API (deep_ep/buffer.py at 567632d, as recorded in
shared/spec/deepep-ll-api.md §3-4): parameter names, order, kinds and defaults; static methods; module surface."""
import inspect
import sys

import pytest
import torch

import llep
import llep.deep_ep

REQUIRED = inspect.Parameter.empty

# DeepEP V1 signatures (self omitted). llep may only append parameters after these (keyword-only or **kwargs).
DEEPEP_V1 = {
    '__init__': [('group', REQUIRED), ('num_nvl_bytes', 0), ('num_rdma_bytes', 0), ('low_latency_mode', False),
                 ('num_qps_per_rank', 24), ('allow_nvlink_for_low_latency_mode', True), ('allow_mnnvl', False),
                 ('use_fabric', False), ('explicitly_destroy', False), ('enable_shrink', False), ('comm', None)],
    'low_latency_dispatch': [('x', REQUIRED), ('topk_idx', REQUIRED), ('num_max_dispatch_tokens_per_rank', REQUIRED),
                             ('num_experts', REQUIRED), ('cumulative_local_expert_recv_stats', None),
                             ('dispatch_wait_recv_cost_stats', None), ('use_fp8', True), ('round_scale', False),
                             ('use_ue8m0', False), ('async_finish', False), ('return_recv_hook', False)],
    'low_latency_combine': [('x', REQUIRED), ('topk_idx', REQUIRED), ('topk_weights', REQUIRED), ('handle', REQUIRED),
                            ('use_logfmt', False), ('zero_copy', False), ('async_finish', False),
                            ('return_recv_hook', False), ('out', None), ('combine_wait_recv_cost_stats', None)],
    'get_next_low_latency_combine_buffer': [('handle', REQUIRED)],
    'clean_low_latency_buffer': [('num_max_dispatch_tokens_per_rank', REQUIRED), ('hidden', REQUIRED),
                                 ('num_experts', REQUIRED)],
    'get_low_latency_rdma_size_hint': [('num_max_dispatch_tokens_per_rank', REQUIRED), ('hidden', REQUIRED),
                                       ('num_ranks', REQUIRED), ('num_experts', REQUIRED)],
    'get_local_buffer_tensor': [('dtype', REQUIRED), ('size', None), ('offset', 0), ('use_rdma_buffer', False)],
    'destroy': [],
    'capture': [],
    'low_latency_update_mask_buffer': [('rank_to_mask', REQUIRED), ('mask', False)],
    'low_latency_query_mask_buffer': [('mask_status', REQUIRED)],
    'low_latency_clean_mask_buffer': [],
}
STATIC = {'get_low_latency_rdma_size_hint', 'capture', 'set_num_sms', 'get_dispatch_config', 'get_combine_config'}


@pytest.mark.parametrize('name', sorted(DEEPEP_V1))
def test_signature_matches_deepep_v1(name):
    params = list(inspect.signature(getattr(llep.Buffer, name)).parameters.values())
    if name not in STATIC:
        assert params[0].name == 'self'
        params = params[1:]
    expected = DEEPEP_V1[name]
    assert [(p.name, p.default) for p in params[:len(expected)]] == expected
    for p in params[:len(expected)]:
        assert p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD, f'{name}.{p.name} must be positional-or-keyword'
    for p in params[len(expected):]:  # anything llep adds may not shift DeepEP's positions
        assert p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD), f'{name}.{p.name}'


@pytest.mark.parametrize('name', sorted(STATIC))
def test_static_methods(name):
    assert isinstance(inspect.getattr_static(llep.Buffer, name), staticmethod)


def test_module_surface_and_alias():
    for mod in (llep, llep.deep_ep):
        for attr in ('Buffer', 'EventOverlap', 'Config', 'topk_idx_t'):
            assert hasattr(mod, attr), attr
    assert llep.topk_idx_t == torch.int64
    assert llep.Buffer.num_sms == 20
    assert 'deep_ep' not in sys.modules or sys.modules['deep_ep'] is llep.deep_ep  # never shadowed by default
    llep.deep_ep.install_as_deep_ep()
    import deep_ep  # noqa: E402
    assert deep_ep.Buffer is llep.Buffer


def test_event_overlap():
    e = llep.EventOverlap()
    assert e.event is None and e.extra_tensors is None
    with pytest.raises(AssertionError):
        e.current_stream_wait()
    with llep.Buffer.capture() as captured:  # context manager waits on exit
        assert captured.event is not None


def test_size_hint_and_errors():
    ours = llep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 4, 256)
    assert ours == llep._llep.ll_buffer_bytes(128, 7168, 4, 256)
    assert ours < llep._llep.deepep_v1_size_hint(128, 7168, 256) == 1908410496
    assert ours % 128 == 0
    with pytest.raises(llep.LlepInvalidArgumentError, match='multiple of 128'):
        llep.Buffer.get_low_latency_rdma_size_hint(128, 7000, 4, 256)
    with pytest.raises(ValueError, match='divisible'):  # LlepInvalidArgumentError is also a ValueError
        llep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 3, 256)
    with pytest.raises(ValueError, match='group'):
        llep.Buffer(None)
    assert issubclass(llep.LlepTimeoutError, RuntimeError) and issubclass(llep.LlepTimeoutError, TimeoutError)


def test_normal_mode_and_shrink_are_clear_errors():
    buf = llep.Buffer.__new__(llep.Buffer)  # no group needed to reach these
    with pytest.raises(NotImplementedError, match='low-latency mode only'):
        buf.dispatch(None)
    buf.enable_shrink = False
    with pytest.raises(llep.LlepFailedPreconditionError, match='enable_shrink'):
        buf.low_latency_update_mask_buffer(1, True)


@pytest.mark.skipif(not getattr(llep._llep, 'HAVE_CUDA', False) or torch.cuda.is_available(),
                    reason='needs a CUDA build on a machine without a usable GPU')
def test_gpu_backend_without_gpu_is_a_clear_error():
    # The GPU runtime must fail with a typed error naming the CUDA call, not crash or hang (CI has no GPU).
    with pytest.raises(llep.LlepError, match='cuda'):
        llep._llep.GpuBuffer(8, 2048, 16, 1, 0, lambda blob: [blob], 0, 5.0, 0)


def test_options_come_from_the_native_reader(monkeypatch):
    # One read site per LLEP_* option (runtime/base/env.h); Python only receives them.
    for name in llep._llep.OPTION_NAMES:
        monkeypatch.delenv(name, raising=False)
    o = llep._llep.read_options()
    assert (o['backend'], o['timeout_s'], o['proxy_threads'], o['metrics'], o['metrics_port']) == ('', 30.0, 1, True, -1)
    monkeypatch.setenv('LLEP_TIMEOUT_S', '2.5')
    monkeypatch.setenv('LLEP_BACKEND', 'cpu')
    monkeypatch.setenv('LLEP_METRICS', '0')
    o = llep._llep.read_options()
    assert (o['backend'], o['timeout_s'], o['metrics']) == ('cpu', 2.5, False)
    monkeypatch.setenv('LLEP_TIMEOUT_S', 'soon')
    with pytest.raises(llep.LlepInvalidArgumentError, match="LLEP_TIMEOUT_S='soon'"):
        llep._llep.read_options()
