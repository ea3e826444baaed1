"""unitrain: one JAX trainer for SFT and RL post-training of LLMs."""
