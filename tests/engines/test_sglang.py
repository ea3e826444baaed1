"""`sampler: sglang` against a real SGLang server (the engine's venv of ./setup.sh --sglang) on
127.0.0.1, running its CPU engine with unitrain's sgl_kernel stand-in, on a tiny random Qwen2 (head_dim
32): greedy tokens and logprobs against transformers' forward, also after a weight update; sampled
logprobs and per-row seeds; a push that interrupts the rows in flight; a dead server restarted, then
one line when no restart is left; and a short GRPO run. The stand-in itself is checked against a
loop over the requests here, without the engine.

The tests that start servers share one xdist group (one worker, one server at a time) and the
module's server."""

import http.server
import json
import os
import re
import signal
import sys
import threading
import time
import types

import jax
import numpy as np
import pytest
import torch

from helpers import REPO, hf_greedy, hf_model, make_cfg
from unitrain import export, train
from unitrain.engines import sglang, sglang_kernel
from unitrain.engines.base import SamplingParams
from unitrain.engines.server import EngineError
from unitrain.run import build_run

SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
MISSING = "the engine's venv is missing: ./setup.sh --sglang makes .venv-sglang"


def needs_sglang(test):
    """A test that starts or uses a server: skipped without the engine's venv; one xdist worker for all."""
    test = pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=MISSING)(test)
    return pytest.mark.xdist_group("sglang")(test)


TINY = dict(tie=True, emb_dim=64, heads=2, kv_heads=1, head_dim=32)
PROMPTS = [[5, 17, 99, 3], [250, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("qwen2", **TINY)


def engine_cfg(root, ckpt, **keys):
    base = dict(mode="grpo", load_parameters_path=ckpt, tokenizer_path=ckpt, per_device_batch_size=1)
    return make_cfg(base_output_directory=root, **{**base, "sampler": "sglang", "sglang_python": SGLANG_PYTHON, **keys})


@pytest.fixture(scope="module")
def served(tmp_path_factory, ckpt):
    """(run, params, sampler): the tiny model's version 0 on the sampler's server, which interrupts
    the rows in flight at a push; a context long enough for the interrupted rows' continuations."""
    if not SGLANG_PYTHON.exists():
        pytest.skip(MISSING)
    keys = dict(sglang_interrupt=True, max_staleness=1, max_prompt_length=1024, sglang_restarts=1)
    run, state = build_run(engine_cfg(tmp_path_factory.mktemp("served"), ckpt, **keys))
    sampler = sglang.SGLangSampler(run)
    sampler.update_weights(state["params"], 0)
    yield run, state["params"], sampler
    sampler.close()


def assert_drawn_by(model, prompts, out, temperature=1.0):
    """Each row's logprobs are `model`'s at `temperature` (transformers' forward over the prompt and
    the row's tokens)."""
    for prompt, tokens, logprobs, n in zip(prompts, out.tokens, out.logprobs, out.lengths):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens[:n].tolist()])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits / temperature, -1)
        expected = expected.gather(1, torch.tensor(tokens[:n, None]).long())[:, 0].numpy()
        np.testing.assert_allclose(logprobs[:n], expected, atol=5e-4)


def perturbed(params):
    """Another model: every weight moved visibly (the tied embedding too)."""
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape).astype(x.dtype), params)


@needs_sglang
def test_greedy_tokens_and_logprobs_equal_transformers_also_after_a_weight_update(served, ckpt, tmp_path):
    run, params, sampler = served
    new = perturbed(params)
    export.export_hf(run, new, str(tmp_path / "new"))
    for version, weights, path in ((0, None, ckpt), (1, new, tmp_path / "new")):
        if weights is not None:
            sampler.update_weights(weights, version)
        model = hf_model(path)
        out = sampler.generate(PROMPTS, SamplingParams(8, temperature=0.0), jax.random.key(0))
        assert out.tokens.tolist() == [hf_greedy(model, p, 8) for p in PROMPTS] and out.version == version
        assert out.lengths.tolist() == [8, 8, 8] and out.mask.all() and not out.interrupted.any()
        assert_drawn_by(model, PROMPTS, out)
    measured = sampler.metrics()
    assert measured["time_weight_export"] > 0 and measured["time_weight_reload"] > 0
    sampler.update_weights(new, 1)  # the same version again (an eval after the step's push): nothing to do
    assert sampler.metrics() == {}
    assert os.listdir(sampler.export_root) == ["version_1"]  # the versions before are pruned
    # A row stops after its first stop id (kept, masked in); pad after it.
    expected = hf_greedy(model, PROMPTS[0], 8)
    stop = expected[3]
    cut = sampler.generate(PROMPTS[:1], SamplingParams(8, temperature=0.0, stop_token_ids=(stop,)), jax.random.key(0))
    first = expected.index(stop) + 1
    assert cut.lengths.tolist() == [first] and cut.tokens[0, :first].tolist() == expected[:first]
    assert (cut.tokens[0, first:] == run.tokenizer.pad_id).all() and (cut.logprobs[0, first:] == 0).all()


@needs_sglang
def test_sampled_logprobs_are_the_temperature_scaled_distributions(served):
    """(On a CPU SGLang ignores the rows' seeds: its deterministic inference, which honours them,
    refuses the CPU engine's attention; so no sample is asked to repeat here.)"""
    run, _, sampler = served
    copies = PROMPTS[:1] * 8
    out = sampler.generate(copies, SamplingParams(8, temperature=0.7), jax.random.key(1))
    assert_drawn_by(hf_model(sampler.path), copies, out, temperature=0.7)
    assert len({tuple(row) for row in out.tokens.tolist()}) > 1  # GRPO's copies of a prompt differ


def decode_logs(run) -> int:
    """How many decode batches the server has logged (one line each 40 decode steps of its batch)."""
    with open(os.path.join(run.cfg.run_dir, "sglang_server.log")) as f:
        return f.read().count("Decode batch")


@needs_sglang
def test_a_weight_update_interrupts_the_rows_in_flight_which_go_on_under_the_new_weights(served, tmp_path):
    """sglang_interrupt: a push aborts the rows in flight; each comes back marked interrupted with the
    tokens it had, drawn by the old weights (their logprobs the old model's forward), and its
    continuation from those tokens is the new weights' (the new model's forward over the whole prefix)."""
    run, params, sampler = served
    old, new = sampler.path, perturbed(params)
    version = sampler.version
    prompts = PROMPTS * 8
    before = decode_logs(run)
    handle = sampler.submit(prompts, SamplingParams(500), jax.random.key(4))
    while decode_logs(run) < before + 2:  # 40 decode steps or more (a line each 40 of the server's)
        time.sleep(0.1)
    old_model = hf_model(old)
    sampler.update_weights(new, version + 1)
    cut = handle.result()
    assert cut.version == version and (cut.lengths < 500).all() and cut.interrupted.all()
    rows = np.flatnonzero(cut.lengths > 0)[:3]
    assert len(rows) == 3, cut.lengths
    prompts, cut = [prompts[r] for r in rows], cut[rows]
    assert_drawn_by(old_model, prompts, cut)
    contexts = [p + t[:n].tolist() for p, t, n in zip(prompts, cut.tokens, cut.lengths)]
    rest = sampler.generate(contexts, SamplingParams(4), jax.random.key(5))
    assert rest.version == version + 1 and not rest.interrupted.any()
    assert_drawn_by(hf_model(sampler.path), contexts, rest)


@needs_sglang
def test_a_dead_server_is_restarted_then_one_line_when_no_restart_is_left(served):
    """The last test of the module's server: killed with SIGKILL, it is restarted from the newest
    version and the rows are sent again (sglang_restarts=1); killed again, the run would stop with one
    line naming the key and quoting the end of its log."""
    run, params, sampler = served
    model = hf_model(sampler.path)
    for killed in range(2):
        os.killpg(sampler.server.process.pid, signal.SIGKILL)
        sampler.server.process.wait()
        if killed:
            with pytest.raises(EngineError) as e:
                sampler.generate(PROMPTS, SamplingParams(8, temperature=0.0), jax.random.key(0))
            message = str(e.value)
            assert "\n" not in message and "died while sampling" in message and "sglang_restarts=1 used" in message
            assert "sglang_server.log" in message
        else:
            out = sampler.generate(PROMPTS, SamplingParams(8, temperature=0.0), jax.random.key(0))
            assert out.tokens.tolist() == [hf_greedy(model, p, 8) for p in PROMPTS]
    log = open(os.path.join(run.cfg.run_dir, "sglang_server.log")).read()
    assert log.count("==== unitrain:") == 2


@needs_sglang
def test_a_server_that_does_not_come_up_in_time_is_stopped(tmp_path, ckpt):
    run, state = build_run(engine_cfg(tmp_path, ckpt, sglang_startup_timeout=2))
    sampler = sglang.SGLangSampler(run)
    with pytest.raises(EngineError, match="did not come up within sglang_startup_timeout=2 s"):
        sampler.update_weights(state["params"], 0)
    assert sampler.server.process.poll() is not None


def test_bad_engine_keys_are_one_line_and_exit_status_2(tmp_path, capsys):
    args = [str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", "mode=grpo", "steps=1"]
    for keys, message in (
        ([f"sglang_python={tmp_path / 'nope'}"], "sglang_python: .*nope is not an executable.*setup.sh --sglang"),
        ([f"sglang_python={sys.executable}", "sglang_interrupt=true"], "sglang_interrupt aborts the SGLang rows"),
    ):
        assert train.main([*args, "sampler=sglang", *keys]) == 2
        error = capsys.readouterr().err.strip()
        assert re.search(message, error) and "\n" not in error and "Traceback" not in error, error


class SlowEngine(http.server.BaseHTTPRequestHandler):
    """An SGLang server's endpoints as the sampler calls them, each /generate answered after a second."""

    def do_GET(self):  # /model_info
        self.answer({"weight_version": "0"})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"] or 0))
        self.server.generates += self.path == "/generate"
        threading.Event().wait(1.0 if self.path == "/generate" else 0.0)
        self.answer({})

    def answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_a_request_that_times_out_is_retried_then_one_line_naming_the_keys(tmp_path, ckpt, monkeypatch):
    """sglang_request_timeout and sglang_max_retries reach the client: each try of a slow /generate
    times out, is sent again once, then the run stops with one line naming both keys."""
    engine = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowEngine)
    engine.generates = 0
    engine.handle_error = lambda request, address: None  # the client that timed out hung up: expected
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{engine.server_address[1]}"
    started = types.SimpleNamespace(url=url, wait_ready=lambda timeout, key: None, stop=lambda: None)
    monkeypatch.setattr(sglang, "Server", lambda *args: started)  # the endpoints above, not a server started
    keys = dict(sglang_python=sys.executable, sglang_request_timeout=0.3, sglang_max_retries=1)
    run, state = build_run(engine_cfg(tmp_path, ckpt, **keys))
    sampler = sglang.SGLangSampler(run)
    sampler.update_weights(state["params"], 0)
    with pytest.raises(EngineError) as e:
        sampler.generate([[1, 2, 3]], SamplingParams(4), jax.random.key(0))
    message = str(e.value)
    assert "timed out after sglang_request_timeout=0.3 s (after 1 retries, sglang_max_retries)" in message
    assert engine.generates == 2
    sampler.close()
    engine.shutdown()


def test_the_stand_in_fills_each_requests_slots_as_a_loop_over_them_does():
    """assign_req_to_token_pool_cpu (engines/sglang_kernel.py): each request's run of new cache slots
    lands in its row of the table, at its columns."""
    rng = np.random.default_rng(0)
    table = torch.tensor(rng.integers(0, 100, (6, 20)), dtype=torch.int32)
    pool_rows, starts, ends = torch.tensor([4, 0, 2]), torch.tensor([3, 0, 7]), torch.tensor([5, 6, 8])
    slots = torch.tensor(rng.integers(100, 1000, 12))  # 2 + 6 + 1 used, then slack
    expected, at = table.clone().numpy(), 0
    for row, start, end in zip(pool_rows.tolist(), starts.tolist(), ends.tolist()):
        expected[row, start:end] = slots[at : at + end - start].numpy()
        at += end - start
    sglang_kernel.assign_req_to_token_pool_cpu(pool_rows, table, starts, ends, slots, table.shape[1])
    np.testing.assert_array_equal(table.numpy(), expected)


@needs_sglang
def test_grpo_samples_on_the_sglang_server(tmp_path, ckpt):
    """Three GRPO steps of the recipe sampled by the server: the sampler's logprobs are the trainer's
    on policy, and each step pushes its weights."""
    args = [
        str(REPO / "configs" / "sglang_grpo.yml"),
        f"base_output_directory={tmp_path}",
        f"load_parameters_path={ckpt}",
        f"tokenizer_path={ckpt}",
        "steps=3",
        "per_device_batch_size=2",
        "rollout_batch_size=4",
        f"sglang_python={SGLANG_PYTHON}",
    ]
    assert train.main(args) == 0
    steps = [json.loads(line) for line in open(tmp_path / "sglang_grpo" / "metrics.jsonl")]
    steps = [s for s in steps if "loss" in s]
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert all(s["sampler_trainer_logprob_gap"] < 1e-3 for s in steps), steps
    assert all(s["time_weight_reload"] > 0 for s in steps[1:])
