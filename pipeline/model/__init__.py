"""The transformer as functions: layer-by-layer forward, RoPE, greedy decoding, the prompt layout. No files, no store."""
