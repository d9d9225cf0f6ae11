"""Weights: random by default (each tensor from its own seed, so every rank builds the same shared weights and only
its own experts), or read from a directory of .safetensors files. Names follow the Hugging Face DeepSeek-V3 layout
(model.layers.{l}.mlp.experts.{e}.gate_proj.weight, ...), with GQA attention projections (q/k/v/o_proj).

The safetensors reader and writer use the `safetensors` package when it is installed and otherwise the format itself
(8-byte little-endian header length, a JSON header of name -> dtype / shape / byte range, then the bytes): Debian 12
does not package safetensors, and the format is small and fixed."""
import json
import os
import struct
import zlib
from typing import Dict, Iterable, Optional, Tuple

import torch

from .config import ModelConfig

_DTYPES = {'BF16': torch.bfloat16, 'F16': torch.float16, 'F32': torch.float32, 'I64': torch.int64,
           'I32': torch.int32}
_SAME_SIZE_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
                  torch.int64: torch.int64, torch.int32: torch.int32}


def shared_names(cfg: ModelConfig) -> Iterable[Tuple[str, Tuple[int, ...]]]:
    """Every weight but the routed experts', with its shape."""
    H, nh, nkv, hd = cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    yield 'model.embed_tokens.weight', (cfg.vocab_size, H)
    for layer in range(cfg.num_layers):
        p = f'model.layers.{layer}.'
        yield p + 'input_layernorm.weight', (H,)
        yield p + 'self_attn.q_proj.weight', (nh * hd, H)
        yield p + 'self_attn.k_proj.weight', (nkv * hd, H)
        yield p + 'self_attn.v_proj.weight', (nkv * hd, H)
        yield p + 'self_attn.o_proj.weight', (H, nh * hd)
        yield p + 'post_attention_layernorm.weight', (H,)
        yield p + 'mlp.gate.weight', (cfg.num_experts, H)
        yield p + 'mlp.gate.e_score_correction_bias', (cfg.num_experts,)
        for proj, shape in _mlp_shapes(cfg):
            yield p + f'mlp.shared_experts.{proj}.weight', shape
    yield 'model.norm.weight', (H,)
    yield 'lm_head.weight', (cfg.vocab_size, H)


def expert_names(cfg: ModelConfig, experts: range) -> Iterable[Tuple[str, Tuple[int, ...]]]:
    for layer in range(cfg.num_layers):
        for e in experts:
            for proj, shape in _mlp_shapes(cfg):
                yield f'model.layers.{layer}.mlp.experts.{e}.{proj}.weight', shape


def _mlp_shapes(cfg: ModelConfig):
    H, inter = cfg.hidden, cfg.moe_intermediate
    return (('gate_proj', (inter, H)), ('up_proj', (inter, H)), ('down_proj', (H, inter)))


def _keeps_fp32(name: str) -> bool:
    """Norms, the router and its bias stay fp32 (as DeepSeek keeps the router's scores); the rest is the model dtype."""
    return 'layernorm' in name or name == 'model.norm.weight' or '.mlp.gate.' in name


def _random(name: str, shape: Tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62))
    t = torch.randn(shape, generator=g, device=device)
    if name.endswith('layernorm.weight') or name == 'model.norm.weight':
        return 1.0 + 0.1 * t
    if name.endswith('e_score_correction_bias'):
        return 0.05 * t
    return t / shape[-1] ** 0.5


def init_weights(cfg: ModelConfig, seed: int = 0, experts: Optional[range] = None,
                 dtype: torch.dtype = torch.bfloat16, device: str = 'cpu') -> Dict[str, torch.Tensor]:
    """Random weights: the shared ones and those of `experts` (default: all). Norms, the router and its bias stay in
    fp32 (as DeepSeek keeps the router's scores); the rest is `dtype`. Drawn on `device` (a GPU draws the DeepSeek
    shape's gigabytes in seconds; the values depend on the device kind, the same on every rank of one kind)."""
    experts = range(cfg.num_experts) if experts is None else experts
    out = {}
    for name, shape in list(shared_names(cfg)) + list(expert_names(cfg, experts)):
        t = _random(name, shape, seed, torch.device(device))
        out[name] = t if _keeps_fp32(name) else t.to(dtype)
    return out


def save_safetensors(weights: Dict[str, torch.Tensor], path: str) -> None:
    """Writes one .safetensors file."""
    try:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in weights.items()}, path)
        return
    except ImportError:
        pass
    header, blobs, offset = {}, [], 0
    names = {v: k for k, v in _DTYPES.items()}
    for name, t in weights.items():
        data = t.detach().cpu().contiguous().view(_SAME_SIZE_INT[t.dtype]).numpy().tobytes()
        header[name] = {'dtype': names[t.dtype], 'shape': list(t.shape), 'data_offsets': [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(',', ':')).encode()
    raw += b' ' * (-len(raw) % 8)  # the format pads the header to 8 bytes
    with open(path, 'wb') as f:
        f.write(struct.pack('<Q', len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)


def _read_file(path: str, wanted) -> Dict[str, torch.Tensor]:
    try:
        from safetensors import safe_open
        with safe_open(path, framework='pt') as f:
            return {k: f.get_tensor(k) for k in f.keys() if wanted(k)}
    except ImportError:
        pass
    with open(path, 'rb') as f:
        (n,) = struct.unpack('<Q', f.read(8))
        header = json.loads(f.read(n))
        base = 8 + n
        out = {}
        for name, meta in header.items():
            if name == '__metadata__' or not wanted(name):
                continue
            if meta['dtype'] not in _DTYPES:
                raise ValueError(f'{path}: {name} has dtype {meta["dtype"]}, not one of {sorted(_DTYPES)}')
            b, e = meta['data_offsets']
            f.seek(base + b)
            dtype = _DTYPES[meta['dtype']]
            raw = bytearray(f.read(e - b))
            t = torch.frombuffer(raw, dtype=_SAME_SIZE_INT[dtype]) if raw else torch.empty(0, dtype=_SAME_SIZE_INT[dtype])
            out[name] = t.view(dtype).reshape(meta['shape'])
        return out


def load_safetensors(directory: str, cfg: ModelConfig, experts: Optional[range] = None,
                     dtype: torch.dtype = torch.bfloat16) -> Dict[str, torch.Tensor]:
    """The shared weights and those of `experts` from every .safetensors file in `directory`; a missing or misshapen
    tensor is a ValueError naming it."""
    experts = range(cfg.num_experts) if experts is None else experts
    need = dict(list(shared_names(cfg)) + list(expert_names(cfg, experts)))
    found: Dict[str, torch.Tensor] = {}
    files = sorted(f for f in os.listdir(directory) if f.endswith('.safetensors'))
    if not files:
        raise ValueError(f'{directory}: no .safetensors files')
    for f in files:
        found.update(_read_file(os.path.join(directory, f), need.__contains__))
    missing = [n for n in need if n not in found]
    if missing:
        raise ValueError(f'{directory}: {len(missing)} weights missing, e.g. {missing[:3]}')
    for name, shape in need.items():
        if tuple(found[name].shape) != shape:
            raise ValueError(f'{directory}: {name} has shape {tuple(found[name].shape)}, expected {shape}')
        found[name] = found[name].float() if _keeps_fp32(name) else found[name].to(dtype)
    return found
