"""`sampler: vllm`: rollouts and evaluation answers sampled by a vLLM server, over HTTP (no vllm import
here: the engine lives in a venv of its own, `./setup.sh --vllm`; on a GPU or TPU, `vllm` or
`tpu-inference` installed there expose the same server).

    weights   update_weights(params, v) exports the policy as an HF folder (export.export_policy: any
              model source, LoRA merged; under vllm_export_dir, e.g. /dev/shm), waits for this
              sampler's requests in flight (none straddles two versions), then the server pauses,
              reloads from the folder, drops its prefix cache (else prefixes of the old weights are
              served), takes version v and resumes; v must then be what it reports. The first
              version starts the server (vllm_python; or vllm_url, a server already running with
              VLLM_SERVER_DEV_MODE=1, on the same filesystem).
    generate  one request per row, sent at once (vLLM batches them), each with its own seed drawn
              from the key (a batched request would give GRPO's copies of a prompt one seed and one
              sample), token ids in and out, the stop ids as the only stops, and the logprobs of the
              distribution each token was drawn from (--logprobs-mode processed_logprobs).
              `submit` returns at once: the generate calls sampled ahead (max_staleness) run on the server while
              the trainer updates.
    failures  a request that times out or gets a 5xx is retried (vllm_max_retries); a server that
              died is restarted from the newest exported version (vllm_restarts times) and the
              round's unfinished rows are sent again; otherwise, and when a reload fails, one line
              with the end of the server's log. The server's process group ends with the trainer
              (close(), or its supervisor: engines/vllm_server.py).

Several processes: each exports (a collective), process 0 alone talks to the server and broadcasts.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import http.client
import json
import logging
import os
import shlex
import socket
import threading
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import safetensors
import safetensors.numpy
from jax.experimental import multihost_utils

from unitrain import export
from unitrain.engines.base import Completions, SamplingParams
from unitrain.engines.vllm_server import EngineError, Server
from unitrain.errors import ConfigError

log = logging.getLogger("unitrain")

SERVED_NAME = "unitrain"  # the model name our server answers to, whatever folder it loaded last
MAX_CONCURRENT_ROWS = 1024  # rows in flight at once (threads; vLLM's own scheduler batches them)


class ServerGone(EngineError):
    """The server does not answer (connection refused or reset, or an answer cut off): restarted, or
    the run stops."""


class Client:
    """JSON over HTTP to one vLLM server."""

    def __init__(self, url: str, timeout: float, retries: int):
        self.url, self.timeout, self.retries = url.rstrip("/"), timeout, retries

    def call(self, path: str, body: dict | None = None, method: str = "POST", retry: bool = True):
        """The JSON answer of `path`; EngineError for a 4xx or after the retries; ServerGone if
        nothing listens."""
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(self.retries + 1 if retry else 1):
            request = urllib.request.Request(
                self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    text = response.read()
                return json.loads(text) if text else None
            except urllib.error.HTTPError as e:
                failure = f"{method} {path} answered {e.code}: {e.read()[:300].decode(errors='replace')}"
                if e.code < 500:
                    raise EngineError(f"the vLLM server at {self.url}: {failure}") from None
            except TimeoutError:
                failure = f"{method} {path} timed out after vllm_request_timeout={self.timeout:g} s"
            except (urllib.error.URLError, ConnectionError, http.client.HTTPException) as e:
                # HTTPException: the server died mid-answer (IncompleteRead), as a killed server does
                raise ServerGone(
                    f"no vLLM server answers at {self.url} ({method} {path}: {getattr(e, 'reason', e)})"
                ) from None
            time.sleep(min(2.0**attempt, 30.0))
        raise EngineError(f"the vLLM server at {self.url}: {failure} (after {self.retries} retries, vllm_max_retries)")


@dataclasses.dataclass
class _Round:
    """A submitted call: its rows' futures (process 0) and what result() needs to lay them out."""

    sampler: VLLMSampler
    prompt_ids: list
    sampling: SamplingParams
    seeds: list
    futures: list | None  # None on the other processes
    version: int | None
    server_start: int = 0  # the server's starts when the round was sent (a restart since sends it again)

    def result(self) -> Completions:
        return self.sampler._collect(self)


class VLLMSampler:
    def __init__(self, run):
        cfg = run.cfg
        self.run, self.cfg = run, cfg
        self.export_root = cfg.vllm_export_dir or os.path.join(cfg.run_dir, "vllm_weights")
        self.log_path = os.path.join(cfg.run_dir, "vllm_server.log")
        self.leader = jax.process_index() == 0
        self.server, self.client, self.model_path, self.served_name = None, None, None, SERVED_NAME
        self.version = None  # the version the server has loaded
        self.server_starts = 0
        self.restarts_left = cfg.vllm_restarts
        self.push_timings: dict[str, float] = {}  # the last update_weights' parts, for the step's metrics
        self.in_flight, self.idle = 0, threading.Condition()
        self.pool = concurrent.futures.ThreadPoolExecutor(MAX_CONCURRENT_ROWS, thread_name_prefix="vllm-row")
        if self.leader and not cfg.vllm_url and not os.access(cfg.vllm_python, os.X_OK):
            raise ConfigError(
                f"vllm_python: {cfg.vllm_python} is not an executable; make the engine's venv with "
                "./setup.sh --vllm, or set vllm_python (or vllm_url for a server already running)"
            )

    # -- weights
    def update_weights(self, params, version: int) -> None:
        if version == self.version:  # a version is one set of weights: the eval's push of the step's own
            self.push_timings = {}
            return
        start = time.perf_counter()
        path = export.export_policy(self.run, params, version, self.export_root)
        exported = time.perf_counter()
        failure = ""
        if self.leader:
            try:
                untie_embeddings(path)
                self._load(path, version)
            except EngineError as e:
                failure = str(e)
        self._agree(failure, "the weight reload")
        self.version, self.model_path = version, path
        self.push_timings = {
            "time_weight_export": exported - start,
            "time_weight_reload": time.perf_counter() - exported,
        }

    def _load(self, path: str, version: int) -> None:
        """The server serves `path` as `version`: started with it, or paused, reloaded and resumed."""
        with self.idle:  # no row of ours straddles the two versions
            self.idle.wait_for(lambda: self.in_flight == 0)
        if self.client is None and not self.cfg.vllm_url:
            self._start(path)
        else:
            if self.client is None:
                self._connect()
            try:
                self.client.call("/pause?mode=wait")
                self.client.call("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
                self.client.call("/reset_prefix_cache")
            except ServerGone:
                self._restart(path, "during the weight reload")
        self.client.call("/update_weight_version", {"new_version": str(version)})
        self.client.call("/resume")
        served = self.client.call("/weight_info", method="GET")["weight_version"]
        if served != str(version):
            raise EngineError(f"the vLLM server reports weights version {served!r} after loading version {version}")

    def _connect(self) -> None:
        """The server at vllm_url, if it serves a model this sampler can reload."""
        cfg = self.cfg
        self.client = Client(cfg.vllm_url, cfg.vllm_request_timeout, cfg.vllm_max_retries)
        try:
            model = self.client.call("/v1/models", method="GET")["data"][0]
        except ServerGone as e:
            raise EngineError(f"vllm_url: {e}") from None
        if tied(model["root"]):
            raise EngineError(
                f"vllm_url: the server at {cfg.vllm_url} serves {model['root']}, a model with tied "
                "embeddings, whose lm_head vLLM's reload leaves stale; start it from a folder this "
                "sampler exported (<vllm_export_dir>/version_N: untied)"
            )
        self.served_name = model["id"]

    def _start(self, path: str) -> None:
        """A server of our own, serving `path`."""
        cfg, started = self.cfg, time.perf_counter()
        # On a CPU, vLLM otherwise asks for 92% of the machine's memory, which the trainer holds part of.
        env = {"VLLM_CPU_KVCACHE_SPACE": "4", **os.environ, "VLLM_HOST_IP": "127.0.0.1", "VLLM_SERVER_DEV_MODE": "1"}
        self.server = Server(cfg.vllm_python, server_args(cfg, path, free_port()), self.log_path, env)
        self.server.wait_ready(cfg.vllm_startup_timeout)
        self.client = Client(self.server.url, cfg.vllm_request_timeout, cfg.vllm_max_retries)
        self.server_starts += 1
        log.info(
            "vLLM server up at %s in %.1f s (log: %s)", self.server.url, time.perf_counter() - started, self.log_path
        )

    def _restart(self, path: str, when: str) -> None:
        """A server that died comes back with `path`, if vllm_restarts allows; else one line."""
        if self.server is None or self.server.alive():
            where = self.server.url if self.server else self.cfg.vllm_url
            raise EngineError(f"the vLLM server at {where} stopped answering {when}")
        if not self.restarts_left:
            raise EngineError(
                f"the vLLM server died {when} (status {self.server.process.returncode}; vllm_restarts="
                f"{self.cfg.vllm_restarts} used); the end of {self.log_path}: {self.server.tail()}"
            )
        self.restarts_left -= 1
        log.warning("the vLLM server died %s; restarting it with %s (%d restarts left)", when, path, self.restarts_left)
        self.server.stop()
        self._start(path)

    # -- sampling
    def submit(self, prompt_ids: list[list[int]], sampling: SamplingParams, key) -> _Round:
        seeds = row_seeds(key, len(prompt_ids))
        if not self.leader:
            return _Round(self, prompt_ids, sampling, seeds, None, None)
        if self.version is None:
            raise RuntimeError("VLLMSampler.submit before update_weights: the server has no weights yet")
        with self.idle:
            self.in_flight += len(prompt_ids)
        futures = [
            self.pool.submit(self._row, ids, sampling, seed, sampling.budget(r))
            for r, (ids, seed) in enumerate(zip(prompt_ids, seeds))
        ]
        return _Round(self, prompt_ids, sampling, seeds, futures, self.version, self.server_starts)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, key) -> Completions:
        return self.submit(prompt_ids, sampling, key).result()

    def _row(self, ids: list[int], sampling: SamplingParams, seed: int, budget: int) -> tuple[list[int], list[float]]:
        """One row's (token ids, logprobs); ServerGone if the server went away."""
        try:
            body = {
                "model": self.served_name,
                "prompt": ids,
                "max_tokens": budget,
                "temperature": sampling.temperature,
                "top_k": sampling.top_k,
                "top_p": sampling.top_p,
                "seed": seed,
                "stop_token_ids": list(sampling.stop_token_ids),
                "ignore_eos": True,  # the stop ids above are the only stops
                "logprobs": 0,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
                "detokenize": False,
            }
            choice = self.client.call("/v1/completions", body)["choices"][0]
            return choice["token_ids"], choice["logprobs"]["token_logprobs"]
        finally:
            with self.idle:
                self.in_flight -= 1
                self.idle.notify_all()

    def _collect(self, round_: _Round) -> Completions:
        """The round's Completions on every process (process 0 gathers, restarting a dead server and
        resending the rows it lost, then broadcasts)."""
        rows, n = len(round_.prompt_ids), round_.sampling.max_new_tokens
        out = Completions(
            np.full((rows, n), self.run.tokenizer.pad_id, np.int32),
            np.zeros((rows, n), np.int32),
            np.zeros((rows, n), np.float32),
            np.zeros((rows,), np.int32),
            round_.version if round_.version is not None else -1,
        )
        failure = ""
        if self.leader:
            try:
                out = dataclasses.replace(out, version=self._gather(round_, out))
            except EngineError as e:
                failure = str(e)
        self._agree(failure, "sampling")
        if jax.process_count() > 1:
            arrays = multihost_utils.broadcast_one_to_all(
                (out.tokens, out.mask, out.logprobs, out.lengths, np.int32(out.version))
            )
            out = Completions(*(np.asarray(a) for a in arrays[:4]), int(arrays[4]))
        return out

    def _gather(self, round_: _Round, out: Completions) -> int:
        """Fills `out` with the round's rows; -> the version they were sampled with. Rows lost with a
        dead server go again, with their seeds, to the server restarted (by this round or an earlier
        one) with the newest version: all of the round's rows if that is not the round's own version,
        so that one version tag stays true of every row."""
        futures, version, start = dict(enumerate(round_.futures)), round_.version, round_.server_start
        while futures:
            lost = []
            for r, future in futures.items():
                try:
                    tokens, logprobs = future.result()
                except ServerGone:
                    lost.append(r)
                    continue
                length = len(tokens)
                out.tokens[r, :length], out.logprobs[r, :length] = tokens, logprobs
                out.mask[r, :length], out.lengths[r] = 1, length
            futures = {}
            if lost:
                if start == self.server_starts:  # no round has restarted it yet
                    self._restart(self.model_path, f"while sampling ({len(lost)} rows lost)")
                if version != self.version:
                    lost, version = list(range(len(round_.prompt_ids))), self.version
                    out.tokens.fill(self.run.tokenizer.pad_id)
                    out.mask.fill(0)
                    out.logprobs.fill(0)
                start = self.server_starts
                with self.idle:
                    self.in_flight += len(lost)
                for r in lost:
                    futures[r] = self.pool.submit(
                        self._row, round_.prompt_ids[r], round_.sampling, round_.seeds[r], round_.sampling.budget(r)
                    )
        return version

    def _agree(self, failure: str, what: str) -> None:
        """Every process raises if process 0 failed (its message there; a pointer to it elsewhere)."""
        if jax.process_count() > 1:
            failed = multihost_utils.broadcast_one_to_all(np.int32(bool(failure)))
            if failed and not self.leader:
                raise EngineError(f"{what} failed on process 0, which talks to the vLLM server (see its output)")
        if failure:
            raise EngineError(failure)

    def close(self) -> None:
        """Ends the server this sampler started (a server at vllm_url stays)."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.stop()
            self.server = None


def tied(path: str) -> bool:
    """Whether the HF folder at `path` (if it is one here) ties its output projection to the embedding."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return bool(json.load(f).get("tie_word_embeddings"))
    except (OSError, ValueError):
        return False


def untie_embeddings(path: str) -> None:
    """An export with tied embeddings gets its output projection as a weight of its own (a copy of the
    input embedding, in lm_head.safetensors) and tie_word_embeddings false: the same model, which
    vLLM 0.32 reloads whole, where its in-place reload of a tied model leaves lm_head at the weights
    it started with."""
    if not tied(path):
        return
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    index_file, name = os.path.join(path, "model.safetensors.index.json"), "model.embed_tokens.weight"
    index = json.load(open(index_file)) if os.path.exists(index_file) else None
    source = os.path.join(path, index["weight_map"][name] if index else "model.safetensors")
    with safetensors.safe_open(source, "np") as f:
        embedding = f.get_tensor(name)
    safetensors.numpy.save_file({"lm_head.weight": embedding}, os.path.join(path, "lm_head.safetensors"))
    if index:
        index["weight_map"]["lm_head.weight"] = "lm_head.safetensors"
        with open(index_file, "w") as f:
            json.dump(index, f)
    with open(config_file, "w") as f:
        json.dump({**config, "tie_word_embeddings": False}, f, indent=2)


def server_args(cfg, model_path: str, port: int) -> list[str]:
    """The vLLM server's command line: ours, then vllm_args (which may override what has a value)."""
    extra = shlex.split(cfg.vllm_args)
    ours = {
        "--model": model_path,
        "--host": "127.0.0.1",
        "--port": str(port),
        "--served-model-name": SERVED_NAME,
        "--logprobs-mode": "processed_logprobs",
        # The longest context a call can ask for: a prompt, an episode's tokens, one more turn.
        "--max-model-len": str(cfg.max_prompt_length + cfg.episode_max_tokens + cfg.rollout_max_response_len),
        "--dtype": cfg.dtype,
    }
    args = [a for flag, value in ours.items() if flag not in extra for a in (flag, value)]
    # Token ids in and out: vLLM needs no tokenizer. No chunked prefill: vLLM 0.32 on a CPU fails a
    # seeded request whose prompt it splits across steps ("CPU Generator does not use offset").
    return [*args, "--skip-tokenizer-init", "--no-enable-chunked-prefill", *extra]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def row_seeds(key, rows: int) -> list[int]:
    """One sampling seed per row, drawn from the key (the same on every process)."""
    data = np.asarray(jax.random.key_data(key)).ravel().tolist()
    return np.random.default_rng(data).integers(0, 2**31 - 1, rows).tolist()


def from_run(run) -> VLLMSampler:
    """The sampler factory of `sampler: vllm`."""
    return VLLMSampler(run)
