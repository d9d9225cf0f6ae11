"""llep.engine: a DeepSeek-V3-style MoE decode engine in the shape of SGLang's DP-attention + EP mode, running its
MoE layers over one llep (or DeepEP) low-latency Buffer shared by all layers. One process per rank; each rank is an
attention data-parallel replica with its own requests and KV cache. See server_hooks/llep/engine/README.md."""
from .config import ModelConfig
from .engine import Engine, Request
from .model import Model
from .weights import init_weights, load_safetensors, save_safetensors

__all__ = ['ModelConfig', 'Engine', 'Request', 'Model', 'init_weights', 'load_safetensors', 'save_safetensors']
