"""llep: low-latency expert-parallel dispatch/combine for MoE decode, with DeepEP V1's low-latency API."""
import torch as _torch

from llep._platform import install_native_module as _install_native_module

_install_native_module(_torch)  # before anything imports llep._llep: the HIP build's module under a ROCm torch

from llep._llep import (LlepError, LlepFailedPreconditionError, LlepInvalidArgumentError, LlepTimeoutError,
                        LlepUnavailableError)
from llep.buffer import Buffer, Config, topk_idx_t
from llep.utils import EventOverlap

__all__ = ['Buffer', 'Config', 'EventOverlap', 'topk_idx_t', 'LlepError', 'LlepInvalidArgumentError',
           'LlepTimeoutError', 'LlepUnavailableError', 'LlepFailedPreconditionError']
