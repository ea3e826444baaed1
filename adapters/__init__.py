"""Adapters: turn checkpoints of other libraries into unitrain models and back."""
