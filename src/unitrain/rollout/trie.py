"""A prefix trie of valid token sequences, held as arrays for constrained decoding on device.

    trie = Trie.build([[a1, b7, c3, eos], [a1, b9, c0, eos], ...])   # every valid sequence, EOS included
    trie = sid_trie(index_path, tokenizer)                          # the SIDs of a MiniOneRec index file

Node 0 is the root. Node s allows the tokens `tokens[s, :]` (-1 = no token) and moves to
`children[s, j]` after `tokens[s, j]`; a node that allows nothing ends its sequence. Both tables
are padded to powers of two (nodes and fan-out), so a different trie of similar size is the same
program input shape: decoding does not recompile for it. A SID trie allows EOS only after a complete
SID, so every finished constrained sequence is a valid item.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from unitrain.errors import DataError


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


def read_sid_index(path: str) -> dict[str, str]:
    """item id -> SID text ("<a_1><b_2><c_3>") of a MiniOneRec index file (item id -> list of SID tokens)."""
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
    except OSError as e:
        raise DataError(f"SID index {path!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(index, dict) or not index:
        raise DataError(f"{path}: a SID index is a JSON object item id -> [SID tokens]")
    for item, sid in index.items():
        if not (isinstance(sid, list) and sid and all(isinstance(t, str) and t for t in sid)):
            raise DataError(f"{path}: item {item!r} must map to a non-empty list of token strings, got {sid!r}")
    return {item: "".join(sid) for item, sid in index.items()}


def sid_token_ids(tokenizer, sid: str, where: str) -> list[int]:
    """The ids of one SID; each of its tokens must be one token of the tokenizer (see extra_tokens)."""
    ids = tokenizer.encode(sid)
    if len(ids) != sid.count("<"):
        raise DataError(
            f"{where}: SID {sid!r} is {len(ids)} tokens, not one per SID token; add the SID tokens "
            "to the vocabulary (extra_tokens)"
        )
    return ids


def sid_trie(path: str, tokenizer) -> tuple[Trie, list[str]]:
    """The trie of every distinct SID of the index at `path`, each followed by EOS, and those SIDs."""
    sids = sorted(set(read_sid_index(path).values()))
    return Trie.build([sid_token_ids(tokenizer, s, path) + [tokenizer.eos_id] for s in sids]), sids
