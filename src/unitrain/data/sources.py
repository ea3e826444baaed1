"""Reading local .jsonl / .parquet files into validated records.

Files are read whole and checked eagerly, so that a bad line stops the run before any compilation
with its `file:line`, instead of hours into training. Each record is either prompt/completion text
(the names come from `prompt_key`/`completion_key`) or a chat under `messages_key`.
"""
from __future__ import annotations

import glob
import json
import os

from unitrain.data.errors import DataError


def resolve_paths(spec: str) -> list[str]:
    """A path, a comma-separated list, or glob patterns -> the sorted files they name."""
    paths = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        matches = sorted(glob.glob(part)) if glob.has_magic(part) else [part]
        if not matches or not all(os.path.isfile(m) for m in matches):
            missing = part if not matches else next(m for m in matches if not os.path.isfile(m))
            raise DataError(f"data file {missing!r} does not exist (from dataset path {spec!r})")
        paths.extend(matches)
    if not paths:
        raise DataError(f"dataset path {spec!r} names no file")
    return paths


def iter_rows(spec: str):
    """(where, row) for every row of the .jsonl/.parquet files named by `spec`; `where` is file:line."""
    for path in resolve_paths(spec):
        if path.endswith(".parquet"):
            yield from _parquet_rows(path)
        elif path.endswith((".jsonl", ".json")):
            yield from _jsonl_rows(path)
        else:
            raise DataError(f"data file {path!r} is neither .jsonl nor .parquet")


def read_records(spec: str, prompt_key: str, completion_key: str, messages_key: str) -> list[dict]:
    """All records of the files named by `spec`, each reduced to {prompt, completion} or {messages}."""
    records = [_normalize(row, where, prompt_key, completion_key, messages_key) for where, row in iter_rows(spec)]
    if not records:
        raise DataError(f"dataset path {spec!r} holds no records")
    return records


def _jsonl_rows(path: str):
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue  # tolerate blank lines, e.g. a trailing newline pair
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            yield f"{path}:{lineno}", row


def _parquet_rows(path: str):
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for unreadable files
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"{path}:row {i}", row


def _normalize(row, where: str, prompt_key: str, completion_key: str, messages_key: str) -> dict:
    if not isinstance(row, dict):
        raise DataError(f"{where}: a record must be a JSON object, got {type(row).__name__}")
    if prompt_key in row and completion_key in row:
        prompt, completion = row[prompt_key], row[completion_key]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise DataError(f"{where}: fields {prompt_key!r} and {completion_key!r} must be strings")
        return {"prompt": prompt, "completion": completion}
    if messages_key in row:
        messages = row[messages_key]
        ok = isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
        if not ok:
            raise DataError(f"{where}: field {messages_key!r} must be a non-empty list of {{role, content}} strings")
        if messages[-1]["role"] != "assistant":
            raise DataError(f"{where}: the last message must be the assistant turn to train on")
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in messages]}
    raise DataError(
        f"{where}: record has neither {prompt_key!r}+{completion_key!r} nor {messages_key!r} "
        f"(it has {sorted(row)}); set prompt_key/completion_key or messages_key"
    )
