"""The GPT model, its attention backends and generation.

gpt        GPTConfig and GPT (nanoGPT-style): embeddings, pre-norm blocks, tied head; forward with a KV cache;
           GPT-2 by default, a Llama-3-style block through pos_emb / norm / mlp / qk_norm / tie_embeddings
layers     RoPE (tables, rotation, positions within documents), LayerNorm / RMSNorm, the GELU / SwiGLU / ReLU² MLP
backends   the attention backends as objects in one table (sdpa, sdpa_flash, sdpa_cudnn, fa1, fa2, flex, fa3);
           'auto' resolved once per model
kv_cache   KVCache: one preallocated key/value buffer pair per layer
generate   sampling: the KV-cache decode loop, compiled decode blocks, CUDA-graph decode steps
"""

from model.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
