"""A prefix trie of valid token sequences, held as arrays for constrained decoding on device.

    trie = Trie.build([[a1, b7, c3, eos], [a1, b9, c0, eos], ...])   # every valid sequence, EOS included

Node 0 is the root. Node s allows the tokens `tokens[s, :]` (-1 = no token) and moves to
`children[s, j]` after `tokens[s, j]`; a node that allows nothing ends its sequence. Both tables
are padded to powers of two (nodes and fan-out), so a different trie of similar size is the same
program input shape: decoding does not recompile for it. (The SIDs of a recommender as a trie:
recsys/trie.py.)
"""

from __future__ import annotations

import dataclasses

import numpy as np


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Trie:
    tokens: np.ndarray  # [nodes, fanout] int32, -1 = none
    children: np.ndarray  # [nodes, fanout] int32
    depth: int  # tokens of the longest valid sequence (the decode length it needs)
    widest_level: int  # most nodes at one depth: a beam this wide never prunes a valid prefix

    @classmethod
    def build(cls, sequences: list[list[int]]) -> Trie:
        if not sequences:
            raise ValueError("a trie needs at least one sequence")
        edges: list[dict[int, int]] = [{}]  # node -> {token: child}
        levels: dict[int, int] = {}
        for seq in sequences:
            node = 0
            for d, token in enumerate(seq):
                if token not in edges[node]:
                    edges[node][int(token)] = len(edges)
                    edges.append({})
                    levels[d] = levels.get(d, 0) + 1
                node = edges[node][int(token)]
        nodes, fanout = _next_pow2(len(edges)), _next_pow2(max(len(e) for e in edges))
        tokens = np.full((nodes, fanout), -1, np.int32)
        children = np.zeros((nodes, fanout), np.int32)
        for s, e in enumerate(edges):
            for j, (token, child) in enumerate(sorted(e.items())):
                tokens[s, j], children[s, j] = token, child
        return cls(tokens, children, max(len(s) for s in sequences), max(levels.values()))

    def contains(self, seq) -> bool:
        """Whether `seq` is a complete valid sequence (it ends at a node that allows nothing)."""
        node = 0
        for token in seq:
            hit = np.flatnonzero(self.tokens[node] == int(token))
            if hit.size == 0:
                return False
            node = int(self.children[node, hit[0]])
        return bool((self.tokens[node] < 0).all())
