"""Verifier role: holds the target model and a KV cache per request, pulls token trees from the
pool, verifies each in one forward pass with tree attention, keeps what the target itself would
have produced (lossless walk), rolls the rest back and publishes the result."""
