"""Every test runs on 8 simulated CPU devices so that each sharding path is exercised."""

import os

# The suite's programs are tiny: LLVM's optimisations of them cost more compile time than they save
# at run time (the suite 16 -> 11-12 minutes on 2 cores). Numerics are unchanged: no fast math either way.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0", "--xla_force_host_platform_device_count=8"]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session (subprocesses inherit it): the many runs of the
# same tiny programs compile once. Fresh per session, so nothing stale carries over.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="unitrain-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import functools

import pytest

import helpers  # noqa: F401  (puts tools/ on sys.path before any test: make_tiny_model, launch, the tools under test)

# Each family with the variant that exercises its distinctive code path.
FAMILY_VARIANTS = {
    "llama": dict(rope_scaling="llama3"),
    "qwen2": dict(tie=True),
    "qwen3": dict(),
    "mistral": dict(sliding_window=64),
    # Every 6th layer global, the others sliding over 64 positions; linear RoPE scaling on the global ones.
    "gemma3": dict(tie=True, layers=6, sliding_window=64, rope_scaling="linear"),
    "qwen2_5_vl": dict(),
    "gemma3_vision": dict(tie=True, layers=6, sliding_window=64, rope_scaling="linear"),
}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(family, **variant) -> dir of a random tiny HF checkpoint made by
    tools/make_tiny_model.py, with `variant` (make_tiny_model's keywords) or else FAMILY_VARIANTS[family].

    A large init std makes attention sharp, so a wrong mask or RoPE changes logits visibly.
    """
    from make_tiny_model import make_tiny_model

    made = {}

    def get(family: str, **variant):
        key = (family, tuple(sorted(variant.items())))
        if key not in made:
            made[key] = make_tiny_model(
                tmp_path_factory.mktemp(f"hf_{family}"), family, init_std=0.25, **(variant or FAMILY_VARIANTS[family])
            )
        return made[key]

    return get


@pytest.fixture(autouse=True, scope="session")
def machine_rates_measured_once_per_process():
    """A run without peak_flops_per_device measures the machine's matmul peak as it starts (metrics.
    measure_matmul_peak: 32 float32 2048 x 2048 dots, 10-30 s on the suite's shared CPUs), and most
    runs of the suite's own tests set no peak; bench.py's sampler mode measures the memory bandwidth
    (sums over 512 MB) the same way. Here each worker measures each at most at a small size (a 512 x
    512 dot, 64 MB), once per set of arguments, and every later call of that worker takes the figure:
    they are the denominators of MFU and of the bandwidth fraction, and no test asserts their value.
    test_metrics and test_bench call the measurements with their own sizes, under these caps;
    test_progress replaces the peak's."""
    from unitrain import metrics

    originals = metrics.measure_matmul_peak, metrics.measure_memory_bandwidth
    peak, bandwidth = map(functools.cache, originals)
    metrics.measure_matmul_peak = lambda dtype="float32", n=2048, iters=10: peak(dtype, min(n, 512), iters)
    metrics.measure_memory_bandwidth = lambda nbytes=2**29, iters=10: bandwidth(min(nbytes, 2**26), iters)
    yield
    metrics.measure_matmul_peak, metrics.measure_memory_bandwidth = originals
