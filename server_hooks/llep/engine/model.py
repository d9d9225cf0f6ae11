"""A DeepSeek-V3-style decoder in torch: RMSNorm, GQA attention with a per-request KV cache and rotary positions, a
router with DeepSeek's grouped top-k and bias correction, one shared expert and routed experts behind an MoE
implementation (moe.py: expert-parallel over a Buffer, or dense for the reference).

Attention is GQA, not MLA: this engine exists to measure and check the expert-parallel path, which is the same for
both; MLA's low-rank KV projections would add weights and code and change nothing the dispatch and combine see.

Numerics every path shares (so the EP engine and the dense reference agree token for token with BF16 dispatch):
activations are bf16 between blocks (the dtype DeepEP's dispatch takes), norms, the router and the attention softmax
run in fp32, an expert computes in fp32 from bf16 rows and returns bf16 rows, and the routed sum is fp32 in top-k
order, rounded to bf16 (llep's combine)."""
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .config import ModelConfig
from .experts import expert_mlp, stack_mlps


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(torch.bfloat16)


def route(cfg: ModelConfig, x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router: sigmoid scores; groups ranked by the sum of their two best bias-corrected scores; top-k
    over the best topk_groups groups by corrected score; weights are the uncorrected scores of the chosen experts,
    normalised and scaled. Returns (topk_idx int64 [B, K], topk_weights fp32 [B, K])."""
    scores = torch.sigmoid(x.float() @ gate.t())
    choice = scores + bias
    B, E, G = x.shape[0], cfg.num_experts, cfg.num_groups
    group_scores = choice.view(B, G, E // G).topk(2, dim=-1).values.sum(-1)
    groups = group_scores.topk(cfg.topk_groups, dim=-1).indices
    keep = torch.zeros(B, G, dtype=torch.bool, device=x.device).scatter_(1, groups, True)
    masked = choice.masked_fill(~keep.repeat_interleave(E // G, dim=1), float('-inf'))
    idx = masked.topk(cfg.top_k, dim=-1).indices
    w = scores.gather(1, idx)
    w = w / w.sum(-1, keepdim=True) * cfg.routed_scaling_factor
    return idx, w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half) of x [B, heads, D] at positions pos [B]."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None, :], torch.cat([ang.sin()] * 2, -1)[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return x.float() * cos + torch.cat([-x2, x1], dim=-1) * sin


class Model:
    """The decoder over one rank's requests. `moe(layer, x, topk_idx, topk_weights, shared)` returns the layer's MoE
    output: routed sum plus shared expert (moe.py); `shared()` computes the shared expert, so an expert-parallel
    implementation can run it while its dispatch is in flight."""

    def __init__(self, cfg: ModelConfig, weights: Dict[str, torch.Tensor], moe: Callable, device: torch.device,
                 max_slots: int) -> None:
        self.cfg, self.moe, self.device = cfg, moe, device
        self.w = {k: v.to(device) for k, v in weights.items() if '.mlp.experts.' not in k}
        self.shared = [stack_mlps(self.w, [f'model.layers.{layer}.mlp.shared_experts.'])
                       for layer in range(cfg.num_layers)]
        # One more slot than requests: padding rows of a fixed-size batch write their keys there (Engine pad/graphs).
        shape = (cfg.num_layers, max_slots + 1, cfg.max_seq_len, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        self.v_cache = torch.zeros(shape, dtype=torch.bfloat16, device=device)

    def _attention_prepare(self, layer: int, h: torch.Tensor, pos: torch.Tensor,
                           slots: torch.Tensor) -> torch.Tensor:
        """Attention, first half (SGLang's attn.op_prepare): the norm, the q/k/v projections with rotary positions,
        the new key and value written to the KV cache. Returns q [B, heads, D]."""
        cfg, p = self.cfg, f'model.layers.{layer}.self_attn.'
        x = rms_norm(h, self.w[f'model.layers.{layer}.input_layernorm.weight'], cfg.rms_eps)
        B, nh, nkv, hd = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q = _rope((x @ self.w[p + 'q_proj.weight'].t()).view(B, nh, hd), pos, cfg.rope_theta)
        k = _rope((x @ self.w[p + 'k_proj.weight'].t()).view(B, nkv, hd), pos, cfg.rope_theta)
        v = (x @ self.w[p + 'v_proj.weight'].t()).view(B, nkv, hd)
        self.k_cache[layer, slots, pos] = k.to(torch.bfloat16)
        self.v_cache[layer, slots, pos] = v
        return q

    def _attention_core(self, layer: int, h: torch.Tensor, q: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                        valid: Optional[torch.Tensor]):
        """Attention, second half (attn.op_core, mlp.op_gate, mlp.op_select_experts): attention over the cache, the
        output projection and residual, then the MoE input, its routing and its shared expert (deferred)."""
        cfg, p = self.cfg, f'model.layers.{layer}.'
        B, nh, nkv, hd = q.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        keys = self.k_cache[layer, slots].float()  # [B, S, nkv, hd]
        vals = self.v_cache[layer, slots].float()
        rep = nh // nkv
        keys, vals = keys.repeat_interleave(rep, dim=2), vals.repeat_interleave(rep, dim=2)
        scores = torch.einsum('bhd,bshd->bhs', q, keys) / hd ** 0.5
        future = torch.arange(cfg.max_seq_len, device=q.device)[None, :] > pos[:, None]
        scores = scores.masked_fill(future[:, None, :], float('-inf'))
        att = torch.einsum('bhs,bshd->bhd', scores.softmax(-1), vals).reshape(B, nh * hd).to(torch.bfloat16)
        h = h + att @ self.w[p + 'self_attn.o_proj.weight'].t()
        x = rms_norm(h, self.w[p + 'post_attention_layernorm.weight'], cfg.rms_eps)
        idx, wts = route(cfg, x, self.w[p + 'mlp.gate.weight'], self.w[p + 'mlp.gate.e_score_correction_bias'])
        if valid is not None:
            idx = idx.masked_fill(valid[:, None] == 0, -1)
        gu, dn = self.shared[layer]
        return h, x, idx, wts, (lambda: expert_mlp(x, gu[0], dn[0]))

    def _micro_batch(self, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                     valid: Optional[torch.Tensor], mb: int):
        """One micro-batch's forward as a generator of SGLang's decode stages (operations_strategy.py, the
        DeepSeek-blog decode schedule), six per layer, a `yield` after each: attention prepare | attention core and
        routing | dispatch send | dispatch receive, experts, combine send | combine receive | output. Returns the
        final hidden states."""
        h = self.w['model.embed_tokens.weight'][tokens]
        for layer in range(self.cfg.num_layers):
            q = self._attention_prepare(layer, h, pos, slots)
            yield
            h, x, idx, wts, shared = self._attention_core(layer, h, q, pos, slots, valid)
            yield
            st = self.moe.send(layer, x, idx, wts, shared, mb)
            yield
            self.moe.middle(st)
            yield
            h = h + self.moe.finish(st)
            yield
            yield  # the output stage: nothing left to do here (the residual is added with the combine's receive)
        return h

    def forward_two_batches(self, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                            valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """forward() as two micro-batches (the first ceil(B/2) rows, the rest), SGLang's two-batch overlap for
        decode: the stages of _micro_batch, B two stages behind A (tbo_delta_stages = 2), A's stage first in each
        round. So B's attention runs while A's dispatch and combine travel, A's next layer's attention while B's
        combine travels, and each low-latency operation is received before the next one is sent: per layer A's
        dispatch, A's combine, B's dispatch, B's combine (the order StagedMoE.idle makes; DeepEP's double buffer
        supports only that order: its next call clears the other half's signals, so a second dispatch sent before
        the first is received hangs it). A micro-batch without tokens still makes its calls (EpMoE sends a dummy
        token)."""
        n = tokens.shape[0]
        cut = n - n // 2
        parts = [slice(0, cut), slice(cut, n)]
        stages = [self._micro_batch(tokens[s], pos[s], slots[s], None if valid is None else valid[s], mb)
                  for mb, s in enumerate(parts)]
        hs: List[Optional[torch.Tensor]] = [None, None]

        def advance(mb: int) -> bool:
            try:
                next(stages[mb])
                return True
            except StopIteration as done:
                hs[mb] = done.value
                return False

        for _ in range(2):  # the delay of B behind A
            advance(0)
        running = [True, True]
        while any(running):
            for mb in (0, 1):
                running[mb] = running[mb] and advance(mb)
        return self._logits(torch.cat(hs))

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits (fp32 [B, V]) of one decode step: token tokens[i] at position pos[i] of the request in KV slot
        slots[i]. valid ([B], optional, bool or 0/1): rows that are padding (0) are routed to no expert (topk_idx -1, as
        engines pad graph batches), so they add nothing to any expert's load."""
        cfg = self.cfg
        h = self.w['model.embed_tokens.weight'][tokens]
        for layer in range(cfg.num_layers):
            q = self._attention_prepare(layer, h, pos, slots)
            h, x, idx, wts, shared = self._attention_core(layer, h, q, pos, slots, valid)
            h = h + self.moe(layer, x, idx, wts, shared)
        return self._logits(h)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return (rms_norm(h, self.w['model.norm.weight'], self.cfg.rms_eps) @ self.w['lm_head.weight'].t()).float()
