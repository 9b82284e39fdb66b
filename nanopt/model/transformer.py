"""The pure model: a decoder-only transformer built from a ModelConfig. Config in, logits or loss out.

Nothing here knows about optimizers, devices, precision policy or distribution: the caller moves the model,
wraps it (compile, DDP, FSDP2 per element of `layers`, activation checkpointing) and runs it under autocast.

Two architectures share one module tree:

- "llama": RoPE (rotate-half convention, as Hugging Face Llama; Llama 3 frequency scaling with `rope_scaling`,
  nanopt.model.rope), RMSNorm, SwiGLU MLP, grouped-query attention.
- "gpt2": learned position embeddings, LayerNorm with bias, GELU (tanh approximation) MLP.

State-dict keys (`{i}` is the layer index; `.bias` keys exist only where the config asks for biases):

    embed_tokens.weight                       [vocab, hidden]
    embed_positions.weight                    [max_position_embeddings, hidden]      gpt2 only
    layers.{i}.attn_norm.weight  (.bias)      [hidden]                                bias: gpt2 LayerNorm
    layers.{i}.attn.q_proj.weight (.bias)     [heads * head_dim, hidden]
    layers.{i}.attn.k_proj.weight (.bias)     [kv_heads * head_dim, hidden]
    layers.{i}.attn.v_proj.weight (.bias)     [kv_heads * head_dim, hidden]
    layers.{i}.attn.o_proj.weight (.bias)     [hidden, heads * head_dim]
    layers.{i}.attn.q_norm.weight             [head_dim]                              qk_norm only
    layers.{i}.attn.k_norm.weight             [head_dim]                              qk_norm only
    layers.{i}.mlp_norm.weight   (.bias)      [hidden]
    layers.{i}.mlp.gate_proj.weight (.bias)   [intermediate, hidden]                  llama only
    layers.{i}.mlp.up_proj.weight   (.bias)   [intermediate, hidden]
    layers.{i}.mlp.down_proj.weight (.bias)   [hidden, intermediate]
    norm.weight                  (.bias)      [hidden]
    lm_head.weight                            [vocab, hidden]   the same Parameter as embed_tokens.weight when tied

Biases: o_proj's follows `attention_bias`, q/k/v's `qkv_bias` (default: as attention_bias), the MLP's `mlp_bias`.
When embeddings are tied, `state_dict()` lists both `embed_tokens.weight` and `lm_head.weight` (one shared tensor);
`parameters()` yields it once.

`Transformer.stack_projections(True)` computes q, k, v (and gate, up) as one GEMM each over the same Parameters.
`Transformer.keep_weight_copies(torch.bfloat16)` has the blocks' linear layers train from bf16 copies of their
weights that the trainer refreshes once per optimizer step (nanopt.model.weight_copies).

`qk_norm` normalizes each head's queries and keys (RMSNorm) before RoPE. `document_masking` keeps attention inside
the documents of a packed row (split at `eos_token_id`), positions restarting per document (nanopt.model.documents).

A vocabulary padded for aligned GEMMs (GPT-2's 50,257 tokens in 50,304 rows) has rows that are never a token.
`Transformer(cfg, tokenizer_vocab_size=N)` keeps the full-width head GEMM but leaves rows N and up out of the
softmax: the logits have N columns and the loss normalizes over N classes, so the loss, every evaluation and every
sample equal those of the exported model, which keeps only the first N rows (nanopt.export.hf).

Building on the "meta" device (`with torch.device("meta"): Transformer(cfg)`) allocates nothing; after
`to_empty(device=...)` call `init_weights()` to fill the parameters (and llama's RoPE tables).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from nanopt.config import ModelConfig
from nanopt.errors import ConfigError
from nanopt.model.documents import compute_dtype, document_mask, document_positions
from nanopt.model.fp8 import HeadMode
from nanopt.model.loss import chunked_cross_entropy
from nanopt.model.projections import Projections
from nanopt.model.rope import apply_rope, rope_at, rope_tables
from nanopt.model.weight_copies import WeightCopies


class KVCache:
    """Keys and values of the tokens seen so far, preallocated for `max_len` positions, one pair per layer.

    `length` is a Python int (no device sync to read it). The model writes layer i's new keys and values through
    `update` and calls `advance` once per forward, after every layer has written.
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int, max_len: int,
                 device: torch.device | str | None, dtype: torch.dtype) -> None:
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.batch_size = batch_size
        self.max_len = max_len
        self.length = 0

    def update(self, layer_idx: int, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        """Store [B, H_kv, T_new, D] keys and values after the cached ones; return all of them so far."""
        end = self.length + k_new.shape[2]
        self.keys[layer_idx][:, :, self.length:end] = k_new
        self.values[layer_idx][:, :, self.length:end] = v_new
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 and cast back, as Hugging Face Llama does (so exports match)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def _norm(cfg: ModelConfig) -> nn.Module:
    if cfg.architecture == "llama":
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)


# cuDNN first, then SDPA's usual order: SDPA takes the first backend that accepts the inputs, so a shape cuDNN
# rejects (grouped-query attention on some builds) still gets flash.
CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def cudnn_attention_by_default(device: torch.device) -> bool:
    """Whether training attention prefers cuDNN's SDPA kernel on this device: on Hopper (sm90), where it is reported
    well ahead of the bundled FlashAttention-2 (taken only where this torch can reorder SDPA's backends)."""
    return device.type == "cuda" and _is_hopper(device.index)


# Properties of the installed torch and the machine: torch.compile takes their results as constants.
@torch.compiler.assume_constant_result
def _sdpa_takes_priority() -> bool:
    import inspect

    return "set_priority" in inspect.signature(sdpa_kernel).parameters


@torch.compiler.assume_constant_result
def _is_hopper(device_index: int | None) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


class Attention(Projections):
    GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "out": ("o_proj",)}

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        # Prefer cuDNN attention in training: None decides by the device (cudnn_attention_by_default); True/False
        # force it either way, e.g. to compare both on one GPU (Transformer.prefer_cudnn_attention).
        self.prefer_cudnn: bool | None = None
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        qkv_bias = cfg.has_qkv_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        # qk_norm: per head, as Qwen3, so the scores stay bounded whatever the projections' scale
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None, kv_cache: KVCache | None = None,
                mask: Tensor | None = None) -> Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.project("qkv", x)
        if rope is not None or self.q_norm is not None:
            # Stacked, v is a view of the one product; attention saves it, which would keep the q and k columns
            # alive until backward too, though RoPE or the norm replaced them. A copy of v frees them (unstacked: a
            # no-op, v is contiguous).
            v = v.contiguous()
        q = q.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        offset = 0
        if kv_cache is not None:
            offset = kv_cache.length
            k, v = kv_cache.update(self.layer_idx, k, v)
        out = self._attend_documents(q, k, v, mask) if mask is not None else self._attend(q, k, v, offset)
        return self.project("out", out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))[0]

    def _attend_documents(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """Attention within documents (nanopt.model.documents). On CUDA the memory-efficient kernel takes the mask
        but not enable_gqa, so grouped K/V heads are expanded to every query head there (the memory model counts
        them); elsewhere SDPA shares them."""
        dropout_p = self.dropout if self.training else 0.0
        grouped = self.num_kv_heads != self.num_heads
        if grouped and q.is_cuda:
            repeat = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
            grouped = False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=grouped)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, offset: int) -> Tensor:
        """Causal attention of the T_new queries (positions offset..) over all offset + T_new keys.

        SDPA's is_causal mask is aligned to the top-left corner, which is right only when queries and keys start
        together (offset 0). A single new query may see every key, so it needs no mask. Several new queries at a
        nonzero offset (only in cached generation) get an explicit bottom-right-aligned mask.
        """
        dropout_p = self.dropout if self.training else 0.0
        # enable_gqa lets SDPA share each K/V head across its group of query heads without copying them.
        gqa = self.num_kv_heads != self.num_heads
        seq_new = q.shape[2]
        if offset == 0:
            prefer_cudnn = self.prefer_cudnn if self.prefer_cudnn is not None else cudnn_attention_by_default(q.device)
            if prefer_cudnn and _sdpa_takes_priority():  # older torch: SDPA's own order
                with sdpa_kernel(CUDNN_FIRST, set_priority=True):
                    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                                          enable_gqa=gqa)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa)
        if seq_new == 1:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, enable_gqa=gqa)
        query_pos = torch.arange(offset, offset + seq_new, device=q.device)
        key_pos = torch.arange(offset + seq_new, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)


class SwiGLU(Projections):
    GROUPS = {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.project("gate_up", x)
        return self.project("down", F.silu(gate) * up)[0]


class GeluMLP(Projections):
    GROUPS = {"up": ("up_proj",), "down": ("down_proj",)}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        # The tanh approximation is GPT-2's original activation ("gelu_new" in Hugging Face).
        return self.project("down", F.gelu(self.project("up", x)[0], approximate="tanh"))[0]


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). The unit FSDP2 shards and checkpoints."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = _norm(cfg)
        self.attn = Attention(cfg, layer_idx)
        self.mlp_norm = _norm(cfg)
        self.mlp = SwiGLU(cfg) if cfg.architecture == "llama" else GeluMLP(cfg)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None, kv_cache: KVCache | None = None,
                mask: Tensor | None = None) -> Tensor:
        x = x + self.resid_dropout(self.attn(self.attn_norm(x), rope, kv_cache, mask))
        return x + self.resid_dropout(self.mlp(self.mlp_norm(x)))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, tokenizer_vocab_size: int | None = None) -> None:
        """tokenizer_vocab_size: how many rows of the vocabulary are tokens (None: all of them); see the module
        docstring."""
        super().__init__()
        if cfg.architecture not in ("llama", "gpt2"):
            raise ConfigError(f"model.json: key 'architecture': unknown architecture {cfg.architecture!r}",
                              'use "llama" or "gpt2"')
        if tokenizer_vocab_size is not None and not 1 <= tokenizer_vocab_size <= cfg.vocab_size:
            raise ValueError(f"tokenizer_vocab_size {tokenizer_vocab_size} is outside the model's vocabulary of "
                             f"{cfg.vocab_size} rows")
        self.cfg = cfg
        # Rows [token_rows, vocab_size) are padding: out of the logits and the loss's softmax.
        self.token_rows = cfg.vocab_size if tokenizer_vocab_size is None else tokenizer_vocab_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if cfg.architecture == "gpt2":
            self.embed_positions = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = _norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.architecture == "llama":
            # Not in the state dict (persistent=False): derived from model.json, so checkpoints and exports are
            # unchanged; init_weights fills them, after to_empty too. Every DDP rank computes the same tables.
            cos, sin = rope_tables(cfg)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        # Rows per loss chunk; None sizes them per micro-batch (nanopt.model.loss_chunks). Tests set a small number
        # to exercise chunking on tiny shapes.
        self.loss_chunk_rows: int | None = None
        # The output head's training GEMMs in FP8 (nanopt.model.fp8): None (the autocast dtype), "scaled_mm" (set by
        # nanopt.train.precision.fp8 on a GPU with FP8), or "emulate" (tests). No parameter or state-dict key changes.
        self.head_fp8: HeadMode | None = None
        # The residual stream's dtype between blocks: None keeps what autocast gives (fp32, the embeddings' dtype,
        # which each block's bf16 output is added into); torch.bfloat16 halves the stream's memory and traffic
        # at the cost of rounding each addition (train.json bf16_residual). Norms compute in fp32 either way.
        self.residual_dtype: torch.dtype | None = None
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, std) weights, zero biases, unit norms. std is initializer_range (init "normal"), or 1/sqrt(fan_in)
        for the projections (init "fan_in"; the embeddings and the output head keep initializer_range). Either
        way the residual output projections are scaled down by 1/sqrt(2 * layers) so the residual stream's
        variance does not grow with depth."""
        self.tie_weights()
        if self.cfg.architecture == "llama":
            cos, sin = rope_tables(self.cfg, self.rope_cos.device)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
        depth = math.sqrt(2 * self.cfg.num_hidden_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = self.cfg.initializer_range
                if self.cfg.init == "fan_in" and isinstance(module, nn.Linear) and name != "lm_head":
                    std = 1 / math.sqrt(module.in_features)
                if name.endswith(("attn.o_proj", "mlp.down_proj")):
                    std /= depth  # divided, not multiplied by 1/depth: the same float as ever (golden runs)
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, (RMSNorm, nn.LayerNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        # A tied head shares the embedding Parameter; the loop above already drew it (twice, harmlessly).

    def tie_weights(self) -> None:
        """Make lm_head use the embedding Parameter when the config ties them. `to_empty` after a meta-device
        build gives each its own tensor, so init_weights re-ties first."""
        if self.cfg.tie_word_embeddings and self.lm_head.weight is not self.embed_tokens.weight:
            self.lm_head.weight = self.embed_tokens.weight

    def prefer_cudnn_attention(self, prefer: bool | None) -> None:
        """Prefer (True) or not (False) cuDNN's attention kernel in training; None: by the device (Hopper only)."""
        for layer in self.layers:
            layer.attn.prefer_cudnn = prefer

    def stack_projections(self, stacked: bool) -> None:
        """q, k, v (and SwiGLU's gate, up) as one GEMM each (True) or one GEMM per layer (False). The same math to
        fp32 rounding, the same Parameters and state-dict keys (nanopt.model.stacked).

        Off by default: what it gains (fewer, wider GEMMs) is a GPU's and no GPU has measured it yet (bench/gpusession
        plan "stacked" times both), while what it costs is known: in eager, where nothing casts the weights (fp32;
        FSDP2's gathered ones) each block keeps its concatenated weights for backward (memory.weight_copy_bytes)."""
        for layer in self.layers:
            layer.attn.stacked = layer.mlp.stacked = stacked

    def keep_weight_copies(self, dtype: torch.dtype) -> WeightCopies:
        """The blocks' linear layers compute their training forwards from copies of their weights in `dtype`
        (nanopt.model.weight_copies), which the caller refreshes (WeightCopies.refresh) before each step's first
        micro-batch. Parameters, state-dict keys and evaluation are unchanged."""
        return WeightCopies([pair for layer in self.layers for part in (layer.attn, layer.mlp)
                             for pair in part.keep_copies(dtype)])

    def new_kv_cache(self, batch_size: int, max_len: int, device: torch.device | str | None = None,
                     dtype: torch.dtype | None = None) -> KVCache:
        """An empty cache for up to max_len positions. Defaults: the device and dtype of the model's weights."""
        weight = self.embed_tokens.weight
        cfg = self.cfg
        return KVCache(cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, cfg.head_dim, max_len,
                       device if device is not None else weight.device, dtype if dtype is not None else weight.dtype)

    def forward(self, input_ids: Tensor, targets: Tensor | None = None, *,
                kv_cache: KVCache | None = None) -> Tensor:
        """Logits [B, T, token_rows] when targets is None, else the mean cross-entropy (fp32 scalar) over
        targets that are not -100. With kv_cache, input_ids continue the cached sequence and are appended to it."""
        batch, seq = input_ids.shape
        start = 0 if kv_cache is None else kv_cache.length
        self._check_lengths(batch, seq, start, kv_cache)
        x = self.embed_tokens(input_ids)
        positions: Tensor | slice = slice(start, start + seq)
        mask = None
        if self.cfg.document_masking and kv_cache is None:  # cached generation continues one document
            documents, positions = document_positions(input_ids, self.cfg.eos_token_id)
            mask = document_mask(documents, compute_dtype(x))
        rope = None
        if self.cfg.architecture == "gpt2":
            x = x + self.embed_positions.weight[positions]
        else:
            rope = rope_at(self.rope_cos, self.rope_sin, positions)
        if self.residual_dtype is not None:
            x = x.to(self.residual_dtype)
        for layer in self.layers:
            x = layer(x, rope, kv_cache, mask)
        if kv_cache is not None:
            kv_cache.advance(seq)
        x = self.norm(x)
        if targets is None:
            # The GEMM keeps the padded (aligned) width; the padded columns are dropped from the result.
            logits = self.lm_head(x)
            return logits if self.token_rows == self.cfg.vocab_size else logits[..., :self.token_rows]
        return chunked_cross_entropy(x.reshape(batch * seq, -1), self.lm_head.weight, targets.reshape(-1),
                                     self.loss_chunk_rows, self.token_rows, self.head_fp8)

    def _check_lengths(self, batch: int, seq: int, start: int, kv_cache: KVCache | None) -> None:
        # Shapes and the cache length are Python ints: these checks cost no device sync.
        if start + seq > self.cfg.max_position_embeddings:
            raise ValueError(f"sequence of {start + seq} tokens exceeds max_position_embeddings "
                             f"{self.cfg.max_position_embeddings}")
        if kv_cache is not None and (start + seq > kv_cache.max_len or batch != kv_cache.batch_size):
            raise ValueError(f"KV cache for batch {kv_cache.batch_size} x {kv_cache.max_len} positions cannot take "
                             f"batch {batch} x {start + seq} positions")
