"""Pure tensor math, each op with its plain reference beside it (tests hold them equal), knowing nothing of models:

- `attention`: split attention, response queries over [prompt K/V | own K/V] without concatenating them;
- `kernels/`: the kernels of one attention part (blockwise PyTorch, fused flash entry points, the compiled CPU
  kernel) and the plain reference they are held to;
- `latent_attention`: multi-head latent attention in latent space and DeepSeek sparse attention's selection;
- `compressed_attention`: DeepSeek-V4's pooled compression windows and attention over compressed entries;
- `logprobs`: token log-probs and entropies through the LM head in chunks;
- `quant`: 8-bit prompt tokens with per-block scales.

The layer kinds (`longstraw.kinds`) and the prompt state call these; nothing here imports them.
"""
