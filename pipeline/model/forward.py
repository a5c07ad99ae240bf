"""A functional, layer-by-layer forward over the loaded HF weights (Llama, Mistral, Qwen2, Qwen3).

The HF model runs a layer over every token; fusion needs to run a layer over *some* tokens (the
ones being recomputed) against a KV cache that mostly came from disk. So we call the HF modules
(projections, norms, MLP) ourselves and do attention with our own cache and mask.

Shapes: t = tokens computed in this call, n = tokens in the cache, H = query heads,
KV = key/value heads, d = head_dim, D = hidden size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvf.errors import KvfError
from kvf.pipeline.model.rope import Rope, apply_rope

# Decoder families whose attention we can drive layer by layer (RoPE, GQA, pre-norm).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class SpanCalibration:
    """Attention of some queries re-weighted over one span of cache rows (APE's calibration).

    Scores over rows [start, end) are divided by `temperature` and that span's total weight is
    rescaled: with lse_span and lse_rest the log-sum-exp of the scores inside and outside the span,
    the two parts are mixed by softmax([temperature * scale * lse_span, lse_rest]). temperature =
    scale = 1 is ordinary attention. Queries at cache rows below `queries_from` attend plainly: a
    method that recomputes chunk rows beside the question calibrates only the question and decoding.
    """
    start: int
    end: int
    temperature: float
    scale: float
    queries_from: int = 0


@dataclass(frozen=True)
class ActiveRows:
    """The cache rows a pass computes, placed once for all of its layers (Transformer.active_rows).

    On a GPU, a kernel given a CPU index tensor first copies it to the device, and that copy waits
    for every kernel queued before it. Per layer, that stops the host from running ahead of the GPU,
    and each layer costs its launch time plus its GPU time. So the rows' cache index and their RoPE
    tables go to the device once per pass. `rows` itself stays on the CPU: attention's block
    bounds are read on the host.
    """
    rows: torch.Tensor            # [t] sorted cache rows, on the CPU
    index: torch.Tensor | slice   # the same rows where the cache lives: a slice when they are contiguous
    cos: torch.Tensor             # [t, d] RoPE tables at the rows' positions, on the model's device
    sin: torch.Tensor             # [t, d]


MLP_BLOCK_ROWS = 1024  # rows per MLP call in long prefills (bounds the [rows, intermediate] transient)
ATTN_BLOCK_ROWS = 256   # query rows per masked attention call (bounds scores; lets blocks skip later keys)


class KVCache:
    """Preallocated post-RoPE keys and values for every layer, so decoding appends without copies.

    Every row below `length` must be written before attention reads it: a row read unwritten would read
    as zeros, a silent wrong answer. `fill` (tests: NaN) fills fresh caches instead, so that such a read
    shows in the logits (tests/test_method_contract.py).
    """
    fill: float = 0.0

    def __init__(self, layers: int, kv_heads: int, capacity: int, head_dim: int, device="cpu",
                 dtype=torch.float32):
        self.kv = torch.full((layers, 2, kv_heads, capacity, head_dim), self.fill, device=device,
                             dtype=dtype)  # [L, 2, KV, cap, d]
        self.length = 0  # tokens filled so far (prefill fills [0, n) before decoding starts)

    def keys(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 0, :, : self.length]  # [KV, n, d]

    def values(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 1, :, : self.length]  # [KV, n, d]

    def write(self, layer: int, index: torch.Tensor | slice, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [KV, t, d] go to the cache rows `index` (sequence positions in the cache)."""
        self.kv[layer, 0, :, index] = k
        self.kv[layer, 1, :, index] = v


class Transformer:
    """The model as a sequence of functions we can call on any subset of tokens."""

    def __init__(self, hf_model: torch.nn.Module):
        config = hf_model.config
        if config.model_type not in SUPPORTED_ARCHITECTURES:
            raise KvfError(f"architecture '{config.model_type}' cannot be fused; kvf supports "
                           f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        self.config = config
        self.hf_model = hf_model
        self.decoder = hf_model.model
        self.layers = list(self.decoder.layers)
        self.n_layers = len(self.layers)
        attn = self.layers[0].self_attn
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.has_qk_norm = hasattr(attn, "q_norm")  # Qwen3 normalises q and k per head before RoPE
        self.max_positions = config.max_position_embeddings
        # Mistral-style sliding windows change the mask; we fuse only within the window.
        self.sliding_window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        self.rope = Rope(self.decoder.rotary_emb, config)
        # Float tensors live on the model's device in its dtype; index tensors (rows, positions)
        # stay on the CPU and are moved where a kernel needs them.
        self.device = next(hf_model.parameters()).device
        self.dtype = next(hf_model.parameters()).dtype

    # ---- one idea per function -------------------------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [t] -> hidden [t, D]."""
        return self.decoder.embed_tokens(token_ids.to(self.device))

    def project_qkv(self, layer: int, hidden: torch.Tensor):
        """hidden [t, D] -> q [H, t, d], k [KV, t, d], v [KV, t, d]; q and k *before* RoPE."""
        block = self.layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(hidden)
        t = x.shape[0]
        q = attn.q_proj(x).view(t, self.n_heads, self.head_dim)
        k = attn.k_proj(x).view(t, self.n_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(t, self.n_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    def attend(self, layer: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor | None, is_causal: bool = False, rows: torch.Tensor | None = None,
               calibration: SpanCalibration | None = None) -> torch.Tensor:
        """Attention (Transformer.attention) then the layer's o_proj: -> [t, D]."""
        return self.layers[layer].self_attn.o_proj(self.attention(q, keys, values, mask, is_causal, rows, calibration))

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  mask: torch.Tensor | None, is_causal: bool = False, rows: torch.Tensor | None = None,
                  calibration: SpanCalibration | None = None) -> torch.Tensor:
        """q [H, t, d] (after RoPE) over keys/values [KV, n, d]; mask [t, n] bool (True = may attend).

        With a mask, queries go in blocks of rows; `rows` [t] (sorted cache rows of the queries)
        lets each block read only keys up to its last row, which the causal mask hides anyway:
        selected tokens spread over the prompt then cost about half of t x n, like causal
        attention does, instead of all of it. Scores are at most [H, block, n]: never n x n.
        Returns the heads' outputs side by side, [t, H*d] (before o_proj, which is per row: callers
        may run it on several calls' rows at once).
        """
        t = q.shape[1]
        if calibration is not None and rows is not None and mask is not None:   # sorted rows: the plain ones first
            plain = int(torch.searchsorted(rows, torch.tensor(calibration.queries_from)))
            if plain == t:
                calibration = None
            elif plain > 0:   # plain rows by the fast path, the rest calibrated; outputs are per row
                return torch.cat([self.attention(q[:, :plain], keys, values, mask[:plain], rows=rows[:plain]),
                                  self.attention(q[:, plain:], keys, values, mask[plain:], rows=rows[plain:],
                                                 calibration=calibration)])
        if calibration is not None:
            if mask is None:
                mask = torch.ones(t, keys.shape[1], dtype=torch.bool, device=q.device)
            out = self.calibrated_attention(q, keys, values, mask, calibration)[None]
        elif mask is None and is_causal:
            out = F.scaled_dot_product_attention(q[None], keys[None], values[None], is_causal=True,
                                                 scale=self.scaling, enable_gqa=True)
        elif mask is None:
            out = self.attend_every_key(q, keys, values)[None]
        else:
            blocks = []
            for i in range(0, t, ATTN_BLOCK_ROWS):
                end = min(t, i + ATTN_BLOCK_ROWS)
                n_keys = int(rows[end - 1]) + 1 if rows is not None else keys.shape[1]
                blocks.append(F.scaled_dot_product_attention(
                    q[None, :, i:end], keys[None, :, :n_keys], values[None, :, :n_keys],
                    attn_mask=mask[i:end, :n_keys], scale=self.scaling, enable_gqa=True))
            out = torch.cat(blocks, dim=2)
        return out[0].transpose(0, 1).reshape(t, self.n_heads * self.head_dim)

    def attend_every_key(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q [H, t, d] over every one of keys/values [KV, n, d] (no mask: a decode step) -> [H, t, d].
        Each KV head's group of query heads goes in as one block of group x t queries: the same
        attention as GQA's, without copying the keys and values out to every query head, which costs
        a decode step over a long cache more than the attention does (~1.7x here)."""
        t = q.shape[1]
        grouped = q.reshape(self.n_kv_heads, -1, self.head_dim)                              # [KV, group*t, d]
        out = F.scaled_dot_product_attention(grouped[None], keys[None], values[None], scale=self.scaling)
        return out[0].reshape(self.n_heads, t, self.head_dim)

    def calibrated_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                             cal: SpanCalibration) -> torch.Tensor:
        """q [H, t, d] over keys/values [KV, n, d] with the span [cal.start, cal.end) re-weighted
        (SpanCalibration) -> [H, t, d]. Explicit scores [H, t, n]: for the few rows that use it."""
        group = self.n_heads // self.n_kv_heads
        k, v = keys.repeat_interleave(group, dim=0), values.repeat_interleave(group, dim=0)   # [H, n, d]
        scores = ((q @ k.transpose(1, 2)) * self.scaling).masked_fill(~mask, float("-inf"))   # [H, t, n]
        in_span = torch.zeros(scores.shape[-1], dtype=torch.bool, device=q.device)
        in_span[cal.start: cal.end] = True
        span = scores[..., in_span] / cal.temperature                                           # [H, t, s]
        rest = scores.masked_fill(in_span, float("-inf"))                                       # [H, t, n]
        lse_span, lse_rest = torch.logsumexp(span, -1), torch.logsumexp(rest, -1)               # [H, t]
        out_span = torch.nan_to_num(span.softmax(-1)) @ v[:, in_span]                          # [H, t, d]
        out_rest = torch.nan_to_num(rest.softmax(-1)) @ v                                      # [H, t, d]
        mix = torch.stack([lse_span * cal.temperature * cal.scale, lse_rest], dim=-1).softmax(-1)  # [H, t, 2]
        return mix[..., :1] * out_span + mix[..., 1:] * out_rest

    def attention_probs(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Explicit attention weights of q [H, t, d] (after RoPE) over keys [KV, n, d], mask [t, n]
        -> [H, t, n] float32. Only for the few rows whose weights a method reads (Q's rows, one
        chunk at build time): SDPA never forms them."""
        group = self.n_heads // self.n_kv_heads
        scores = (q @ keys.repeat_interleave(group, dim=0).transpose(1, 2)) * self.scaling   # [H, t, n]
        return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).float()

    def mlp(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Residual MLP block on [t, D] rows: per token, so running it on selected rows is exact.

        Long row sets go through in blocks: the [t, intermediate] activations would otherwise be
        the largest transient of a long prefill (several times the hidden states).
        """
        block = self.layers[layer]
        out = torch.empty_like(hidden)
        for start in range(0, hidden.shape[0], MLP_BLOCK_ROWS):
            rows = hidden[start: start + MLP_BLOCK_ROWS]
            out[start: start + MLP_BLOCK_ROWS] = rows + block.mlp(block.post_attention_layernorm(rows))
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [t, D] -> logits [t, vocab]."""
        return self.hf_model.lm_head(self.decoder.norm(hidden))

    # ---- composite steps ------------------------------------------------------------------
    def active_rows(self, rows: torch.Tensor, positions: torch.Tensor) -> ActiveRows:
        """Sorted cache rows [t] and their RoPE positions [t] -> ActiveRows for every layer of a pass."""
        cos, sin = self.rope.cos_sin(positions, self.dtype)                      # [t, d] each
        first = int(rows[0]) if len(rows) else 0
        contiguous = torch.equal(rows, torch.arange(first, first + len(rows)))
        index = slice(first, first + len(rows)) if contiguous else rows.to(self.device)
        return ActiveRows(rows, index, cos, sin)

    def causal_mask(self, query_index: torch.Tensor, n_keys: int, key_keep: torch.Tensor | None = None) -> torch.Tensor:
        """query_index [t] = each query's row in the cache -> mask [t, n_keys] (key j visible iff j <= row)."""
        query_index = query_index.to(self.device)
        key_index = torch.arange(n_keys, device=self.device)
        mask = key_index[None, :] <= query_index[:, None]
        if self.sliding_window:
            mask &= key_index[None, :] > query_index[:, None] - self.sliding_window
        if key_keep is not None:  # keys dropped from the context (e.g. pruned chunks)
            mask &= key_keep.to(self.device)[None, :]
        return mask

    def layer_step(self, layer: int, hidden: torch.Tensor, active: ActiveRows,
                   cache: KVCache, mask: torch.Tensor | None, is_causal: bool = False,
                   keys_out: list | None = None, attention_out: list | None = None,
                   attention_rows: slice = slice(None), calibration: SpanCalibration | None = None) -> torch.Tensor:
        """Recompute one layer for the tokens at cache rows `active.rows` [t], at their RoPE positions.

        Their K/V overwrite the cache rows, then they attend over the whole cache: with `mask`
        [t, n], or causally when is_causal (only valid when rows are all n cache rows), or to
        everything when neither (a single last token). hidden [t, D] -> hidden [t, D].
        keys_out collects the pre-RoPE keys [KV, t, d]; attention_out the attention weights of the
        rows picked by attention_rows (default all t), averaged over heads: [t', n]. It needs `mask`
        and costs one explicit [H, t', n] score matrix.
        """
        q, k, v = self.project_qkv(layer, hidden)
        if keys_out is not None:
            keys_out.append(k)  # pre-RoPE keys, what the store keeps
        q, k = apply_rope(q, active.cos, active.sin), apply_rope(k, active.cos, active.sin)
        cache.write(layer, active.index, k, v)
        if attention_out is not None:
            probs = self.attention_probs(q[:, attention_rows], cache.keys(layer), mask[attention_rows])  # [H, t', n]
            attention_out.append(probs.mean(dim=0))                                                   # [t', n]
        hidden = hidden + self.attend(layer, q, cache.keys(layer), cache.values(layer), mask, is_causal, active.rows,
                                      calibration)
        return self.mlp(layer, hidden)

    @torch.inference_mode()
    def prefill(self, token_ids: torch.Tensor, cache: KVCache, start: int = 0,
                positions: torch.Tensor | None = None, keep_pre_rope_keys: bool = False,
                attention_out: list | None = None):
        """Ordinary prefill of token_ids [t] into cache rows [start, start + t).

        Returns (logits of the last token [vocab], pre-RoPE keys per layer or None). With
        attention_out, every layer appends the tokens' head-averaged attention weights [t, start + t].
        """
        t = token_ids.shape[0]
        rows = torch.arange(start, start + t)
        positions = rows if positions is None else positions
        cache.length = start + t
        plain_causal = start == 0 and not self.sliding_window and attention_out is None  # SDPA's fast causal kernel
        mask = None if plain_causal else self.causal_mask(rows, start + t)
        hidden = self.embed(token_ids)
        active = self.active_rows(rows, positions)
        pre_rope_keys = [] if keep_pre_rope_keys else None
        for layer in range(self.n_layers):
            hidden = self.layer_step(layer, hidden, active, cache, mask, plain_causal, pre_rope_keys, attention_out)
        return self.logits(hidden[-1:])[0], pre_rope_keys

    @torch.inference_mode()
    def decode_step(self, token_id: int, position: int, cache: KVCache,
                    calibration: SpanCalibration | None = None) -> torch.Tensor:
        """One new token at cache row `cache.length` -> logits [vocab] (calibration: see SpanCalibration)."""
        row = torch.tensor([cache.length])
        cache.length += 1
        hidden = self.embed(row.new_tensor([token_id]))
        active = self.active_rows(row, row.new_tensor([position]))
        # The newest token sees the whole cache, so no mask unless a sliding window cuts it.
        mask = self.causal_mask(row, cache.length) if self.sliding_window else None
        for layer in range(self.n_layers):
            hidden = self.layer_step(layer, hidden, active, cache, mask, calibration=calibration)
        return self.logits(hidden)[0]

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.n_layers, self.n_kv_heads, capacity, self.head_dim, self.device, self.dtype)

    def cache_bytes(self, capacity: int) -> int:
        """What new_cache(capacity) allocates: [L, 2, KV, capacity, d] in the model's dtype."""
        return self.n_layers * 2 * self.n_kv_heads * capacity * self.head_dim * self.dtype.itemsize
