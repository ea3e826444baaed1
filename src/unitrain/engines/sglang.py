"""`sampler: sglang`: rollouts and evaluation answers sampled by an SGLang server over its native HTTP
API (no sglang import here: the engine lives in a venv of its own, `./setup.sh --sglang`).

    server    one server started on 127.0.0.1 by the first update_weights (sglang_python; its log
              sglang_server.log), under the supervisor of engines/server.py, from the first
              version's HF folder. On a CPU (`--device cpu` in sglang_args, the default) it runs
              with SGLANG_USE_CPU_ENGINE=1 and, first on its PYTHONPATH, a folder whose
              sitecustomize is engines/sglang_kernel.py: the pure-torch stand-in for the one
              sgl_kernel CPU function its scheduler imports, which the index's (CUDA) sgl_kernel
              lacks. Nothing of it reaches the trainer's interpreter.
    weights   update_weights(params, v) exports the policy as an HF folder (export.export_policy,
              under <run_dir>/sglang_weights), waits for this sampler's rows in flight (none
              straddles two versions), then /update_weights_from_disk loads it tagged v,
              /flush_cache drops the radix cache (prefixes of the old weights) once the server is
              idle, and /model_info must say v. With sglang_interrupt the push does not wait for the rows: it aborts them
              (/abort_request, abort_all), and each returns the tokens it has, marked interrupted
              (a row not yet sent returns none), for the driver to continue under the new weights.
    generate  one /generate request per row, sent at once (SGLang batches them): input_ids in,
              output_ids out, with its own sampling_seed drawn from the key (SGLang honours it only
              with --enable-deterministic-inference, which its CPU engine's torch_native attention
              refuses: on a GPU add it to sglang_args; on a CPU a key does not repeat a sample),
              the stop ids as stops (and the model's eos ids: SGLang checks none where it ignores
              the eos, so a call with no stop ids is the one that ignores it),
              and return_logprob: each token's logprob under the temperature-scaled distribution
              it was drawn from. Each answer names the weight version it was sampled with, which
              must be the round's. `submit` returns at once.
    failures  a request that times out or gets a 5xx is retried (sglang_max_retries). A server that
              stops answering is stopped and restarted from the newest version (sglang_restarts
              times in all) and its rows sent again with their seeds; else the run stops with one
              line naming the key and quoting the end of its log.
    metrics   metrics(): the pushes' parts (time_weight_export, time_weight_reload).

One process: the server runs beside process 0 and the answers are its alone (sampler vllm serves
runs of several processes).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import shlex
import threading
import time

import jax

from unitrain import export
from unitrain.config import check
from unitrain.engines.base import Completions, SamplingParams
from unitrain.engines.client import Client, ServerGone, free_port, row_seeds
from unitrain.engines.server import EngineError, Server, interrupt_refused
from unitrain.errors import ConfigError

log = logging.getLogger("unitrain")

MAX_CONCURRENT_ROWS = 1024  # rows in flight at once (threads; SGLang's scheduler batches them)
CPU_DEVICE = "--device cpu"  # in sglang_args: the CPU engine, with the kernel stand-in
STAND_IN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_kernel.py")


@dataclasses.dataclass
class _Round:
    sampler: SGLangSampler
    prompt_ids: list
    futures: list
    version: int
    max_new_tokens: int

    def result(self) -> Completions:
        return self.sampler._collect(self)


class SGLangSampler:
    def __init__(self, run):
        cfg = run.cfg
        if jax.process_count() > 1:
            raise ConfigError(
                f"sampler sglang serves a run of one process, not {jax.process_count()}: use sampler vllm"
            )
        self.run, self.cfg = run, cfg
        self.export_root = os.path.join(cfg.run_dir, "sglang_weights")
        self.log_path = os.path.join(cfg.run_dir, "sglang_server.log")
        self.server: Server | None = None
        self.client: Client | None = None
        self.version, self.path = None, None  # the newest version pushed, and its folder
        self.restarts_left = cfg.sglang_restarts
        self.interrupts = cfg.sglang_interrupt  # InterruptingSampler: a push aborts the rows in flight
        self.interrupting = False  # a push is aborting them
        self.in_flight, self.lock = 0, threading.Condition()  # rows submitted and not yet answered
        self.replacing = threading.Lock()  # one restart at a time, whichever row sees the server gone
        self.pushed: dict[str, float] = {}
        self.closed = False
        self.pool = concurrent.futures.ThreadPoolExecutor(MAX_CONCURRENT_ROWS, thread_name_prefix="sglang-row")

    # -- weights
    def update_weights(self, params, version: int) -> None:
        if version == self.version:  # a version is one set of weights: the eval's push of the step's own
            return
        start = time.perf_counter()
        path = export.export_policy(self.run, params, version, self.export_root)
        exported = time.perf_counter()
        if self.interrupts and self.client:
            self._interrupt()
        with self.lock:
            self.lock.wait_for(lambda: self.in_flight == 0)  # no row straddles two versions
            self.interrupting = False
            self.version, self.path = version, path  # what a server (re)started from now loads
            if self.server is None:
                self._start()
            else:
                client = self.client
                try:
                    self._load(client)
                except ServerGone:
                    self._replace(client, "during the weight reload")
        export.prune_versions(self.export_root, {path})
        for name, seconds in (
            ("time_weight_export", exported - start),
            ("time_weight_reload", time.perf_counter() - exported),
        ):
            self.pushed[name] = self.pushed.get(name, 0.0) + seconds

    def _load(self, client: Client) -> None:
        """The server loads the newest version from its folder, drops its radix cache once the rows
        an interrupt aborted have left its scheduler (SGLang flushes only an idle cache), and says
        it serves the version."""
        body = {"model_path": self.path, "weight_version": str(self.version), "flush_cache": False}
        client.call("/update_weights_from_disk", body)
        client.call(f"/flush_cache?timeout={self.cfg.sglang_request_timeout:g}")
        self._check_version(client)

    def _check_version(self, client: Client) -> None:
        served = client.call("/model_info", method="GET")["weight_version"]
        if served != str(self.version):
            raise EngineError(
                f"the SGLang server at {client.url} reports weights version {served!r}, not {self.version}"
            )

    def _interrupt(self) -> None:
        """The rows in flight end now with the tokens they have (SGLang's abort), and those not yet sent
        with none: each is marked interrupted, and the driver continues it under the new weights."""
        with self.lock:
            self.interrupting = True
        try:
            self.client.call("/abort_request", {"abort_all": True})
        except ServerGone:
            pass  # its rows see it too and restart it; the push then loads the new version on it

    def _start(self) -> None:
        """A server of our own serving the newest version, tagged with it."""
        cfg, started = self.cfg, time.perf_counter()
        args = server_args(cfg, self.path, self.version, free_port())
        env = dict(os.environ)
        if CPU_DEVICE in " ".join(args):
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (self._stand_in_path(), env.get("PYTHONPATH"))))
        self.server = Server("SGLang", [cfg.sglang_python, "-m", "sglang.launch_server", *args], self.log_path, env)
        log.info("starting an SGLang server at %s (a minute on a CPU; log: %s)", self.server.url, self.log_path)
        self.server.wait_ready(cfg.sglang_startup_timeout, "sglang_startup_timeout")
        client = Client("SGLang", "sglang", self.server.url, cfg.sglang_request_timeout, cfg.sglang_max_retries)
        self._check_version(client)
        self.client = client
        log.info("SGLang server up at %s in %.1f s", self.server.url, time.perf_counter() - started)

    def _stand_in_path(self) -> str:
        """A folder holding the sgl_kernel stand-in as its sitecustomize, which every Python process of
        the server imports at its start."""
        folder = os.path.join(self.cfg.run_dir, "sglang_python")
        os.makedirs(folder, exist_ok=True)
        link = os.path.join(folder, "sitecustomize.py")
        if not os.path.islink(link):
            os.symlink(STAND_IN, link)
        return folder

    def _replace(self, client: Client, when: str) -> None:
        """The server behind `client` stopped answering: restarted from the newest version while
        sglang_restarts allows (once, whichever row saw it first), else one line with its log's end."""
        with self.replacing:
            if self.client is not client:  # another row restarted it already
                return
            if self.closed:
                raise EngineError("the SGLang sampler is closed")
            how = self.server.stop_unanswering()
            if not self.restarts_left:
                raise EngineError(
                    f"the SGLang server at {client.url} {how} {when} (status {self.server.process.returncode}; "
                    f"sglang_restarts={self.cfg.sglang_restarts} used); the end of {self.log_path}: {self.server.tail()}"
                )
            self.restarts_left -= 1
            log.warning(
                "the SGLang server at %s %s %s; restarting it (%d restarts left)",
                client.url,
                how,
                when,
                self.restarts_left,
            )
            self._start()

    # -- sampling
    def submit(self, prompt_ids: list[list[int]], sampling: SamplingParams, key) -> _Round:
        if self.version is None:
            raise RuntimeError("SGLangSampler.submit before update_weights: the server has no weights yet")
        seeds = row_seeds(key, len(prompt_ids))
        with self.lock:
            self.in_flight += len(prompt_ids)
            version = self.version
        futures = [
            self.pool.submit(self._row, ids, sampling, seed, sampling.budget(r))
            for r, (ids, seed) in enumerate(zip(prompt_ids, seeds))
        ]
        return _Round(self, prompt_ids, futures, version, sampling.max_new_tokens)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, key) -> Completions:
        return self.submit(prompt_ids, sampling, key).result()

    def _row(self, ids: list[int], sampling: SamplingParams, seed: int, budget: int) -> tuple[list, list, bool, str]:
        """One row's (token ids, logprobs, interrupted, weight version), sent again (with its seed) to
        the restarted server while the one it went to is lost."""
        stops = list(sampling.stop_token_ids)
        body = {
            "input_ids": ids,
            "sampling_params": {
                "max_new_tokens": budget,
                "temperature": sampling.temperature,
                "top_k": sampling.top_k or -1,
                "top_p": sampling.top_p,
                "sampling_seed": seed,
                "stop_token_ids": stops,
                "ignore_eos": not stops,  # SGLang checks no stop id at all where it ignores the eos
            },
            "return_logprob": True,
        }
        try:
            while True:
                with self.lock:
                    if self.interrupting:
                        return [], [], True, ""
                client = self.client
                try:
                    answer = client.call("/generate", body)
                except ServerGone:
                    self._replace(client, "while sampling")
                    continue
                meta = answer["meta_info"]
                logprobs = [logprob for logprob, _, _ in meta["output_token_logprobs"]]
                aborted = meta["finish_reason"]["type"] == "abort"
                return answer["output_ids"], logprobs, aborted, meta["weight_version"]
        finally:
            with self.lock:
                self.in_flight -= 1
                self.lock.notify_all()

    def _collect(self, round_: _Round) -> Completions:
        rows, n = len(round_.prompt_ids), round_.max_new_tokens
        out = Completions.blank(rows, n, self.run.tokenizer.pad_id, round_.version)
        for r, future in enumerate(round_.futures):
            tokens, logprobs, interrupted, served = future.result()
            if tokens and served != str(round_.version):
                raise EngineError(
                    f"the SGLang server sampled a row of version {round_.version} with weights {served!r}"
                )
            out.put_row(r, tokens, logprobs, interrupted)
        return out

    def metrics(self) -> dict[str, float]:
        """The pushes' parts since the last call (time_weight_export, time_weight_reload; summed)."""
        out, self.pushed = self.pushed, {}
        return out

    def close(self) -> None:
        """Ends the server this sampler started (the rows still in flight fail, not restart it)."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self.replacing:
            self.closed = True
            if self.server is not None:
                self.server.stop()


def server_args(cfg, model_path: str, version: int, port: int) -> list[str]:
    """The SGLang server's command line: ours, then sglang_args (which may override what has a value).
    Token ids in and out (no tokenizer); the context the longest call can ask for."""
    extra = shlex.split(cfg.sglang_args)
    ours = {
        "--model-path": model_path,
        "--host": "127.0.0.1",
        "--port": str(port),
        "--dtype": cfg.dtype,
        "--context-length": str(cfg.max_prompt_length + cfg.episode_max_tokens + cfg.rollout_max_response_len),
        "--weight-version": str(version),
    }
    args = [a for flag, value in ours.items() if flag not in extra for a in (flag, value)]
    return [*args, "--skip-tokenizer-init", *extra]


@check("sampler", "sglang_python")
def _python(c) -> str | None:
    """The engine's interpreter, before anything is built: the trainer starts its server."""
    if c["sampler"] == "sglang" and not os.access(c["sglang_python"], os.X_OK):
        return (
            f"sglang_python: {c['sglang_python']} is not an executable; make the engine's venv with "
            "./setup.sh --sglang, or set sglang_python"
        )
    return None


@check("sampler", "sglang_interrupt", "max_staleness")
def _interrupt(c) -> str | None:
    """Interrupting needs rows in flight at a weight update: rollouts sampled ahead."""
    return interrupt_refused(c, "sglang", "SGLang")


CONFIG_CHECKS = (_python, _interrupt)


def from_run(run) -> SGLangSampler:
    """The sampler factory of `sampler: sglang`."""
    return SGLangSampler(run)
