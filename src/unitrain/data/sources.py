"""Reading local data files into validated records.

Formats: .jsonl (one JSON object a line), .csv (a header line, then one record a row), .parquet,
.arrow (Arrow IPC stream or file, as Hugging Face `datasets` writes them) and a folder made by
`datasets.Dataset.save_to_disk` (its arrow files, in the order its state.json lists them).

Files are read whole and checked eagerly, so that a bad line stops the run before any compilation
with its `file:line` (`file:row N` for the columnar formats), instead of hours into training. Each
record is either prompt/completion text (the names come from `prompt_key`/`completion_key`) or a
chat under `messages_key`.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import os

from unitrain.errors import ConfigError, DataError

FORMATS = ".jsonl, .csv, .parquet, .arrow or a datasets save_to_disk folder"


def resolve_paths(spec: str) -> list[str]:
    """A path, a comma-separated list, or glob patterns -> the sorted files they name; a
    `save_to_disk` folder stands for its arrow files."""
    paths = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        matches = sorted(glob.glob(part)) if glob.has_magic(part) else [part]
        if not matches or not all(os.path.exists(m) for m in matches):
            missing = part if not matches else next(m for m in matches if not os.path.exists(m))
            raise DataError(f"data file {missing!r} does not exist (from dataset path {spec!r})")
        for match in matches:
            paths.extend(_saved_dataset_files(match) if os.path.isdir(match) else [match])
    if not paths:
        raise DataError(f"dataset path {spec!r} names no file")
    return paths


def iter_rows(spec: str):
    """(where, row) for every row of the files named by `spec`; `where` is file:line or file:row N."""
    for path in resolve_paths(spec):
        reader = next((read for suffixes, read in _READERS if path.endswith(suffixes)), None)
        if reader is None:
            raise DataError(f"data file {path!r} is not one of {FORMATS}")
        yield from reader(path)


def read_records(
    spec: str, prompt_key: str, completion_key: str, messages_key: str, label_key: str | None = None
) -> list[dict]:
    """All records of the files named by `spec`, each reduced to {prompt, completion} or {messages},
    plus {label} where a record has `label_key` (the gold answer of SFT eval files)."""
    records = []
    for where, row in iter_rows(spec):
        record = _normalize(row, where, prompt_key, completion_key, messages_key)
        if label_key is not None and label_key in row:
            record["label"] = label_text(row, label_key, where)
        records.append(record)
    if not records:
        raise DataError(f"dataset path {spec!r} holds no records")
    return records


def _saved_dataset_files(folder: str) -> list[str]:
    """The arrow files of a `datasets` save_to_disk folder, in the dataset's order."""
    state = os.path.join(folder, "state.json")
    if os.path.isfile(os.path.join(folder, "dataset_dict.json")):
        splits = sorted(d for d in os.listdir(folder) if os.path.isfile(os.path.join(folder, d, "state.json")))
        raise DataError(
            f"{folder!r} is a datasets DatasetDict; name one of its splits' folders "
            f"({', '.join(os.path.join(folder, s) for s in splits)})"
        )
    if not os.path.isfile(state):
        raise DataError(
            f"{folder!r} is a folder but not one made by datasets' save_to_disk (no state.json); "
            f"name its files instead ({FORMATS})"
        )
    try:
        with open(state, encoding="utf-8") as f:
            files = [entry["filename"] for entry in json.load(f)["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{state}: not a datasets state file ({type(e).__name__}: {e})") from None
    return [os.path.join(folder, name) for name in files]


def _text(path: str) -> str:
    """The file's text; bytes that are not UTF-8 are reported with their line (a BOM is dropped)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x}); re-encode the file as UTF-8"
        ) from None


def _jsonl_rows(path: str):
    # split("\n"), not splitlines(): JSON strings may hold U+2028 and other line separators.
    for lineno, line in enumerate(_text(path).split("\n"), start=1):
        if not line.strip():
            continue  # tolerate blank lines, e.g. a trailing newline pair
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        yield f"{path}:{lineno}", row


def _csv_rows(path: str):
    """Each row as {header: text}; a quoted field may span lines, so `where` is the row's first line."""
    reader = csv.reader(io.StringIO(_text(path), newline=""), strict=True)
    try:
        header = next(reader, None)
        if header is None:
            return
        if len(set(header)) < len(header):
            raise DataError(f"{path}:1: the header names a column twice ({', '.join(header)})")
        start = reader.line_num + 1
        for fields in reader:
            if fields:  # a blank line is no record
                if len(fields) != len(header):
                    raise DataError(
                        f"{path}:{start}: the row has {len(fields)} field(s), the header {len(header)} "
                        f"({', '.join(header)})"
                    )
                yield f"{path}:{start}", dict(zip(header, fields))
            start = reader.line_num + 1
    except csv.Error as e:
        raise DataError(f"{path}:{reader.line_num}: not valid CSV ({e})") from None


def _table_rows(path: str, read_table):
    try:
        table = read_table(path)
    except Exception as e:  # pyarrow raises several types for unreadable files
        raise DataError(f"{path}: not a readable {os.path.splitext(path)[1][1:]} file ({e})") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"{path}:row {i}", row


def _read_parquet(path: str):
    import pyarrow.parquet as pq

    return pq.read_table(path)


def _read_arrow(path: str):
    """Arrow IPC in either framing: the stream format (what `datasets` writes) or the file format."""
    import pyarrow as pa

    with open(path, "rb") as f:
        is_file_format = f.read(6) == b"ARROW1"
    with pa.memory_map(path) as source:
        return (pa.ipc.open_file if is_file_format else pa.ipc.open_stream)(source).read_all()


_READERS = (
    ((".jsonl", ".json"), _jsonl_rows),
    ((".csv",), _csv_rows),
    ((".parquet",), lambda path: _table_rows(path, _read_parquet)),
    ((".arrow",), lambda path: _table_rows(path, _read_arrow)),
)


def label_text(row: dict, label_key: str, where: str) -> str:
    """A record's gold answer as text: a string, or a number kept as its text (72 -> "72")."""
    label = row[label_key]
    if isinstance(label, bool) or not isinstance(label, (str, int, float)):
        raise DataError(f"{where}: field {label_key!r} must be a string or a number, got {type(label).__name__}")
    return str(label)


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
        ok = (
            isinstance(messages, list)
            and messages
            and all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and (isinstance(m.get("content"), str) or _is_parts(m.get("content"), images=m["role"] == "user"))
                for m in messages
            )
        )
        if not ok:
            raise DataError(
                f"{where}: field {messages_key!r} must be a non-empty list of {{role, content}}, each content a "
                "string or a list of {type: text, text} parts (a user's also {type: image, image: path or bytes})"
            )
        if messages[-1]["role"] != "assistant":
            raise DataError(f"{where}: the last message must be the assistant turn to train on")
        record = {
            "messages": [{"role": m["role"], "content": _content(m["content"], where, m["role"])} for m in messages]
        }
        parts = [p for m in record["messages"] if isinstance(m["content"], list) for p in m["content"]]
        images = [p["image"] for p in parts if p["type"] == "image"]
        return {**record, "images": images, "where": where} if images else record
    raise DataError(
        f"{where}: record has neither {prompt_key!r}+{completion_key!r} nor {messages_key!r} "
        f"(it has {sorted(row)}); set prompt_key/completion_key or messages_key"
    )


def _is_parts(content, images: bool = True) -> bool:
    """Whether `content` is a list of text parts (and, with `images`, image parts)."""
    return isinstance(content, list) and all(
        isinstance(p, dict)
        and (
            (p.get("type") == "text" and isinstance(p.get("text"), str))
            or (images and p.get("type") == "image" and _image_source(p.get("image")) is not None)
        )
        for p in content
    )


def _image_source(image) -> str | bytes | None:
    """An image part's image: a path, or the file's bytes (a parquet or arrow column: binary, or
    datasets' Image feature, a struct {bytes, path}); None: neither."""
    if isinstance(image, dict):
        image = image.get("bytes") or image.get("path")
    return image if isinstance(image, (str, bytes)) else None


def _content(content, where: str, role: str = "user"):
    """A message's content: a string; another role's text parts joined (a columnar file holds every
    content as a list of parts); a user's parts each with its own keys (a columnar row's other fields
    null), an image part's path made absolute, relative to the data file (`where` is file:line or
    file:row N), or its bytes."""
    if isinstance(content, str):
        return content
    if role != "user":
        return "".join(p["text"] for p in content)
    folder = os.path.dirname(os.path.abspath(where.rsplit(":", 1)[0]))

    def part(p):
        if p["type"] == "text":
            return {"type": "text", "text": p["text"]}
        image = _image_source(p["image"])
        return {
            "type": "image",
            "image": image if isinstance(image, bytes) else os.path.join(folder, os.path.expanduser(image)),
        }

    return [part(p) for p in content]


def split_path(cfg, split: str) -> str:
    """The data behind a split; eval of builtin/synthetic is their own eval stream by default."""
    if split == "train" or cfg.eval_dataset_path:
        return cfg.dataset_path if split == "train" else cfg.eval_dataset_path
    if cfg.dataset_path in ("builtin", "synthetic"):
        return cfg.dataset_path
    raise ConfigError("evaluation needs eval_dataset_path when dataset_path names files; set it, or eval_interval=0")


def read_prompt_records(spec: str, prompt_key: str, label_key: str) -> list[dict]:
    """All {prompt, label} records of the files named by `spec`, checked eagerly (file:line on error).

    The prompt must be a string, or a user turn's parts (text and image parts, as SFT's messages:
    the record then carries its `images` and `where`, the paths relative to the data file); the
    label a string or a number (kept as its text, e.g. 72 -> "72").
    """
    records = []
    for where, row in iter_rows(spec):
        if not isinstance(row, dict):
            raise DataError(f"{where}: a record must be a JSON object, got {type(row).__name__}")
        if prompt_key not in row or label_key not in row:
            raise DataError(
                f"{where}: record lacks {prompt_key!r} or {label_key!r} (it has {sorted(row)}); "
                "set prompt_key and label_key"
            )
        prompt = row[prompt_key]
        if not isinstance(prompt, str) and not _is_parts(prompt):
            raise DataError(
                f"{where}: field {prompt_key!r} must be a string or a list of {{type: text, text}} and "
                f"{{type: image, image: path}} parts, got {type(prompt).__name__}"
            )
        record = {"prompt": _content(prompt, where), "label": label_text(row, label_key, where)}
        images = [p["image"] for p in record["prompt"] if p["type"] == "image"] if isinstance(prompt, list) else []
        records.append({**record, "images": images, "where": where} if images else record)
    if not records:
        raise DataError(f"dataset path {spec!r} holds no records")
    return records


def file_records(cfg, tokenizer, path: str, label_key: str | None = None) -> list[dict]:
    """The records of the files at `path` (data_format: records), chat records only with a chat tokenizer."""
    records = read_records(path, cfg.prompt_key, cfg.completion_key, cfg.messages_key, label_key)
    if not tokenizer.has_chat_template and (cfg.chat_template or any("messages" in r for r in records)):
        tokenizer.chat_segments([])  # raises the ConfigError naming tokenizer_path
    return records
