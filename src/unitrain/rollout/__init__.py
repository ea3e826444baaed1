"""Rollout orchestration over the engines (unitrain.engines): workflows (workflow.py and one file
per workflow), the driver that runs them (driver.py), groups and their filters (groups.py), reward
shapers and row filters (shaping.py), the executor of the stream of groups (executor.py)."""
