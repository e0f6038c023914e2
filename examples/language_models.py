"""Transformer language models as people write them (nanoGPT, Hugging Face LLaMA and BERT), small sizes.

The .par files beside this one lay them out with Megatron tensor parallelism.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F

# ---------------------------------------------------------------------------------------------------
# GPT-2 style: learned positions, LayerNorm, fused QKV split into q, k, v, causal attention, GELU MLP,
# LM head tied to the token embedding.


class GPTAttention(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head, self.d_model = n_head, d_model
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.d_model, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class GPTMLP(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.c_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPTBlock(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = GPTAttention(d_model, n_head)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = GPTMLP(d_model)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size=256, block_size=16, n_layer=2, n_head=4, d_model=32, dropout=0.0):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(GPTBlock(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

    def forward(self, idx):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ---------------------------------------------------------------------------------------------------
# LLaMA style: RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention through
# scaled_dot_product_attention, untied LM head.


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x, n_rep):
    b, h_kv, t, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, h_kv, n_rep, t, d).reshape(b, h_kv * n_rep, t, d)


class LlamaAttention(nn.Module):
    def __init__(self, d_model, n_head, n_kv_head, rope_theta=10000.0):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, d_model // n_head
        self.q_proj = nn.Linear(d_model, n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_head * self.head_dim, d_model, bias=False)
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        positions = torch.arange(t, dtype=torch.float32, device=x.device)
        freqs = torch.outer(positions, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = repeat_kv(k, self.n_head // self.n_kv_head)
        v = repeat_kv(v, self.n_head // self.n_kv_head)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class LlamaMLP(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    def __init__(self, d_model, n_head, n_kv_head, d_ff):
        super().__init__()
        self.input_layernorm = RMSNorm(d_model)
        self.self_attn = LlamaAttention(d_model, n_head, n_kv_head)
        self.post_attention_layernorm = RMSNorm(d_model)
        self.mlp = LlamaMLP(d_model, d_ff)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(LlamaLayer(d_model, n_head, n_kv_head, d_ff) for _ in range(n_layer))
        self.norm = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, input_ids):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


# ---------------------------------------------------------------------------------------------------
# BERT style: post-LN encoder, hand-written attention with a padding mask, pooler on the first token.


class BertSelfAttention(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head, self.head_dim = n_head, d_model // n_head
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.dense = nn.Linear(d_model, d_model)

    def heads(self, x):
        b, t, _ = x.shape
        return x.view(b, t, self.n_head, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, x, extended_mask):
        q, k, v = self.heads(self.query(x)), self.heads(self.key(x)), self.heads(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores + extended_mask
        probs = torch.softmax(scores, dim=-1)
        context = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        b, t = context.shape[:2]
        return self.dense(context.view(b, t, -1))


class BertLayer(nn.Module):
    def __init__(self, d_model, n_head, d_ff):
        super().__init__()
        self.attention = BertSelfAttention(d_model, n_head)
        self.attention_norm = nn.LayerNorm(d_model, eps=1e-12)
        self.intermediate = nn.Linear(d_model, d_ff)
        self.output = nn.Linear(d_ff, d_model)
        self.output_norm = nn.LayerNorm(d_model, eps=1e-12)

    def forward(self, x, extended_mask):
        x = self.attention_norm(x + self.attention(x, extended_mask))
        return self.output_norm(x + self.output(F.gelu(self.intermediate(x))))


class Bert(nn.Module):
    def __init__(self, vocab_size=256, max_positions=16, n_layer=2, n_head=4, d_model=32, d_ff=64):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, d_model)
        self.position_embeddings = nn.Embedding(max_positions, d_model)
        self.embedding_norm = nn.LayerNorm(d_model, eps=1e-12)
        self.layers = nn.ModuleList(BertLayer(d_model, n_head, d_ff) for _ in range(n_layer))
        self.pooler = nn.Linear(d_model, d_model)

    def forward(self, input_ids, attention_mask):
        t = input_ids.shape[1]
        positions = torch.arange(t, device=input_ids.device)
        x = self.embedding_norm(self.word_embeddings(input_ids) + self.position_embeddings(positions))
        extended_mask = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for layer in self.layers:
            x = layer(x, extended_mask)
        pooled = torch.tanh(self.pooler(x[:, 0]))
        return x, pooled
