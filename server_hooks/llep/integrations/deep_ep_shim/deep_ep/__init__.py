"""`deep_ep` answering with llep (llep-sglang puts this folder's parent first on PYTHONPATH): DeepEP V1's
low-latency Buffer API, implemented by llep."""
from llep.deep_ep import Buffer, Config, EventOverlap, topk_idx_t  # noqa: F401

__all__ = ['Buffer', 'Config', 'EventOverlap', 'topk_idx_t']
