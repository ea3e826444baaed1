"""Engines: what samples tokens. The sampler interface and its declared capabilities (base.py),
the engines (colocated.py, mesh.py, vllm.py and sglang.py with their servers' supervisor server.py
and client.py; factory.py chooses one by `sampler`), and the colocated engines' decode programs
(programs.py, beam.py, buckets.py, trie.py). The rollout package drives them; they know nothing of workflows or groups."""
