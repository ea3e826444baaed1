"""Rollouts: the sampler interface (base.py), the engines (colocated.py, mesh.py, vllm.py; engines.py
chooses one), their decode programs (programs.py, beam.py, buckets.py, trie.py), and the rollout
seam: workflows (workflow.py and one file per workflow), the driver that runs them (driver.py),
groups and their filters (groups.py), reward shapers and row filters (shaping.py), the rounds
sampled ahead (buffer.py)."""
