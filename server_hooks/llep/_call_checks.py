"""The per-call argument checks of llep.Buffer (llep/buffer.py): the fork keywords DeepEP's forks pass, the fast
checks every call makes (a few attribute reads per tensor) and the detailed ones that build the message once a fast
check failed, the layout's integer arguments and the dispatch outputs' shapes. Kept apart so buffer.py holds the
calls themselves; imported there under the same names."""
import contextlib
import operator
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch

from llep import _llep

topk_idx_t = torch.int64
_FP8 = getattr(torch, 'float8_e4m3fn', None)  # torch < 2.1 has no float8: FP8 payloads come back as uint8

# Keyword arguments that forks of DeepEP accept and engines pass (shared/spec/deepep-ll-api.md §4.9).
_DISPATCH_FORK_KWARGS = ('use_nvfp4', 'x_global_scale', 'use_ue8m0_for_sf', 'topk_weights', 'use_eager')
_COMBINE_FORK_KWARGS = ('overlap', 'packed_recv_count', 'comp_signal', 'block_m', 'threshold', 'num_sms',
                        'src_signals', 'src_signal_expect_value', 'use_eager')


def _invalid(msg: str) -> Exception:
    return _llep.LlepInvalidArgumentError(msg)


# The engine switch that makes an engine stop passing a fork keyword (shared/spec/engines.md §2.3, §3.5).
_SBO = "turn off SGLang's --enable-single-batch-overlap"
_FORK_SWITCH = {'overlap': _SBO, 'packed_recv_count': _SBO, 'comp_signal': _SBO, 'block_m': _SBO, 'threshold': _SBO,
                'num_sms': _SBO, 'src_signals': _SBO, 'src_signal_expect_value': _SBO,
                'use_nvfp4': "dispatch FP8 or BF16 (SGLang: --deepep-dispatcher-output-dtype fp8|bf16; vLLM: an FP8 "
                             "block-128 or unquantised MoE)",
                'x_global_scale': 'dispatch FP8 or BF16 (NVFP4 dispatch is not implemented)',
                'use_ue8m0_for_sf': 'dispatch FP8 or BF16 (NVFP4 dispatch is not implemented)',
                'topk_weights': 'apply the router weights in combine, not in dispatch',
                'use_eager': 'leave the fork-only use_eager unset'}


def _check_fork_kwargs(method: str, kwargs: Dict[str, Any], known: Tuple[str, ...]) -> None:
    for name, value in kwargs.items():
        if name not in known:
            raise TypeError(f'{method}() got an unexpected keyword argument {name!r}')
        if value is not None and value is not False:
            raise NotImplementedError(f'{method}({name}=...) is a DeepEP-fork feature llep does not implement: '
                                      f'{_FORK_SWITCH[name]}')


# Torch-function handling off: a mode (torch.set_default_device installs one) or a subclass would otherwise route every
# tensor call below through Python. The calls pass explicit devices, so nothing depends on the default device.
_NoTorchFunction = getattr(torch._C, 'DisableTorchFunction', contextlib.nullcontext)
# Whether any argument would route torch calls through Python: a torch-function mode is active, or one is a tensor
# subclass (or other object) with its own __torch_function__. One C call (~0.05 µs); the calls enter _NoTorchFunction
# only then (entering and leaving it cost ~0.3 µs of every call on H100 hosts, bench/RESULTS.md session 34).
_has_torch_function = getattr(torch._C, '_has_torch_function_variadic', lambda *args: True)
_raw_stream = getattr(torch._C, '_cuda_getCurrentRawStream', None)  # device index -> cudaStream_t as int
_capturing = getattr(torch._C, '_cuda_isCurrentStreamCapturing', None)  # () -> bool, for the current device


def _fast_ok(t: Any, dtype: torch.dtype, dev_index: int) -> bool:
    """The per-call tensor check: type, dtype, contiguity and device (-1 = CPU) in a few attribute reads; a failure
    goes to the detailed checks for the message."""
    return (isinstance(t, torch.Tensor) and t.dtype is dtype and t.is_contiguous() and t.get_device() == dev_index and
            (dev_index >= 0 or t.is_cpu))  # get_device() is -1 for CPU and for meta tensors too


def _fast_ok_shape(t: Any, dtype: torch.dtype, shape: Tuple[int, ...], dev_index: int) -> bool:
    """_fast_ok with the shape, for the optional statistics tensors (the caller skips a None, the usual case, without
    a call)."""
    return _fast_ok(t, dtype, dev_index) and t.shape == shape


def _layout_shape(num_max_dispatch_tokens_per_rank: Any, hidden: Any, num_experts: Any) -> Tuple[int, int, int]:
    """(T, hidden, num_experts) as ints; a float such as 8.5 is a TypeError, not silently truncated."""
    shape = (operator.index(num_max_dispatch_tokens_per_rank), operator.index(hidden), operator.index(num_experts))
    for name, v in zip(('num_max_dispatch_tokens_per_rank', 'hidden', 'num_experts'), shape):
        if not -2**31 <= v < 2**31:
            raise _invalid(f'{name} ({v}) is out of range')
    return shape


class _DispatchOutputs(NamedTuple):
    """Shapes, strides and dtypes of a dispatch's outputs for one layout and mode (Buffer._dispatch_outputs)."""
    x_shape: Tuple[int, ...]
    x_dtype: torch.dtype
    scales_shape: Tuple[int, ...]
    scales_stride: Tuple[int, ...]  # column-major in the last two dims (MN-major), as DeepGEMM's masked GEMM expects
    scales_dtype: torch.dtype
    count_shape: Tuple[int, ...]
    src_info_shape: Tuple[int, ...]
    layout_range_shape: Tuple[int, ...]


def _check_tensor(name: str, t: Any, dtype: torch.dtype, shape: Tuple[Optional[int], ...],
                  device: Optional[torch.device] = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise _invalid(f'{name} must be a torch.Tensor, got {type(t).__name__}')
    if t.dtype != dtype:
        raise _invalid(f'{name} must have dtype {dtype}, got {t.dtype}')
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = tuple('*' if s is None else s for s in shape)
        raise _invalid(f'{name} must have shape {want}, got {tuple(t.shape)}')
    if not t.is_contiguous():
        raise _invalid(f'{name} must be contiguous')
    want = device if device is not None else torch.device('cpu')
    if t.device != want:
        raise _invalid(f'{name} is on {t.device}, this Buffer works on {want}')
