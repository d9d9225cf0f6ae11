"""llep: low-latency expert-parallel dispatch/combine for MoE decode, with DeepEP V1's low-latency API."""
from llep._llep import (LlepError, LlepFailedPreconditionError, LlepInvalidArgumentError, LlepTimeoutError,
                        LlepUnavailableError)
from llep.buffer import Buffer, Config, topk_idx_t
from llep.utils import EventOverlap

__all__ = ['Buffer', 'Config', 'EventOverlap', 'topk_idx_t', 'LlepError', 'LlepInvalidArgumentError',
           'LlepTimeoutError', 'LlepUnavailableError', 'LlepFailedPreconditionError']
