"""The model and its packed forward: loading, layers, the prepared step, attention,
rotary embeddings, the paged KV cache and MoE layers."""
