"""speclane verifier: owns the target model and each sequence's KV cache, and
turns drafts into committed tokens without changing the output distribution
(greedy acceptance, or lossless speculative sampling)."""
