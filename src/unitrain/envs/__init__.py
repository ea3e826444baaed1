"""Environments and tools for multi-turn episodes: the protocol (base.py), the built-ins (calculator.py,
guess.py, reasoning_gym.py) and the tool-call formats of the chat templates (tool_calls.py)."""
