"""The semantic IDs (SIDs) of a MiniOneRec index file (item id -> SID tokens) and their trie for
constrained decoding (engines/trie.py): every SID followed by EOS, so EOS is allowed only after a
complete SID and every finished constrained sequence is a valid item.

    trie, sids = sid_trie(index_path, tokenizer)
"""

from __future__ import annotations

import json

from unitrain.engines.trie import Trie
from unitrain.errors import DataError


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
