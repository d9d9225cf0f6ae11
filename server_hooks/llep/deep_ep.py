"""A stand-in for DeepEP V1's `deep_ep` module (low-latency mode): `from llep.deep_ep import Buffer, Config`.

Nothing is installed under the name `deep_ep` by default. Call `install_as_deep_ep()` to make `import deep_ep`
resolve to this module in the current process (explicit opt-in, so a real DeepEP is never shadowed by accident).
"""
import sys

from llep.buffer import Buffer, Config, topk_idx_t
from llep.utils import EventOverlap

__all__ = ['Buffer', 'Config', 'EventOverlap', 'topk_idx_t', 'install_as_deep_ep']


def install_as_deep_ep() -> None:
    """Registers this module as `deep_ep` in sys.modules (idempotent)."""
    sys.modules['deep_ep'] = sys.modules[__name__]
