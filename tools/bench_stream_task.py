"""tools/bench_stream.py's reward plugin: each completion's length, logged, not rewarded.

    reward=gsm8k,bench_stream_task:length  reward_weights=[1.0,0.0]   (tools/ on PYTHONPATH)

`length` returns the completion's length in characters (the bench's tokenizer is byte-level BPE
with no merges, so an ASCII completion's characters are its tokens less the stop token); with
weight 0 it leaves the reward as it is, and the step logs its mean, std, min and max
(reward_length_*). With BENCH_STREAM_LENGTHS set it also appends every length to that file, one
per line, for the bench's length distribution (every sampled completion, trained on or not).
"""

from __future__ import annotations

import os


def length(prompt: str, completion: str, label: str) -> float:
    path = os.environ.get("BENCH_STREAM_LENGTHS")
    if path:
        with open(path, "a") as f:
            f.write(f"{len(completion)}\n")
    return float(len(completion))
