"""tools/bench.py as a user runs it: a subprocess on the 8 simulated devices conftest.py sets up."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from helpers import REPO
from unitrain import metrics, reward_model, sharding
from unitrain.checks import load_checked
from unitrain.engines.factory import make_sampler
from unitrain.errors import ConfigError
from unitrain.models import decoder
from unitrain.models.scalar_head import build_scalar_model
from unitrain.run import build_run

OVERRIDES = ["model_name=tiny", "per_device_batch_size=2", "max_target_length=32", "matmul_peak_size=128"]


def run_bench(*args):
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "bench.py"), *args],
        cwd=REPO,
        env=os.environ,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_bench_tiny_prints_json_with_mfu(tmp_path):
    out_file = tmp_path / "bench.json"
    proc = run_bench("configs/base.yml", *OVERRIDES, "--steps", "2", "--warmup", "1", "--out", str(out_file))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out_file.read_text()) == result
    for key in ("tokens_per_sec", "mfu", "matmul_peak_flops_per_device", "step_time_median"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert result["step_time_min"] <= result["step_time_median"] <= result["step_time_max"]
    cfg = load_checked(["configs/base.yml", *OVERRIDES])
    expected = decoder.create(decoder.ModelConfig.from_config(cfg, sharding.target_platform())).flops_per_token(32)
    assert result["model_flops_per_token"] == expected
    assert result["config"]["num_devices"] == 8 and result["config"]["global_batch_rows"] == 16
    assert result["num_params"] > 0


def test_bench_bad_key_is_exit_2_with_one_line():
    proc = run_bench("configs/base.yml", "model_name=tiny", "emb_dimm=64")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench: unknown config key 'emb_dimm'"), proc.stderr


def test_compile_only_tiny_fsdp8_reports_sharded_memory():
    """--compile-only on 8 devices with fsdp=8: nothing runs, params are split 8 ways (norms replicated)."""
    overrides = ["model_name=tiny", "per_device_batch_size=2", "max_target_length=32", "ici_fsdp_parallelism=8"]
    proc = run_bench("configs/base.yml", *overrides, "--compile-only")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    result = json.loads(lines[0])
    memory = result["memory_per_device"]
    assert memory["argument"] > 0 and memory["temp"] >= 0
    assert memory["total_estimate"] == memory["argument"] + memory["output"] + memory["temp"] - memory["alias"]
    assert memory["peak"] >= memory["argument"]
    assert result["config"]["mesh_shape"] == {"data": 1, "fsdp": 8, "context": 1, "tensor": 1}
    assert result["config"]["num_devices"] == 8
    total_param_bytes = result["num_params"] * 4  # weight_dtype float32
    assert abs(result["param_bytes_per_device"] - total_param_bytes / 8) <= 0.1 * total_param_bytes / 8
    # AdamW: two moments shaped and sharded like the params, plus replicated scalars
    assert abs(result["opt_state_bytes_per_device"] - 2 * result["param_bytes_per_device"]) < 1024
    # the donated state is in the arguments
    assert memory["argument"] >= result["param_bytes_per_device"] + result["opt_state_bytes_per_device"]


def test_compile_for_builds_the_config_mesh_and_program_for_its_devices():
    """Within sharding.compile_for(devices) the config's mesh sizes, the mesh and the platform the
    model's choices follow are those of the devices given (here 4 of the 8): what --topology relies on."""
    import bench

    overrides = ["model_name=tiny", "per_device_batch_size=2", "max_target_length=32"]
    with sharding.compile_for(jax.devices()[:4]):
        assert sharding.target_platform() == "cpu"
        result = bench.compile_only(load_checked(["configs/base.yml", *overrides]))
    assert len(sharding.target_devices()) == 8
    assert result["config"]["mesh_shape"] == {"data": 1, "fsdp": 4, "context": 1, "tensor": 1}
    assert result["config"]["num_devices"] == 4 and result["config"]["global_batch_rows"] == 8
    whole = bench.compile_only(load_checked(["configs/base.yml", *overrides]))
    assert whole["config"]["num_devices"] == 8
    assert (
        abs(result["param_bytes_per_device"] - 2 * whole["param_bytes_per_device"])
        < 0.1 * result["param_bytes_per_device"]
    )


def test_topology_needs_compile_only_a_valid_name_and_libtpu():
    for args, message in (
        (["--topology", "v5e:2x2"], "--topology compiles for a TPU slice that is not here"),
        (["--compile-only", "--topology", "v5e:2y"], "--topology 'v5e:2y': expected a TPU version"),
    ):
        proc = run_bench("configs/base.yml", "model_name=tiny", *args)
        assert proc.returncode == 2 and proc.stderr.startswith(f"bench: {message}"), proc.stderr
    if importlib.util.find_spec("libtpu") is None:
        proc = run_bench("configs/base.yml", "model_name=tiny", "--compile-only", "--topology", "v5e:2x2")
        assert proc.returncode == 2 and proc.stderr.startswith("bench: --topology needs libtpu beside jax"), proc.stderr


@pytest.mark.parametrize("installed, refused", [("0.0.42", True), ("0.0.50.1", False), ("0.0.50", False)])
def test_a_libtpu_other_than_the_one_jax_names_is_one_line(monkeypatch, installed, refused):
    """jax 0.12.0.1 names libtpu==0.0.50.*; 0.0.42 fails to compile splash (`no such field:
    'debug_locations'`), so --topology refuses it before compiling."""
    import bench

    versions = {"libtpu": installed}
    monkeypatch.setattr(bench.metadata, "version", lambda name: versions[name])
    monkeypatch.setattr(bench.metadata, "requires", lambda name: ['libtpu==0.0.50.*; extra == "tpu"', "numpy>=2"])
    message = bench.libtpu_mismatch()
    assert (message is not None) == refused
    if refused:
        assert message.startswith("libtpu 0.0.42 is installed and jax") and "for libtpu 0.0.50.*" in message
        assert f"pip install 'jax[tpu]=={jax.__version__}'" in message


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (pip install libtpu)")
def test_topology_compiles_for_a_tpu_slice_that_is_not_here():
    """v5e:2x2 on this CPU: the program is XLA:TPU's for 4 chips, and the model takes the TPU's
    kernel (attention=splash, which this CPU's config check refuses)."""
    args = ["configs/base.yml", *OVERRIDES, "attention=splash", "--compile-only"]
    refused = run_bench(*args)
    assert refused.returncode == 2 and "this platform is cpu" in refused.stderr
    proc = run_bench(*args, "--topology", "v5e:2x2")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["config"]["platform"] == "tpu" and result["config"]["device_kind"].startswith("TPU v5")
    assert result["config"]["mesh_shape"] == {"data": 1, "fsdp": 4, "context": 1, "tensor": 1}
    memory = result["memory_per_device"]
    assert memory["temp"] > 0 and memory["peak"] > memory["argument"]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (pip install libtpu)")
def test_topology_compiles_the_sampler_for_a_tpu_slice_that_is_not_here():
    """The generate program's inputs are abstract there: a compile-only client makes no arrays."""
    proc = run_bench(
        *["configs/base.yml", *OVERRIDES, "--compile-only", "--mode", "sampler", "--batch", "4"],
        *["--prompt-len", "16", "--new-tokens", "16", "--topology", "v5e:2x2"],
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["config"]["platform"] == "tpu" and result["block_shape"] == [4, 16]
    assert result["memory_per_device"]["temp"] > 0


def _one_line_too_big(proc, name):
    """(needed, available) bytes of the one `bench:` line a program that does not fit ends in."""
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    ours = [line for line in proc.stderr.splitlines() if line.startswith("bench:")]
    assert len(ours) == 1 and ours[0] == proc.stderr.strip().splitlines()[-1], proc.stderr
    found = re.fullmatch(
        rf"bench: {name} does not fit the device: it needs ([\d,]+) bytes \(.*\) of HBM and the device has ([\d,]+) "
        r"bytes .*; lower per_device_batch_size or max_target_length, set remat_policy, or shard over more devices",
        ours[0],
    )
    assert found, ours[0]
    return tuple(int(n.replace(",", "")) for n in found.groups())


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (pip install libtpu)")
def test_topology_compile_that_does_not_fit_is_one_line_and_exit_2():
    """Llama 3.1 8B's update on one v5e chip (16 GB of HBM): XLA:TPU's RESOURCE_EXHAUSTED becomes
    one line with what the program needs and what the chip has."""
    proc = run_bench("configs/base.yml", "model_name=llama3.1-8b", "--compile-only", "--topology", "v5e:1x1")
    need, have = _one_line_too_big(proc, "sft update")
    assert 15 * 2**30 < have <= 16 * 2**30 < need


@pytest.mark.parametrize(
    "message, need, have, memory",
    [
        (
            "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (476.00G) "
            "exceeds available HBM (15.75G).",
            476 * 2**30,
            15.75 * 2**30,
            "HBM",
        ),
        (
            "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 22.54G "
            "of 15.48G hbm. Exceeded hbm capacity by 7.06G.\n\nTotal hbm usage >= 23.06G:\n    reserved 530.00M",
            22.54 * 2**30,
            15.48 * 2**30,
            "hbm",
        ),
    ],
)
def test_xla_compile_oom_messages_become_one_line(message, need, have, memory):
    """XLA's two compile-time out-of-memory sentences (sizes in binary units) -> needed and available
    bytes; another RESOURCE_EXHAUSTED keeps XLA's first line; any other error is not ours."""
    from unitrain.compile_cache import program_too_big

    error = str(program_too_big("train_step", message))
    assert "\n" not in error and error.startswith("train_step does not fit the device: it needs ")
    assert f"{round(need):,} bytes" in error and f"of {memory} and the device has {round(have):,} bytes" in error
    other = str(program_too_big("train_step", "RESOURCE_EXHAUSTED: a new sentence\nand more"))
    assert other.startswith("train_step does not fit the device (XLA: a new sentence);") and "\n" not in other
    assert program_too_big("train_step", "INTERNAL: something else") is None


def test_compile_only_compiles_the_grpo_and_dpo_updates():
    """The update of each RL mode, at the longest rows its config allows: GRPO rows of the prompt
    bucket (32 for 20 prompt tokens) plus 8 completion columns; DPO pairs of two sequences."""
    cfg = load_checked(["configs/base.yml", *OVERRIDES])
    flops = decoder.create(decoder.ModelConfig.from_config(cfg, sharding.target_platform())).flops_per_token
    grpo = [
        "--mode",
        "grpo",
        "kl_coef=0.1",
        "rollout_batch_size=4",
        "n_samples_per_prompt=4",
        "max_prompt_length=20",
        "rollout_max_response_len=8",
    ]
    for args, mode, sequences, length in ((grpo, "grpo", 16, 32 + 8), (["mode=dpo"], "dpo", 2 * 16, 32)):
        proc = run_bench("configs/base.yml", *OVERRIDES, *args, "--compile-only")
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["config"]["mode"] == mode and result["memory_per_device"]["temp"] > 0
        assert result["model_flops_per_device"] == flops(length) * sequences * length / 8
    proc = run_bench("configs/base.yml", *OVERRIDES, "--mode", "push", "--compile-only")
    assert proc.returncode == 2 and proc.stderr.startswith("bench: --compile-only compiles a program")


def test_compile_only_sampler_sizes_the_program_generate_runs():
    """--mode sampler --compile-only on fsdp=8: the generate program of the bucketed block (5 prompts
    of 9 ids -> 8 rows x 16 columns) and its KV cache (keys and values of every layer over 16 + 6
    columns, segment ids, positions, the write column). In process: real weights then hit the same
    compiled program, so the figures are those of the program generate runs."""
    import bench

    args = ["model_name=tiny", "ici_fsdp_parallelism=8"]
    proc = run_bench(
        "configs/base.yml",
        *args,
        "--mode",
        "sampler",
        "--compile-only",
        "--batch",
        "5",
        "--prompt-len",
        "9",
        "--new-tokens",
        "6",
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    cfg = load_checked(["configs/base.yml", *args])
    kv = cfg.num_decoder_layers * 2 * 8 * cfg.num_kv_heads * cfg.head_dim * (16 + 6) * 4
    assert result["block_shape"] == [8, 16] and result["kv_cache_bytes"] == kv + 2 * 8 * 22 * 4 + 8 * 4
    memory = result["memory_per_device"]
    assert memory["argument"] >= result["decode_weight_bytes_per_device"] > 0 and memory["temp"] > 0
    assert result["sampling_bytes_per_device"] == (
        result["param_bytes_per_device"] + result["decode_weight_bytes_per_device"] + memory["temp"] + memory["output"]
    )
    assert result["config"]["mesh_shape"]["fsdp"] == 8

    run, state = build_run(cfg)
    sampler = make_sampler(run)
    prompts, sampling = [[1] * 9] * 5, bench.rollout_sampling(cfg, 6)
    sampler.update_weights(bench.abstract_run(cfg)[1]["params"], 0)
    sampler.generate_program(sampler.generate_call(prompts, sampling, jax.random.key(0)))
    assert len(run.programs) == 2  # generate and the decode weights
    sampler.update_weights(state["params"], 0)
    assert sampler.generate(prompts, sampling, jax.random.key(1)).tokens.shape == (5, 6)
    assert len(run.programs) == 2  # no more compiles: the abstract weights had the real ones' signature
    mesh_cfg = load_checked(
        [
            "configs/base.yml",
            "model_name=tiny",
            "mode=grpo",
            "sampler=mesh",
            "rollout_devices=4",
            "per_device_batch_size=2",
        ]
    )
    with pytest.raises(ConfigError, match="compiles the colocated sampler's program, not sampler=mesh"):
        bench.compile_sampler(mesh_cfg, 5, 9, 6)


@pytest.mark.parametrize("offload", [False, True])
def test_abstract_state_matches_init_state(offload):
    """The abstract state --compile-only compiles for has the shapes, dtypes, shardings and memories
    (the optimizer state's in host memory with optimizer_host_offload) of the real one."""
    import jax

    import bench
    from unitrain import sharding
    from unitrain.run import build_run

    overrides = ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", f"optimizer_host_offload={str(offload).lower()}"]
    cfg = load_checked(["configs/base.yml", "model_name=tiny", *overrides])
    _, real = build_run(cfg)
    _, abstract = bench.abstract_run(cfg)
    assert jax.tree.structure(real) == jax.tree.structure(abstract)
    for r, a in zip(jax.tree.leaves(real), jax.tree.leaves(abstract)):
        assert (r.shape, r.dtype) == (a.shape, a.dtype)
        assert r.sharding.is_equivalent_to(a.sharding, r.ndim)
        assert r.sharding.memory_kind == a.sharding.memory_kind
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(abstract["opt_state"]) if x.ndim}
    assert kinds == {"pinned_host" if offload else "device"}
    per_device = sharding.bytes_per_device(real)
    assert bench.bytes_per_device(real) == bench.bytes_per_device(abstract) == max(per_device.values())


def test_sampler_and_grpo_modes_do_the_stated_work(tiny_checkpoint):
    """Every sampled row runs to new_tokens (no stop token), and GRPO steps run with their parts timed."""
    import bench

    cfg = load_checked(
        [
            "configs/base.yml",
            f"load_parameters_path={tiny_checkpoint('qwen2')}",
            "per_device_batch_size=1",
            "kl_coef=0.04",
        ]
    )
    sampled = bench.bench_sampler(cfg, batch=8, prompt_len=8, new_tokens=6, reps=2, warmup=1)
    assert sampled["tokens_per_call"] == 8 * 6
    assert sampled["tokens_per_sec"] == 48 / sampled["call_time_median"]
    step_time = (sampled["call_time_median"] - sampled["first_token_call_time_median"]) / 5
    assert sampled["decode_step_time"] == pytest.approx(step_time)
    assert sampled["decode_tokens_per_sec"] == pytest.approx(8 / step_time)
    assert sampled["decode_bandwidth_fraction"] == pytest.approx(
        sampled["decode_bytes_per_step"] / step_time / (sampled["memory_bandwidth_per_device"] * sampled["num_devices"])
    )
    step = bench.bench_grpo(cfg, prompts=2, samples=4, prompt_len=8, new_tokens=4, steps=2, warmup=1)
    assert len(step["step_times"]) == 2
    # 8 rows on 8 devices: no device holds a whole group; one update of one micro-batch: no old pass
    assert step["shared_prompt_rows"] == {"logprobs": 1, "update": 1} and not step["old_logprob_pass"]
    shared = bench.bench_grpo(
        cfg.replace(per_device_batch_size=4), prompts=8, samples=4, prompt_len=8, new_tokens=2, steps=1, warmup=0
    )
    assert shared["shared_prompt_rows"] == {"logprobs": 4, "update": 4}
    assert 0 < step["time_rollout"] + step["time_logprob"] + step["time_update"] <= step["step_time_median"] * 1.5


def test_sampler_against_an_override_times_both_in_turn(tiny_checkpoint, capsys):
    """--against: A and B alternate in one process; the speedup is the median of the pairs' ratios;
    the same draws are reported as such, and a different temperature's draws as different."""
    import bench

    common = [
        "configs/base.yml",
        f"load_parameters_path={tiny_checkpoint('qwen2')}",
        "--mode",
        "sampler",
        "--batch",
        "4",
        "--prompt-len",
        "8",
        "--new-tokens",
        "6",
        "--steps",
        "3",
        "--warmup",
        "1",
    ]
    for override, same in (("rollout_cache_phases=1", True), ("rollout_temperature=0.5", False)):
        assert bench.main([*common, "--against", override]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        a, b = result["call_times"], result["against"]["call_times"]
        assert len(a) == len(b) == 3 and result["against"]["same_tokens"] is same
        ratios = sorted(x / y for x, y in zip(a, b))
        assert result["against"]["speedup_median"] == pytest.approx(ratios[1])
        assert result["tokens_per_sec"] == pytest.approx(24 / sorted(a)[1])
    assert bench.main([*common, "--against", "rollout_cache_phases=1", "--compile-only"]) == 2
    assert "--against times two configs side by side" in capsys.readouterr().err


def test_chunk_tokens_times_one_call_and_re_prefilled_chunks_in_turn(tiny_checkpoint, capsys):
    """--chunk-tokens: the rows in one call (A) and 2 tokens a call (B) alternate; tokens/s are the
    rows' tokens over each side's median, B / A the median of the pairs' ratios."""
    import bench

    args = ["configs/base.yml", f"load_parameters_path={tiny_checkpoint('qwen2')}", "--mode", "sampler"]
    shape = ["--batch", "4", "--prompt-len", "8", "--new-tokens", "6", "--chunk-tokens", "2", "--steps", "3"]
    assert bench.main([*args, *shape, "--warmup", "1"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    a, b = result["call_times"], result["chunked_times"]
    assert len(a) == len(b) == 3
    assert result["one_call_tokens_per_s"] == pytest.approx(24 / sorted(a)[1])
    assert result["chunked_tokens_per_s"] == pytest.approx(24 / sorted(b)[1])
    assert result["chunked_over_one_call_median"] == pytest.approx(sorted(y / x for x, y in zip(a, b))[1])


def test_sft_against_an_override_times_both_on_the_same_rows(capsys):
    """--against on the SFT step: the same 8 rows on the fsdp mesh (A) and split over a context axis
    of 2 (B: 2 rows a device of the batch axes); both steps give the same loss."""
    import bench

    common = ["configs/base.yml", "model_name=tiny", "max_target_length=32", "peak_flops_per_device=1e12"]
    split = ["--against", "ici_context_parallelism=2", "--against", "per_device_batch_size=2"]
    assert bench.main([*common, "per_device_batch_size=1", "--steps", "2", "--warmup", "0", *split]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    a, b = result["step_time_min"], result["against"]
    assert result["config"]["global_batch_rows"] == b["global_batch_rows"] == 8
    assert b["mesh_shape"] == {"data": 1, "fsdp": 4, "context": 2, "tensor": 1} and len(b["step_times"]) == 2
    assert b["final_loss"] == pytest.approx(result["final_loss"], rel=1e-5) and a > 0
    assert b["speedup_median"] > 0


def test_a_long_tailed_round_gives_each_row_its_budget(tiny_checkpoint, capsys):
    """--long-tail: the rows' budgets are long_tail_budgets (one in 16 rows, at least one, runs to
    --new-tokens); compaction draws the same tokens; tokens/s counts the budgets."""
    import bench

    budgets = bench.long_tail_budgets(64, 256, 0)
    assert budgets.count(256) >= 4 and 1 <= min(budgets) and sum(budgets) < 64 * 256 / 3
    args = [
        "configs/base.yml",
        f"load_parameters_path={tiny_checkpoint('qwen2')}",
        "rollout_compaction=1",
        "rollout_compaction_min_tokens=0",
    ]
    args += ["--mode", "sampler", "--batch", "4", "--prompt-len", "8", "--new-tokens", "6", "--long-tail"]
    assert bench.main([*args, "--steps", "1", "--warmup", "0", "--against", "rollout_compaction=0"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["row_budgets"] == list(bench.long_tail_budgets(4, 6, 0)) and result["against"]["same_tokens"]
    assert result["tokens_per_sec"] == pytest.approx(sum(result["row_budgets"]) / result["call_times"][0])
    assert bench.main([*args, "--compile-only"]) == 2
    assert "--long-tail times a long-tailed sampler round" in capsys.readouterr().err


@pytest.mark.parametrize("phases", [1, 4])
def test_decode_bytes_are_the_weights_and_the_cache_attended(tiny_checkpoint, phases):
    """Counted from the checkpoint's own files: its safetensors' elements in the compute dtype, and
    keys and values of every layer over the padded block (16-token prompt bucket + the new tokens
    of the step's phase), averaged over the 5 decode steps of 6 new tokens."""
    from safetensors import safe_open

    import bench

    path = tiny_checkpoint("qwen2")
    hf = json.loads((Path(path) / "config.json").read_text())
    with safe_open(str(Path(path) / "model.safetensors"), "np") as f:
        elements = sum(f.get_tensor(name).size for name in f.keys())
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        cfg = load_checked(["configs/base.yml", f"load_parameters_path={path}", f"dtype={dtype}"])
        run, state = build_run(cfg)
        sampler = make_sampler(run)
        rows, columns = sampler.block_shape(5, 9)
        assert (rows, columns) == (8, 16)  # powers of two, prompts at least 16 (generate's bucketing)
        head_dim = hf["hidden_size"] // hf["num_attention_heads"]
        # 4 phases of 6 tokens end at tokens 2, 3, 5, 6: steps 1 to 5 attend over these many new columns.
        lengths = [columns + n for n in ((6, 6, 6, 6, 6) if phases == 1 else (2, 3, 5, 5, 6))]
        cache = [
            hf["num_hidden_layers"] * 2 * rows * hf["num_key_value_heads"] * head_dim * length * size
            + 2 * rows * length * 4
            + rows * 4
            for length in lengths
        ]  # + segment ids, positions, the write column
        got = bench.decode_bytes_per_step(run.model, state["params"], dtype, rows, columns, 6, phases)
        assert got == pytest.approx(elements * size + sum(cache) / 5, rel=1e-12)


def test_memory_bandwidth_is_bytes_over_the_sum_time():
    """The read rate of a jitted sum: a 64 MiB array read in a plausible time for any machine."""
    bandwidth = metrics.measure_memory_bandwidth(2**26, iters=3)
    assert 1e8 < bandwidth < 1e13


def test_push_mode_times_the_copy_to_the_rollout_mesh():
    import bench

    cfg = load_checked(
        [
            "configs/base.yml",
            "model_name=tiny",
            "mode=grpo",
            "sampler=mesh",
            "rollout_devices=4",
            "per_device_batch_size=2",
            "rollout_fsdp_parallelism=2",
        ]
    )
    result = bench.bench_push(cfg, steps=2, warmup=1)
    model = decoder.create(decoder.ModelConfig.from_config(cfg, sharding.target_platform()))
    sizes = [x.size for x in jax.tree.leaves(nnx.state(model))]
    assert result["parameters"] == sum(sizes) and result["gigabytes"] == sum(sizes) * 4 / 1e9  # float32 weights
    assert (
        len(result["push_times"]) == 2
        and result["push_seconds_median"] > 0
        and result["through_hosts_seconds_median"] > 0
    )
    assert (
        result["rollout_mesh"] == {"data": 2, "fsdp": 2, "context": 1, "tensor": 1}
        and result["trainer_mesh"]["fsdp"] == 4
    )
    proc = run_bench("configs/base.yml", "model_name=tiny", "--mode", "push")  # sampler colocated: nothing to push
    assert proc.returncode == 2 and "--mode push times the weight push of sampler=mesh" in proc.stderr


def test_peer_ab_alternates_the_peer_and_unitrain_and_reports_their_ratios(tiny_checkpoint, tmp_path):
    """tools/peer_ab.sh with a stand-in for Tunix's venv (a python that prints the peer's JSON line):
    one line per pair with ours over the peer's rate, and the median of the pairs; user mistakes exit 2."""
    peer, venv = tmp_path / "peer", tmp_path / "venv" / "bin"
    peer.mkdir()
    venv.mkdir(parents=True)
    (venv / "python").write_text('#!/bin/sh\necho "peer log line" >&2\necho \'{"sampler_tokens_per_s": 50.0}\'\n')
    (venv / "python").chmod(0o755)
    env = {
        **os.environ,
        "TUNIX_VENV": str(venv.parent),
        "CKPT": str(tiny_checkpoint("qwen2")),
        "PEER": str(peer),
        "PYTHON": sys.executable,
    }
    script = str(REPO / "tools" / "peer_ab.sh")
    done = subprocess.run([script, "sampler", "2", "4", "8", "6"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    *pairs, summary = done.stdout.strip().splitlines()
    ratios = []
    for line in pairs:
        fields = dict(word.split("=") for word in line.split() if "=" in word)
        assert float(fields["sampler_tokens_per_s"]) == 50.0
        ratios.append(float(line.split()[-1]))
        assert ratios[-1] == pytest.approx(float(fields["tokens_per_sec"]) / 50.0, abs=1e-3)
    assert len(ratios) == 2 and summary.startswith(f"median ratio {sum(ratios) / 2:.3f} of 2")
    wrong = subprocess.run([script, "rollout", "1"], env=env, capture_output=True, text=True)
    assert wrong.returncode == 2 and "mode must be sampler or grpo, not 'rollout'" in wrong.stderr
    missing = subprocess.run(
        [script, "grpo", "1"], env={**env, "TUNIX_VENV": str(tmp_path / "none")}, capture_output=True, text=True
    )
    assert missing.returncode == 2 and "no Tunix venv at" in missing.stderr


def test_compile_only_rm_score_sizes_the_scoring_forward():
    """--mode rm_score on fsdp=8: one bucket of 3 texts of 40 tokens, padded as the scorer pads it
    (8 rows: a power of two, a multiple of the 8 devices); its arguments are one device's share of
    the scalar-head model's parameters and of the three [rows, length] int32 columns."""
    args = ["model_name=tiny", "ici_fsdp_parallelism=8", "reward_model_batch_size=3", "reward_model_max_length=40"]
    proc = run_bench("configs/base.yml", *args, "--compile-only", "--mode", "rm_score")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    result = json.loads(lines[0])
    assert {"rows", "length", "param_bytes_per_device", "batch_bytes_per_device", "memory_per_device"} <= set(result)
    assert (result["mode"], result["rows"], result["length"]) == ("rm_score", 8, 40)
    assert result["config"]["mesh_shape"] == {"data": 1, "fsdp": 8, "context": 1, "tensor": 1}
    cfg = load_checked(["configs/base.yml", *args])
    mesh = sharding.trainer_mesh(cfg, sharding.layout_for(cfg))
    model = build_scalar_model(cfg, mesh, "")
    leaves = jax.tree.leaves(nnx.to_pure_dict(nnx.state(model)))
    params = sum(x.addressable_shards[0].data.nbytes for x in leaves)
    batch = 3 * (8 // 8) * 40 * 4
    assert result["num_params"] == sum(x.size for x in leaves)
    assert (result["param_bytes_per_device"], result["batch_bytes_per_device"]) == (params, batch)
    memory = result["memory_per_device"]
    assert memory["argument"] == params + batch and memory["temp"] > 0
    proc = run_bench("configs/base.yml", *args, "--mode", "rm_score")
    assert proc.returncode == 2 and proc.stderr.startswith("bench: --mode rm_score sizes the reward model's scoring")


@pytest.mark.parametrize("offload", [False, True])
def test_rm_score_lowers_the_program_the_reward_model_scores_with(tiny_checkpoint, offload):
    """The abstract program bench compiles is, to its HLO text, the one the reward of a loaded
    classifier lowers for a bucket of the same shape (its parameters in host memory with offload)."""
    import bench

    path = tiny_checkpoint("qwen2", num_labels=1, tie=True)
    cfg = load_checked(
        [
            "configs/base.yml",
            "model_name=",
            f"load_parameters_path={path}",
            "reward=rm",
            f"reward_model_path={path}",
            "reward_model_batch_size=3",
            "reward_model_max_length=40",
            f"reward_model_host_offload={str(offload).lower()}",
        ]
    )
    forward, params, batch, mesh = bench.rm_score_program(cfg)
    scorer = reward_model.RewardModelScorer(cfg, mesh, sharding.rules_from_config(cfg.logical_axis_rules))
    kind = "pinned_host" if offload else "device"
    assert {x.sharding.memory_kind for x in jax.tree.leaves((params, scorer.params))} == {kind}
    rows = jax.device_put(np.ones(batch[0].shape, np.int32), scorer.rows_sharding)
    real = scorer.forward.lower(scorer.params, rows, rows, rows).as_text()
    assert forward.lower(params, *batch).as_text() == real


def test_compile_only_compiles_the_rm_update_on_the_scalar_head_model():
    """mode=rm: the update of pairs on the scalar-head model (the causal LM's parameters less its
    output head, plus the [E, 1] score), each pair two rows of max_target_length."""
    import bench

    cfg = load_checked(["configs/base.yml", *OVERRIDES, "mode=rm"])
    result = bench.compile_only(cfg)
    causal = decoder.create(decoder.ModelConfig.from_config(cfg, sharding.target_platform()))
    causal_params = sum(x.size for x in jax.tree.leaves(nnx.state(causal, nnx.Param)))
    assert result["config"]["mode"] == "rm"
    assert result["num_params"] == causal_params - cfg.vocab_size * cfg.emb_dim + cfg.emb_dim
    assert (
        result["memory_per_device"]["argument"]
        >= result["param_bytes_per_device"] + result["opt_state_bytes_per_device"]
    )
    assert result["model_flops_per_device"] > 0 and result["memory_per_device"]["temp"] > 0


def test_compile_only_sizes_offline_distillation_with_abstract_teachers(capsys):
    """mode=sft with two teachers of 4 layers (--teacher's keys over the tiny student's): teacher_path
    is not read; each teacher has the parameters of that model built concretely, split over the 8
    devices, and the update's arguments are the student's plus the teachers' exactly."""
    import bench

    student = ["configs/base.yml", *OVERRIDES]
    distill = [*student, "teacher_path=/not/read,/nor/this", "distill_coef=0.5"]
    result = bench.compile_only(load_checked(distill), load_checked([*distill, "num_decoder_layers=4"]))
    alone = bench.compile_only(load_checked(student))
    teacher_cfg = load_checked([*student, "num_decoder_layers=4"])
    model = decoder.create(decoder.ModelConfig.from_config(teacher_cfg, sharding.target_platform()))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert result["teacher_params"] == [count, count] and alone["teacher_params"] == []
    assert abs(result["teacher_bytes_per_device"] - 2 * count * 4 / 8) < 0.05 * result["teacher_bytes_per_device"]
    grown = result["memory_per_device"]["argument"] - alone["memory_per_device"]["argument"]
    assert grown == result["teacher_bytes_per_device"] and result["memory_per_device"]["temp"] > 0
    assert bench.main([*student, "--teacher", "num_decoder_layers=4", "--compile-only"]) == 2
    # the last line: an earlier in-process main's log handler may write to a capture already closed
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("bench: --teacher gives the shape of teacher_path's teachers")
