"""llep.Buffer: DeepEP V1's low-latency `Buffer` API (deep_ep/buffer.py at 567632d), backed by llep.

Positional order, keyword names, defaults, return tuples and the handle layout match DeepEP V1, so SGLang and
vLLM can use it unchanged (see llep.deep_ep). Two backends behind one API:
  - 'cuda': the NVLink kernels (same-host GPUs, CUDA IPC); tensors on the rank's current CUDA device, kernels
    queued on torch's current stream, receive hooks launch the receive phase.
  - 'cpu': the CPU backend (CPU tensors, ranks on one host over libfabric), the oracle of the GPU tests.
Buffer.backend picks one: 'cuda' when torch sees a GPU and llep was built with CUDA, else 'cpu'; LLEP_BACKEND
or assigning Buffer.backend before the first low-latency call overrides it. Tensors never cross into C++ as
torch objects: the native module gets addresses, shapes and stream handles, so one build serves any torch.

GPU errors are recorded by the kernels without a trap. A fatal one (a peer that never answers, a broken call order)
is raised by the next call on the buffer and by Buffer.check_errors(); bad input the kernels dropped consistently
(bad expert ids, a corrupt handle) only by Buffer.check_errors() after the stream was synchronised (a later call
logs it once: raised there, it would hit ranks at different calls and desynchronise them). clean_low_latency_buffer
recovers the buffer after a fatal error; with enable_shrink a silent peer is masked instead (DeepEP's shrink API).

CUDA graphs: every call may be captured (no host synchronisation), in any number per graph and in graphs of any
batch size sharing the buffer: the kernels pick the buffer half and pair each receive hook with its send on the
device. The in-flight rules (graph_capture/README.md) are checked by the host at each call and by the kernels on
every replay. llep.graph_capture captures a decode step per batch size.

Environment: the LLEP_* options (backend, timeout, CTAs per launch, proxy transport and threads, virtual nodes,
metrics exporter) are listed with their defaults in one table, README "Options"; they are read by the native module
(runtime/base/env.h) when the Buffer is created and passed to the backend as explicit arguments.
"""
import functools
import itertools
import os
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from llep import _llep
from llep._call_checks import (_COMBINE_FORK_KWARGS, _DISPATCH_FORK_KWARGS, _FP8, _DispatchOutputs, _NoTorchFunction,
                               _capturing, _check_fork_kwargs, _check_tensor, _fast_ok, _fast_ok_shape,
                               _has_torch_function, _invalid, _layout_shape, _raw_stream, topk_idx_t)
from llep._output_pool import AVAILABLE as _POOL_AVAILABLE
from llep._output_pool import OutputPool, Tensors, one_block
from llep.utils import CompletedEvent, EventOverlap

class Config:
    """Normal-mode tuning config of DeepEP (accepted for compatibility; llep implements low-latency mode only)."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        raise NotImplementedError('llep implements low-latency mode only (no normal-mode buffers)')

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        raise NotImplementedError('llep implements low-latency mode only (no normal-mode buffers)')


class _DeviceMemory:
    """Device bytes owned by a llep buffer, exposed through __cuda_array_interface__ (so torch can view them
    without llep linking torch). The view is valid while the Buffer lives, as DeepEP's."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {'shape': (nbytes,), 'typestr': '|u1', 'data': (ptr, False), 'version': 3,
                                         'strides': None}


class _TorchCudaEvent:
    def __init__(self) -> None:
        self.event = torch.cuda.Event()
        self.event.record()

    def current_stream_wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


class _HandleTokens(int):
    """handle[2], num_max_dispatch_tokens_per_rank (an int, as in DeepEP), carrying `plan_key`: the key of the token
    plan the GPU backend keeps on the device for this handle's combine (runtime/protocol/ll_call.h
    DispatchCall::plan_key; kernels/cuda/ll_kernels.h CarriedPlanArea). It rides in the handle's int so that copies of
    the handle (tensors cloned, the tuple rebuilt) keep it; a handle without it combines the same, counting the rows'
    positions instead. `expert_reduced`: the dispatch carried combine_weights, so its combine reduces on the experts'
    ranks (a class default, set on the instance only then: one attribute store fewer per dispatch without them).
    `made`: (src_info, layout_range, layout specs, topk_idx, topk_idx's version) as the dispatch made or checked them.
    A combine whose handle holds those very src_info / layout_range objects, of the current layout, skips re-checking
    their dtypes, shapes and device (the dispatch made them so), and its topk_idx too when it is the dispatch's object
    with no in-place change since (the version); a handle with other tensors (cloned, replaced) is checked in full."""
    expert_reduced = False
    made: Optional[Tuple] = None


def _new_dispatch_outputs(block: bool, x: torch.Tensor, spec: _DispatchOutputs, use_fp8: bool) -> Tensors:
    """A dispatch's five outputs, made now (scales None without FP8): in one allocation for the output pool (`block`;
    _output_pool.one_block), else apart. new_empty / new_empty_strided: the cheapest ways to make a tensor from Python
    (H100 host, torch 2.11: 5.1-5.4 µs against 6.5-7 for torch.empty with a device argument; bench/RESULTS.md)."""
    if block:
        return one_block(x, ((spec.x_shape, _contiguous(spec.x_shape), spec.x_dtype),
                             (spec.scales_shape, spec.scales_stride, spec.scales_dtype) if use_fp8 else None,
                             (spec.count_shape, (1,), torch.int32),
                             (spec.src_info_shape, _contiguous(spec.src_info_shape), torch.int32),
                             (spec.layout_range_shape, _contiguous(spec.layout_range_shape), torch.int64)))
    return (x.new_empty(spec.x_shape, dtype=spec.x_dtype),
            x.new_empty_strided(spec.scales_shape, spec.scales_stride, dtype=spec.scales_dtype) if use_fp8 else None,
            x.new_empty(spec.count_shape, dtype=torch.int32),
            x.new_empty(spec.src_info_shape, dtype=torch.int32),
            x.new_empty(spec.layout_range_shape, dtype=torch.int64))


def _new_combine_out(block: bool, like: torch.Tensor, num_tokens: int, hidden: int) -> Tensors:
    """A combine's `out`, made now on `like`'s device (as a 1-tuple: the output pool keeps sets of tensors; one tensor
    is one allocation either way)."""
    return (like.new_empty((num_tokens, hidden), dtype=torch.bfloat16),)


def _contiguous(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The strides of a contiguous tensor of this shape."""
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= d
    return tuple(reversed(strides))


_plan_keys = itertools.count(1)  # unique in the process, never 0 (0 = no plan)
_NO_EVENT = EventOverlap(None, None)  # what a call without async_finish returns (holds nothing, shared)
_Tensor, _BF16, _F32 = torch.Tensor, torch.bfloat16, torch.float32  # read per call: module names, not attributes


def _no_stream() -> int:
    """The CPU backend's stream handle (none)."""
    return 0


def _torch_stream(device: torch.device) -> int:
    """The raw handle of `device`'s current stream where torch lacks _cuda_getCurrentRawStream."""
    return torch.cuda.current_stream(device).cuda_stream


class _ReceiveHook:
    """The receive hook low_latency_dispatch / low_latency_combine return with return_recv_hook=True: launches (GPU) or
    runs (CPU, releasing the GIL; safe from another thread, as vLLM's DBO does) the receive phase once. Holds the call's
    tensors until then: stream order keeps them valid afterwards."""

    __slots__ = ('_buffer', '_runtime', '_op', '_keep', '_handle_key')

    def __init__(self, buffer: 'Buffer', runtime: Any, op: Any, keep: Tuple) -> None:
        self._buffer, self._runtime, self._op, self._keep = buffer, runtime, op, keep
        self._handle_key = 0  # a dispatch's layout_range address (Buffer._unreceived), 0 for a combine

    def __call__(self) -> None:
        op, self._op = self._op, None
        if op is None:
            raise _llep.LlepFailedPreconditionError('this receive hook already ran')
        if self._handle_key:
            self._buffer._unreceived.discard(self._handle_key)
        try:  # no tensor is touched here: no torch-function guard needed
            self._runtime.receive(op, self._buffer._stream())
        finally:
            self._keep = None


class Buffer:
    """The expert-parallel communication buffer, low-latency mode (DeepEP V1 API).

    Attributes (as DeepEP's): rank, group_size, group, num_nvl_bytes, num_rdma_bytes, low_latency_mode,
    explicitly_destroy, enable_shrink, runtime, nvshmem_qp_depth; class attribute num_sms.

    llep keyword: metrics_layers, the MoE layers whose received tokens the buffer counts apart (a dispatch's `layer=`
    must be below it); default LLEP_METRICS_LAYERS (128). An engine that knows its model passes its layer count.
    """

    num_sms: int = 20
    _destroyed: bool = False  # class default too: a Buffer made without __init__ (tests) reads as not destroyed
    # The raw handle of the current stream of this buffer's device (0 on the CPU backend): bound per layout by
    # _backend to torch's raw-handle function and the device (no Python frame of ours per call).
    _stream = staticmethod(_no_stream)

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False, use_fabric: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm: Optional[Any] = None,
                 *, metrics_layers: Optional[int] = None) -> None:
        if group is not None:
            self.rank, self.group_size = dist.get_rank(group), dist.get_world_size(group)
        elif comm is not None:
            self.rank, self.group_size = comm.Get_rank(), comm.Get_size()
        else:
            raise ValueError('Buffer needs a torch.distributed group or an mpi4py communicator (comm)')
        for name, value in (('num_nvl_bytes', num_nvl_bytes), ('num_rdma_bytes', num_rdma_bytes)):
            if not isinstance(value, int) or value < 0:
                raise _invalid(f'{name} must be a non-negative int, got {value!r}')
        if num_rdma_bytes % 128 != 0:
            raise _invalid(f'num_rdma_bytes ({num_rdma_bytes}) must be a multiple of 128')
        if not isinstance(num_qps_per_rank, int) or num_qps_per_rank < 1:
            raise _invalid(f'num_qps_per_rank must be a positive int, got {num_qps_per_rank!r}')
        if metrics_layers is not None and (not isinstance(metrics_layers, int) or isinstance(metrics_layers, bool) or
                                           metrics_layers < 1):
            raise _invalid(f'metrics_layers must be a positive int, got {metrics_layers!r}')
        self.group = group
        self.comm = comm
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank  # a hint in DeepEP; llep needs no QPs per expert
        self.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode
        self.allow_mnnvl = allow_mnnvl
        self.use_fabric = use_fabric
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.nvshmem_qp_depth = 1 << 30  # llep's queues are flow-controlled: no T bound from a QP depth
        self.runtime: Optional[Any] = None  # created by the first low-latency call (collective)
        self._shape: Optional[Tuple[int, int, int]] = None
        # Every LLEP_* option comes from the native reader (runtime/base/env.h): one read site and one default each.
        self._options: Dict[str, Any] = _llep.read_options()
        if metrics_layers is not None:
            self._options['metrics_layers'] = metrics_layers
        self._metrics = bool(self._options['metrics'])
        self.metrics_port: Optional[int] = None  # the exporter's bound port once started
        self._destroyed = False
        self._device: Optional[torch.device] = None
        self._dev_index = -1  # CUDA device index of the backend, -1 for the CPU backend
        self._out_specs: Dict[Tuple[bool, bool], _DispatchOutputs] = {}  # per (use_fp8, use_ue8m0)
        self._combine_specs: Tuple = ()  # combine's expected x / src_info / layout_range shapes
        self._dispatched = False  # a combine needs a dispatch of this layout before it
        # layout_range addresses of dispatches whose receive hook has not run: their handle is not written yet.
        self._unreceived: set = set()
        # Output tensors handed out again once nothing refers to them (llep/_output_pool.py; LLEP_REUSE_OUTPUTS).
        reuse = bool(self._options['reuse_outputs']) and _POOL_AVAILABLE
        self._dispatch_pool = OutputPool(per_key=2, max_sets=4) if reuse else None  # per (mode, stream)
        self._combine_pool = OutputPool(per_key=2, max_sets=16) if reuse else None  # per (tokens, stream)
        default = 'cuda' if getattr(_llep, 'HAVE_CUDA', False) and torch.cuda.is_available() else 'cpu'
        self.backend = self._options['backend'] or default

    # ------------------------------------------------------------------------------------------ lifecycle

    def _allgather(self, blob: bytes) -> list:
        if self.group is not None:
            out = [None] * self.group_size
            dist.all_gather_object(out, blob, group=self.group)
            return out
        return list(self.comm.allgather(blob))

    def _backend(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> Any:
        if self.runtime is not None and (num_max_dispatch_tokens_per_rank, hidden, num_experts) == self._shape:
            return self.runtime  # the per-call case: one tuple compare
        if self._destroyed:
            raise _llep.LlepFailedPreconditionError('Buffer.destroy() was called')
        shape = _layout_shape(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        if self.runtime is not None:
            if shape != self._shape:
                raise _invalid(f'this Buffer holds the layout for (num_max_dispatch_tokens_per_rank, hidden, '
                               f'num_experts) = {self._shape}, the call uses {shape}; every call must agree '
                               '(switch with clean_low_latency_buffer on all ranks)')
            return self.runtime
        self._check_size(shape)
        if self.backend == 'cuda':
            if not getattr(_llep, 'HAVE_CUDA', False):
                raise _llep.LlepUnimplementedError('llep was built without CUDA: use Buffer.backend = "cpu"')
            self._device = torch.device('cuda', torch.cuda.current_device())
            o = self._options
            self.runtime = _llep.GpuBuffer(shape[0], shape[1], shape[2], self.group_size, self.rank, self._allgather,
                                           self._device.index, o['timeout_s'], o['num_ctas'], o['kernel_trace'],
                                           self._metrics, -1 if self.allow_nvlink_for_low_latency_mode else 1,
                                           o['fabric_provider'], o['proxy_threads'], o['metrics_layers'],
                                           bool(self.enable_shrink))
        elif self.backend == 'cpu':
            self._device = torch.device('cpu')
            o = self._options
            self.runtime = _llep.CpuBuffer(shape[0], shape[1], shape[2], self.group_size, self.rank, self._allgather,
                                           o['fabric_provider'], o['timeout_s'], o['proxy_threads'], self._metrics,
                                           o['metrics_layers'], bool(self.enable_shrink))
        else:
            raise _invalid(f'Buffer.backend must be "cuda" or "cpu", got {self.backend!r}')
        self._shape = shape
        self._dev_index = self._device.index if self._device.type == 'cuda' else -1
        # The stream read of every call (_stream), bound once.
        if self._dev_index < 0:
            self._stream = _no_stream
        elif _raw_stream is not None:
            self._stream = functools.partial(_raw_stream, self._dev_index)
        else:
            self._stream = functools.partial(_torch_stream, self._device)
        self._out_specs = {}
        self._dispatched = False
        self._unreceived.clear()
        self._clear_pools()  # the outputs of another layout
        E_loc, rows = shape[2] // self.group_size, self.group_size * shape[0]
        self._combine_specs = ((E_loc, rows, shape[1]), (E_loc, rows), (E_loc, self.group_size))
        port = int(self._options['metrics_port'])
        if port >= 0 and self._metrics:
            local = int(os.environ.get('LOCAL_RANK', self.rank))  # the launcher's variable, not an llep option
            labels = dict(kv.split('=', 1) for kv in self._options['metrics_labels'].split(',') if kv)
            self.start_metrics_exporter(port + local if port > 0 else port, self._options['metrics_addr'], labels,
                                        float(self._options['metrics_interval_s']))
        return self.runtime

    # ------------------------------------------------------------------------------------------ metrics (llep)

    def _metrics_runtime(self) -> Any:
        if self._destroyed:
            raise _llep.LlepFailedPreconditionError('Buffer.destroy() was called')
        if self.runtime is None:
            raise _llep.LlepFailedPreconditionError(
                'metrics start with the buffer: make a low-latency call (or clean_low_latency_buffer) first')
        if self.runtime.metrics_shape == (0, 0):
            raise _llep.LlepFailedPreconditionError('metrics are off for this buffer (LLEP_METRICS=0)')
        return self.runtime

    def metrics_snapshot(self, flush: bool = True) -> Dict[str, Any]:
        """Plain values for an engine's own registry (llep addition). The counters are monotonic totals since the
        buffer was created, counted by the kernels (or the CPU backend) themselves, so they keep counting under
        CUDA-graph replay. Keys: ops / timeouts ({'dispatch': n, 'combine': n}); latency: per op and phase
        ('send', 'recv_wait', 'total') a dict with 'bounds_s' (bucket upper bounds), 'counts' (per bucket, the
        last one +Inf, not cumulative), 'sum_s', 'count'; recv_wait_s: per op a float64 tensor [group_size];
        dispatch_selections: int64 [group_size] ((token, expert) selections sent per destination rank);
        layer_expert_recv_tokens: int64 [metrics_layers, num_local_experts], the sum of recv_count over the
        dispatches of each layer (the `layer` keyword of low_latency_dispatch); expert_recv_tokens: int64
        [num_local_experts], its sum over layers.
        On the GPU an operation's latencies are binned by a later operation's receive launch; `flush` first
        queues that binning on the current stream and waits for it (the only synchronisation here)."""
        runtime = self._metrics_runtime()
        if flush and self._gpu and torch.cuda.is_current_stream_capturing():
            raise _llep.LlepFailedPreconditionError(
                'metrics_snapshot(flush=True) waits for the stream, which a graph capture forbids: pass flush=False '
                'or snapshot outside the capture')
        if flush and self._gpu:
            runtime.flush_metrics(torch.cuda.current_stream(self._device).cuda_stream)
            torch.cuda.current_stream(self._device).synchronize()
        raw = runtime.metrics_snapshot()
        ops = ('dispatch', 'combine')
        phases = ('send', 'recv_wait', 'total')
        bounds = [b / 1e9 for b in raw['latency_bounds_ns']]
        latency = {op: {ph: {'bounds_s': bounds, 'counts': list(raw['latency_buckets'][i][j]),
                             'sum_s': raw['latency_sum_ns'][i][j] / 1e9,
                             'count': int(sum(raw['latency_buckets'][i][j]))}
                        for j, ph in enumerate(phases)} for i, op in enumerate(ops)}
        per_layer = torch.tensor(raw['expert_recv_tokens'], dtype=torch.int64)
        return {
            'ops': dict(zip(ops, raw['ops'])),
            'timeouts': dict(zip(ops, raw['timeouts'])),
            'latency': latency,
            'recv_wait_s': {op: torch.tensor(raw['recv_wait_ns'][i], dtype=torch.float64) / 1e9
                            for i, op in enumerate(ops)},
            'dispatch_selections': torch.tensor(raw['dispatch_selections'], dtype=torch.int64),
            'layer_expert_recv_tokens': per_layer,
            'expert_recv_tokens': per_layer.sum(dim=0),
        }

    def start_metrics_exporter(self, port: int = 0, address: str = '127.0.0.1',
                               labels: Optional[Dict[str, str]] = None, interval_s: float = 1.0) -> int:
        """Starts this rank's Prometheus exporter (llep addition): a collector thread snapshots the counters every
        interval_s without touching the caller's streams, and /metrics is served on address:port (port 0: an
        ephemeral one). Returns the bound port (also in self.metrics_port)."""
        if interval_s <= 0:
            raise _invalid(f'interval_s must be positive, got {interval_s}')
        runtime = self._metrics_runtime()
        self.metrics_port = runtime.start_metrics_exporter(address, int(port), dict(labels or {}), float(interval_s))
        return self.metrics_port

    def observe_decode_step(self, seconds: float, tokens: int) -> None:
        """Records an engine's decode step on this rank's exporter (llep addition): `seconds` into the
        llep_decode_step_seconds histogram, `tokens` (fed through the model in that step) added to
        llep_decode_tokens_total, whose rate is tokens/s. A no-op while no exporter runs, so an engine can call it
        every step; a negative or non-finite value is an LlepInvalidArgumentError."""
        if self.metrics_port is None:
            return
        self._metrics_runtime().observe_decode_step(float(seconds), int(tokens))

    def stop_metrics_exporter(self) -> None:
        if self.runtime is not None:
            self.runtime.stop_metrics_exporter()
        self.metrics_port = None

    @property
    def _gpu(self) -> bool:
        return self.backend == 'cuda'

    def check_errors(self, bad_input: bool = True) -> None:
        """Raises the error a GPU kernel of this buffer recorded (bad expert id, silent peer, ...), if any: a fatal one
        first. Kernels run asynchronously: synchronise the stream first to cover the calls made so far. (llep
        addition; every low-latency call raises fatal errors itself before it queues work, but bad input the kernels
        dropped is raised only here.) bad_input=False raises fatal errors only, as a call does: for a check between
        collective steps without a synchronisation (a graph replay), where bad input recorded by a kernel that may
        or may not have finished would be raised on some ranks and not others."""
        if self.runtime is not None and self._gpu:
            self.runtime.check_errors(bad_input)

    def _check_size(self, shape: Tuple[int, int, int]) -> None:
        need = _llep.ll_buffer_bytes(shape[0], shape[1], self.group_size, shape[2])
        if 0 < self.num_rdma_bytes < need:
            raise _invalid(f'num_rdma_bytes ({self.num_rdma_bytes}) is smaller than the {need} bytes this shape needs; '
                           'size it with Buffer.get_low_latency_rdma_size_hint')

    def destroy(self) -> None:
        """Collectively releases the buffer (requires explicitly_destroy=True, as DeepEP)."""
        if not self.explicitly_destroy:
            raise RuntimeError('destroy() requires Buffer(..., explicitly_destroy=True)')
        if self.runtime is not None:
            runtime, self.runtime = self.runtime, None
            runtime.close()
        self._clear_pools()
        self._destroyed = True

    def _clear_pools(self) -> None:
        for pool in (self._dispatch_pool, self._combine_pool):
            if pool is not None:
                pool.clear()

    def _outputs(self, pool: Optional[OutputPool], key: Tuple, make: Callable[..., Tensors],
                 *args: Any) -> Tuple[Sequence[Optional[torch.Tensor]], Sequence[int]]:
        """A call's output tensors and their data addresses (0 for None): a free set `pool` keeps under `key` (the
        call's mode or tokens, then its raw stream, last), else fresh ones from make(block, *args), which the pool
        adopts while it has room (before they are bound anywhere else: its counts then are the set's free state; made
        in one allocation then, block=True, so the pool checks one storage per set). Not pooled: reuse off, or a stream
        being captured into a CUDA graph (outputs from the graph's pool, as torch allocates them there; the legacy
        stream, 0, cannot be captured, so its calls make no capture query). A capture also lets go of both pools'
        sets: an engine that captures its decode steps after eager warm-ups would otherwise keep the warm-ups' outputs
        (up to 4 dispatch sets, 235 MB each at T=128 on 2 ranks, FP8) for nothing. Sets a caller still holds stay
        valid (the pool only drops its references); eager calls after the capture fill the pools again."""
        if pool is None:
            outs = make(False, *args)
        elif key[-1] and _capturing is not None and _capturing():
            if len(pool):
                self._clear_pools()
            outs = make(False, *args)
        else:
            got = pool.take(key)
            if got is not None:
                return got
            outs = make(pool.has_room(key), *args)
            pool.adopt(key, outs)
        return outs, [0 if t is None else t.data_ptr() for t in outs]

    def __del__(self) -> None:
        # No collective here (DeepEP notes a destructor barrier can hang exception handling): just stop the proxy.
        self.runtime = None

    # ------------------------------------------------------------------------------------------ static

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, 'The SM count must be even'
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream (a completed event when there is no CUDA)."""
        if torch.cuda.is_available():
            return EventOverlap(_TorchCudaEvent())
        return EventOverlap(CompletedEvent())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes llep's low-latency buffer needs for this shape (smaller than DeepEP's for the same shape)."""
        return _llep.ll_buffer_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    def get_comm_stream(self) -> Any:
        """The stream llep's kernels run on: the caller's current stream (llep has no stream of its own)."""
        if not self._gpu:
            raise NotImplementedError('the CPU backend has no communication stream')
        return torch.cuda.current_stream()

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        raise NotImplementedError('get_local_buffer_tensor is not provided by llep')

    # ------------------------------------------------------------------------------------------ normal mode

    def get_dispatch_layout(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError('llep implements DeepEP\'s low-latency mode only')

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError('llep implements DeepEP\'s low-latency mode only')

    def combine(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError('llep implements DeepEP\'s low-latency mode only')

    # ------------------------------------------------------------------------------------------ low latency

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective. llep's signals carry call sequence numbers, so nothing needs zeroing between calls; this (re)builds
        the layout for (num_max_dispatch_tokens_per_rank, hidden, num_experts) if it changed, and returns the buffer to a
        usable state after a failed call, without re-creating it:
          - enable_shrink=True: a barrier through the buffer among the unmasked ranks (queued on the current stream);
            a rank silent for the timeout (LLEP_TIMEOUT_S) is masked instead of failing, as in DeepEP.
          - otherwise every rank must call it: after a timeout (LlepTimeoutError) or another fatal error the ranks
            agree on where their call sequences stand and reset it (the GPU backend synchronises the device), so the
            next calls are correct. Receive hooks left from before are void. A failed proxy cannot be recovered.
        Never inside a CUDA graph capture (as DeepEP's: SGLang calls it outside graphs)."""
        if self._destroyed:
            raise _llep.LlepFailedPreconditionError('Buffer.destroy() was called')
        shape = _layout_shape(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self._check_size(shape)  # before closing anything: a refused switch keeps the old layout usable
        if self.runtime is not None and shape != self._shape:
            runtime, self.runtime = self.runtime, None
            runtime.close()
            self._backend(*shape)
            self._allgather(b'')
            return
        self._unreceived.clear()  # hooks left from before are void
        self._backend(*shape).clean(self._stream())

    # Host path (issue #19): these two calls are on every decode step of an engine that does not capture graphs, so
    # they do per call only what cannot be done once: a few attribute reads to check the tensors (the detailed
    # messages are built only when a check fails), the output allocations, one native call. Torch-function handling
    # is off inside where it is on for the call's arguments (a default device set with torch.set_default_device routes
    # every tensor call through a Python hook, ~3x dearer; a tensor subclass its own), and the stream is read as a raw
    # handle. Both backends share one call path.

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False, *, layer: int = 0,
                             combine_weights: Optional[torch.Tensor] = None, **kwargs: Any) -> \
            Tuple[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor], torch.Tensor, Tuple, EventOverlap,
                  Optional[Callable[[], None]]]:
        """Sends each token to its top-k experts (DeepEP V1 semantics; see shared/spec/deepep-ll-api.md §4.1).

        Returns (recv_x or (recv_x, recv_x_scales), recv_count, handle, event, hook). recv_x is
        [num_local_experts, num_ranks * T, hidden]; rows of one (expert, source rank) block are in source-token
        order and blocks in source order, so the result is deterministic.

        layer (llep keyword, default 0): the MoE layer this call serves, so the per-expert receive counts are kept per
        layer (metrics_snapshot()['layer_expert_recv_tokens'], llep_expert_recv_tokens_total{layer=...}); it is an
        argument of the kernels, so a captured graph keeps counting each of its dispatches under its own layer.
        Must be in [0, metrics_layers) (the Buffer keyword, default LLEP_METRICS_LAYERS).

        combine_weights (llep keyword, default None): the float32 [num_tokens, num_topk] topk_weights this dispatch's
        combine will pass. Given, they travel with the tokens and the combine reduces each token's rows on the experts'
        ranks, returning one row per (token, rank) instead of one per (token, expert) (kernels/EXPERT_SIDE_COMBINE.md).
        The combine's topk_weights must be the same values (checked bit for bit); combine such a dispatch before the
        next-but-one dispatch on this buffer (its half's next dispatch replaces the plan the experts' ranks keep).
        Not DeepEP-fork's dispatch topk_weights, which returns seven values.
        """
        if kwargs:
            _check_fork_kwargs('low_latency_dispatch', kwargs, _DISPATCH_FORK_KWARGS)
        if async_finish and return_recv_hook:
            raise _invalid('async_finish and return_recv_hook are mutually exclusive')
        no_tf = _has_torch_function(x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                                    combine_weights)
        if no_tf:  # only where a mode or a subclass would route the tensor calls below through Python
            no_tf = _NoTorchFunction()
            no_tf.__enter__()
        try:
            x_shape = x.shape if isinstance(x, _Tensor) else ()
            if len(x_shape) != 2:
                raise _invalid('x must be a 2-D torch.Tensor [num_tokens, hidden]')
            num_tokens, hidden = x_shape
            runtime = self.runtime  # _backend's per-call case, without the call
            if runtime is None or (num_max_dispatch_tokens_per_rank, hidden, num_experts) != self._shape:
                runtime = self._backend(num_max_dispatch_tokens_per_rank, hidden, num_experts)
            dev_index = self._dev_index
            out = self._dispatch_outputs(use_fp8, use_ue8m0)
            # _fast_ok written out for x and topk_idx (one Python call each fewer; x's type was tested above).
            cpu = dev_index < 0
            if not (x.dtype is _BF16 and x.is_contiguous() and x.get_device() == dev_index and (not cpu or x.is_cpu) and
                    isinstance(topk_idx, _Tensor) and topk_idx.dtype is topk_idx_t and topk_idx.is_contiguous() and
                    topk_idx.get_device() == dev_index and (not cpu or topk_idx.is_cpu) and
                    len(topk_shape := topk_idx.shape) == 2 and topk_shape[0] == num_tokens and
                    (cumulative_local_expert_recv_stats is None or
                     _fast_ok_shape(cumulative_local_expert_recv_stats, torch.int32, out.count_shape, dev_index)) and
                    (dispatch_wait_recv_cost_stats is None or
                     _fast_ok_shape(dispatch_wait_recv_cost_stats, torch.int64, (self.group_size,), dev_index)) and
                    (combine_weights is None or (_fast_ok(combine_weights, torch.float32, dev_index) and
                                                 combine_weights.shape == topk_shape))):
                self._explain_dispatch(x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                                       combine_weights)
            stream = self._stream()
            (recv_x, scales, recv_count, src_info, layout_range), addr = self._outputs(
                self._dispatch_pool, (use_fp8, use_ue8m0, stream), _new_dispatch_outputs, x, out, use_fp8)
            layout_range_ptr = addr[4]
            plan_key = next(_plan_keys)
            # Named as DispatchCall's fields (runtime/protocol/ll_call.h), in their order; addresses, 0 for none.
            op = runtime.dispatch(
                x=x.data_ptr(), topk_idx=topk_idx.data_ptr(),
                # None or an address (0 for an empty batch, which still carries them)
                combine_weights=None if combine_weights is None else combine_weights.data_ptr(),
                num_tokens=num_tokens, num_topk=topk_shape[1], use_fp8=use_fp8, round_scale=round_scale,
                use_ue8m0=use_ue8m0, recv_x=addr[0], recv_scales=addr[1], recv_count=addr[2], src_info=addr[3],
                layout_range=layout_range_ptr,
                cumulative_local_expert_recv_stats=0 if cumulative_local_expert_recv_stats is None else
                cumulative_local_expert_recv_stats.data_ptr(),
                wait_recv_cost_stats=0 if dispatch_wait_recv_cost_stats is None else
                dispatch_wait_recv_cost_stats.data_ptr(),
                layer=layer, plan_key=plan_key, split=return_recv_hook, stream=stream)
            self._dispatched = True
            if self._unreceived:  # an entry at this address is stale: its hook was dropped unrun and the memory reused
                self._unreceived.discard(layout_range_ptr)
            event, hook = _NO_EVENT, None
            if return_recv_hook or async_finish:
                event, hook = self._event_or_hook(runtime, op, return_recv_hook, (
                    x, topk_idx, recv_x, scales, recv_count, src_info, layout_range,
                    cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, combine_weights))
                if return_recv_hook:  # its hook keeps layout_range alive (so the address unique) until it runs
                    self._unreceived.add(layout_range_ptr)
                    hook._handle_key = layout_range_ptr
            tokens = _HandleTokens(num_max_dispatch_tokens_per_rank)
            tokens.plan_key = plan_key
            if combine_weights is not None:
                tokens.expert_reduced = True
            handle = (src_info, layout_range, tokens, hidden, int(num_experts))
            tokens.made = (src_info, layout_range, self._combine_specs, topk_idx, topk_idx._version)
            return (recv_x, scales) if use_fp8 else recv_x, recv_count, handle, event, hook
        finally:
            if no_tf:
                no_tf.__exit__(None, None, None)

    def _dispatch_outputs(self, use_fp8: bool, use_ue8m0: bool) -> _DispatchOutputs:
        """Shapes, strides and dtypes of a dispatch's outputs for this layout (computed once per mode)."""
        key = (use_fp8, use_ue8m0)
        spec = self._out_specs.get(key)
        if spec is None:
            T, hidden, num_experts = self._shape
            R = self.group_size
            E_loc, rows = num_experts // R, R * T
            groups, s_dtype = (hidden // 512, torch.int32) if use_ue8m0 else (hidden // 128, torch.float32)
            spec = _DispatchOutputs((E_loc, rows, hidden), (_FP8 or torch.uint8) if use_fp8 else torch.bfloat16,
                                    (E_loc, rows, groups), (groups * rows, 1, rows), s_dtype, (E_loc,), (E_loc, rows),
                                    (E_loc, R))
            self._out_specs[key] = spec
        return spec

    def _explain_dispatch(self, x: Any, topk_idx: Any, cumulative: Any, wait: Any, weights: Any = None) -> None:
        """The detailed checks of dispatch's tensors: raises the precise error (a fast check failed)."""
        dev = self._device
        T, _, num_experts = self._shape
        R = self.group_size
        _check_tensor('x', x, torch.bfloat16, (None, None), dev)
        _check_tensor('topk_idx', topk_idx, topk_idx_t, (x.size(0), None), dev)
        if cumulative is not None:
            _check_tensor('cumulative_local_expert_recv_stats', cumulative, torch.int32, (num_experts // R,), dev)
        if wait is not None:
            _check_tensor('dispatch_wait_recv_cost_stats', wait, torch.int64, (R,), dev)
        if weights is not None:
            _check_tensor('combine_weights', weights, torch.float32, tuple(topk_idx.shape), dev)
        raise _invalid('dispatch arguments are inconsistent')

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None, **kwargs: Any) -> \
            Tuple[torch.Tensor, EventOverlap, Optional[Callable[[], None]]]:
        """Returns expert outputs to their tokens' ranks and reduces them: out[t] = sum_k w[t,k] * y(t,k) in fp32
        in top-k order, -1 slots skipped, bitwise deterministic. use_logfmt is accepted and sent as BF16 (more precise
        than DeepEP's lossy LogFMT; the spec allows this fallback)."""
        if kwargs:
            _check_fork_kwargs('low_latency_combine', kwargs, _COMBINE_FORK_KWARGS)
        if use_logfmt and zero_copy:
            raise _invalid('use_logfmt and zero_copy cannot be combined')
        if async_finish and return_recv_hook:
            raise _invalid('async_finish and return_recv_hook are mutually exclusive')
        if type(handle) is not tuple or len(handle) != 5:
            raise _invalid('handle must be the 5-tuple low_latency_dispatch returned')
        src_info, layout_range, T, hidden, num_experts = handle
        no_tf = _has_torch_function(x, topk_idx, topk_weights, src_info, layout_range, out,
                                    combine_wait_recv_cost_stats)
        if no_tf:  # only where a mode or a subclass would route the tensor calls below through Python
            no_tf = _NoTorchFunction()
            no_tf.__enter__()
        try:
            runtime = self.runtime  # _backend's per-call case, without the call
            if runtime is None or (T, hidden, num_experts) != self._shape:
                runtime = self._backend(T, hidden, num_experts)
            dev_index = self._dev_index
            spec = self._combine_specs
            if not self._dispatched:
                raise _llep.LlepFailedPreconditionError(
                    'low_latency_combine before any low_latency_dispatch of this layout: pass the handle a dispatch '
                    'returned')
            made = getattr(T, 'made', None)
            # The dispatch's own src_info / layout_range, and its topk_idx unchanged since (no in-place op moved its
            # version), were checked there: only their identities are compared (_HandleTokens.made).
            from_dispatch = made is not None and made[0] is src_info and made[1] is layout_range and made[2] is spec
            if not ((from_dispatch and made[3] is topk_idx and topk_idx._version == made[4]) or
                    _fast_ok(topk_idx, topk_idx_t, dev_index)) or len(topk_shape := topk_idx.shape) != 2:
                self._explain_combine(x, zero_copy, topk_idx, topk_weights, src_info, layout_range, out,
                                      combine_wait_recv_cost_stats)
            num_tokens = topk_shape[0]
            # _fast_ok written out for the three tensors of every combine (one Python call each fewer).
            cpu = dev_index < 0
            if not (isinstance(topk_weights, _Tensor) and topk_weights.dtype is _F32 and
                    topk_weights.is_contiguous() and topk_weights.get_device() == dev_index and
                    (not cpu or topk_weights.is_cpu) and topk_weights.shape == topk_shape and
                    (zero_copy or (isinstance(x, _Tensor) and x.dtype is _BF16 and x.is_contiguous() and
                                   x.get_device() == dev_index and (not cpu or x.is_cpu) and x.shape == spec[0])) and
                    (from_dispatch or
                     (_fast_ok(src_info, torch.int32, dev_index) and src_info.shape == spec[1] and
                      _fast_ok(layout_range, torch.int64, dev_index) and layout_range.shape == spec[2])) and
                    (out is None or
                     (isinstance(out, _Tensor) and out.dtype is _BF16 and out.is_contiguous() and
                      out.get_device() == dev_index and (not cpu or out.is_cpu) and
                      out.shape == (num_tokens, hidden))) and
                    (combine_wait_recv_cost_stats is None or
                     _fast_ok_shape(combine_wait_recv_cost_stats, torch.int64, (self.group_size,), dev_index))):
                self._explain_combine(x, zero_copy, topk_idx, topk_weights, src_info, layout_range, out,
                                      combine_wait_recv_cost_stats)
            layout_range_ptr = layout_range.data_ptr()
            if self._unreceived and layout_range_ptr in self._unreceived:
                raise _llep.LlepFailedPreconditionError(
                    'this handle\'s dispatch was not received yet (its layout_range is unwritten): run its receive '
                    'hook before combining')
            stream = self._stream()
            if out is None:
                (out,), (out_ptr,) = self._outputs(self._combine_pool, (num_tokens, stream), _new_combine_out,
                                                   topk_weights, num_tokens, hidden)
            else:
                out_ptr = out.data_ptr()
            # Named as CombineCall's fields (runtime/protocol/ll_call.h), in their order; addresses, 0 for none.
            op = runtime.combine(
                x=0 if zero_copy else x.data_ptr(), zero_copy=zero_copy, topk_idx=topk_idx.data_ptr(),
                topk_weights=topk_weights.data_ptr(), num_tokens=num_tokens, num_topk=topk_shape[1],
                layout_range=layout_range_ptr, out=out_ptr,
                wait_recv_cost_stats=0 if combine_wait_recv_cost_stats is None else
                combine_wait_recv_cost_stats.data_ptr(),
                plan_key=getattr(T, 'plan_key', 0), expert_reduced=getattr(T, 'expert_reduced', False),
                split=return_recv_hook, stream=stream)
            event, hook = _NO_EVENT, None
            if return_recv_hook or async_finish:
                event, hook = self._event_or_hook(runtime, op, return_recv_hook,
                                                  (x, topk_idx, topk_weights, layout_range, out,
                                                   combine_wait_recv_cost_stats))
            return out, event, hook
        finally:
            if no_tf:
                no_tf.__exit__(None, None, None)

    def _explain_combine(self, x: Any, zero_copy: bool, topk_idx: Any, topk_weights: Any, src_info: Any,
                         layout_range: Any, out: Any, wait: Any) -> None:
        """The detailed checks of combine's tensors: raises the precise error (a fast check failed)."""
        dev = self._device
        R = self.group_size
        (E_loc, rows, hidden), _, _ = self._combine_specs
        if not zero_copy:  # with zero_copy DeepEP ignores x (the rows are already in the buffer)
            _check_tensor('x', x, torch.bfloat16, (E_loc, rows, hidden), dev)
        _check_tensor('topk_idx', topk_idx, topk_idx_t, (None, None), dev)
        _check_tensor('topk_weights', topk_weights, torch.float32, tuple(topk_idx.shape), dev)
        _check_tensor('handle[0] (src_info)', src_info, torch.int32, (E_loc, rows), dev)
        _check_tensor('handle[1] (layout_range)', layout_range, torch.int64, (E_loc, R), dev)
        if out is not None:
            _check_tensor('out', out, torch.bfloat16, (topk_idx.size(0), hidden), dev)
        if wait is not None:
            _check_tensor('combine_wait_recv_cost_stats', wait, torch.int64, (R,), dev)
        raise _invalid('combine arguments are inconsistent')

    def _event_or_hook(self, runtime: Any, op: Any, return_recv_hook: bool,
                       keep: Tuple) -> Tuple[EventOverlap, Optional[Callable[[], None]]]:
        """(event, hook) of a call with return_recv_hook (the hook holds `keep` until it ran) or async_finish (the
        event holds it: a CUDA event on the current stream, or a completed one on the CPU backend)."""
        if return_recv_hook:
            return _NO_EVENT, _ReceiveHook(self, runtime, op, keep)
        return EventOverlap(_TorchCudaEvent() if self._dev_index >= 0 else CompletedEvent(), keep), None

    def get_next_low_latency_combine_buffer(self, handle: object) -> torch.Tensor:
        """bf16 [num_local_experts, num_ranks * T, hidden] view of the staging the next combine reads with
        zero_copy=True; rows are padded to (hidden + hidden / 64) elements, as in DeepEP. On the GPU backend it is
        one fixed area for every call (the buffer half is picked on the device), so graphs may capture it: write it
        after the previous combine was sent (stream order)."""
        if type(handle) is not tuple or len(handle) != 5:
            raise _invalid('handle must be the 5-tuple low_latency_dispatch returned')
        src_info, layout_range, T, hidden, num_experts = handle
        runtime = self._backend(T, hidden, num_experts)
        E_loc, rows, m = num_experts // self.group_size, self.group_size * T, runtime.combine_row_stride
        if self._gpu:
            flat = torch.as_tensor(_DeviceMemory(runtime.next_combine_buffer(), E_loc * rows * m * 2),
                                   device=self._device).view(torch.bfloat16)
        else:
            flat = torch.frombuffer(runtime.next_combine_buffer(), dtype=torch.bfloat16)
        return flat.as_strided((E_loc, rows, hidden), (rows * m, m, 1))

    # ------------------------------------------------------------------------------------------ shrink / mask

    def _shrink_runtime(self) -> Any:
        if self._destroyed:
            raise _llep.LlepFailedPreconditionError('Buffer.destroy() was called')
        if not self.enable_shrink:
            raise _llep.LlepFailedPreconditionError('rank masking needs Buffer(..., enable_shrink=True)')
        if self.runtime is None:
            raise _llep.LlepFailedPreconditionError(
                'the mask starts with the buffer: make a low-latency call (or clean_low_latency_buffer) first')
        return self.runtime

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Masks (mask=True) or unmasks a rank on this rank's buffer (DeepEP semantics, enable_shrink=True): a masked
        rank is not sent to and not waited on, its tokens are dropped from dispatch and its experts' terms from
        combine. Stream-ordered on the GPU backend (capturable)."""
        if not isinstance(rank_to_mask, int) or isinstance(rank_to_mask, bool):
            raise _invalid(f'rank_to_mask must be an int, got {type(rank_to_mask).__name__}')
        self._shrink_runtime().set_masked(rank_to_mask, bool(mask), self._stream())

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Fills mask_status (int32 [num_ranks], on the buffer's device) with this rank's mask: 1 = masked (by
        low_latency_update_mask_buffer, or because it stayed silent for the timeout)."""
        runtime = self._shrink_runtime()
        _check_tensor('mask_status', mask_status, torch.int32, (self.group_size,), self._device)
        runtime.query_masks(mask_status.data_ptr(), self._stream())

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmasks every rank on this rank's buffer (DeepEP semantics)."""
        self._shrink_runtime().clear_masks(self._stream())
