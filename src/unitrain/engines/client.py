"""JSON over HTTP to an inference engine's server (vLLM's, SGLang's), and what its requests need: a
free port to start one on, and each row's sampling seed drawn from the key."""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request

import jax
import numpy as np

from unitrain.engines.server import EngineError


class ServerGone(EngineError):
    """The server does not answer (connection refused or reset, or an answer cut off): restarted, or
    the run stops."""


class Client:
    """JSON over HTTP to one server of `engine` ("vLLM", "SGLang"), whose config keys start with `key`
    (its <key>_request_timeout and <key>_max_retries are `timeout` and `retries`)."""

    def __init__(self, engine: str, key: str, url: str, timeout: float, retries: int):
        self.engine, self.key = engine, key
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
                return _json_or_text(text)
            except urllib.error.HTTPError as e:
                failure = f"{method} {path} answered {e.code}: {e.read()[:300].decode(errors='replace')}"
                if e.code < 500:
                    raise EngineError(f"the {self.engine} server at {self.url}: {failure}") from None
            except TimeoutError:
                failure = f"{method} {path} timed out after {self.key}_request_timeout={self.timeout:g} s"
            except (urllib.error.URLError, ConnectionError, http.client.HTTPException) as e:
                # HTTPException: the server died mid-answer (IncompleteRead), as a killed server does
                raise ServerGone(
                    f"no {self.engine} server answers at {self.url} ({method} {path}: {getattr(e, 'reason', e)})"
                ) from None
            time.sleep(min(2.0**attempt, 30.0))
        raise EngineError(
            f"the {self.engine} server at {self.url}: {failure} (after {self.retries} retries, {self.key}_max_retries)"
        )


def _json_or_text(text: bytes):
    """An answer's JSON; vLLM's adapter endpoints answer in plain text."""
    try:
        return json.loads(text) if text else None
    except ValueError:
        return text.decode(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def row_seeds(key, rows: int) -> list[int]:
    """One sampling seed per row, drawn from the key (the same on every process)."""
    data = np.asarray(jax.random.key_data(key)).ravel().tolist()
    return np.random.default_rng(data).integers(0, 2**31 - 1, rows).tolist()
