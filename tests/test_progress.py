"""Progress figures against the wall clock: a run whose steps take uneven device and host times (the
device's part busy work queued after each step, the host's a sleep before it) prints on every line
the tokens of the steps since the line before over that interval's wall time, MFU from that rate, an
s/step and ETA from it, and never a step faster than its device work."""

import json
import re
import time

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from helpers import only_first_device
from helpers import sft_config as config
from unitrain import metrics, sharding, train
from unitrain.models import sources
from unitrain.tasks import sft

LOG_PERIOD = 4
# (host seconds before the step, device seconds after it) by step % LOG_PERIOD. Slow-device steps
# followed by slow-host ones: a step whose outputs are first looked at after the next one's host work
# is where a clock that dates them then goes wrong. The step after a line's has no host time, so the
# line prints when its step completes and the prints' spacing is the lines' intervals.
PACE = [(0.0, 0.2), (0.0, 0.2), (0.2, 0.05), (0.2, 0.05)]
FASTEST = min(device for _, device in PACE)
STEPS = 16
ROWS, LENGTH = 8, 16  # 128 tokens a step: tokens/s stays under 1000, printed to 4 digits
# The reference wall time of a line's interval (between two prints) is off by the time a print takes
# and a thread's wake-up: a few milliseconds.
ABSOLUTE, RELATIVE = 0.02, 0.05


@jax.jit
def spin(zero, iterations):
    """`iterations` products of a 64 x 64 matrix with itself: device work of a known length. Returns
    `zero` (0.0 at run time, so nothing can fold it away) once the work is done."""
    m = jnp.full((64, 64), 1 / 64, jnp.float32) + zero  # m @ m == m
    return zero * lax.fori_loop(0, iterations, lambda _, m: m @ m, m)[0, 0]


def spin_iterations(seconds: float) -> int:
    """Iterations of `spin` that take `seconds` at the fastest this machine ran them."""
    zero, probe = jnp.float32(0), 400
    spin(zero, probe).block_until_ready()
    fastest = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        spin(zero, probe).block_until_ready()
        fastest = min(fastest, time.perf_counter() - start)
    return max(1, round(seconds / (fastest / probe)))


def paced(monkeypatch):
    """SFTTask.step with PACE's host sleep before it and device work after it, the device work of
    consecutive steps chained (one device: a step's work starts when the one before ended)."""
    iterations = {device: spin_iterations(device) for _, device in PACE}
    step = sft.SFTTask.step
    chain = {"zero": jnp.float32(0)}

    def paced_step(self, state, at):
        host, device = PACE[at % LOG_PERIOD]
        time.sleep(host)
        state, out = step(self, state, at)
        chain["zero"] = spin(chain["zero"] * out["loss"], iterations[device])
        return state, {**out, "loss": out["loss"] + chain["zero"]}

    monkeypatch.setattr(sft.SFTTask, "step", paced_step)


def printed_lines(monkeypatch) -> list:
    """(step, perf_counter, text) of every progress line, as it is made."""
    lines = []
    make = metrics.MetricsWriter._progress_line

    def made(self, step, values):
        text = make(self, step, values)
        lines.append((step, time.perf_counter(), text))
        return text

    monkeypatch.setattr(metrics.MetricsWriter, "_progress_line", made)
    return lines


def figure(pattern: str, text: str) -> float:
    number, unit = re.search(pattern, text).groups()
    return float(number) * {"": 1, "k": 1e3, "M": 1e6}[unit]


def eta_seconds(text: str) -> int:
    h, m, s = text.rsplit("ETA ", 1)[1].split(":")
    return int(h) * 3600 + int(m) * 60 + int(s)


def test_every_line_is_its_intervals_tokens_over_its_wall_time(tmp_path, monkeypatch):
    cfg = config(
        tmp_path,
        f"steps={STEPS}",
        f"log_period={LOG_PERIOD}",
        f"max_target_length={LENGTH}",
        f"checkpoint_period={STEPS}",
    )
    ones = dict(data=1, fsdp=1, tensor=1)
    flops_per_token = sources.build(cfg, sharding.create_mesh(ones, ones, jax.devices()[:1])).flops_per_token(LENGTH)
    tokens = ROWS * LENGTH
    # The fastest step at MFU 0.5: a line above 1 counts a step's work in less than its device's time.
    peak = 2 * tokens * flops_per_token / FASTEST
    cfg = cfg.replace(peak_flops_per_device=peak)
    paced(monkeypatch)
    lines = printed_lines(monkeypatch)
    with only_first_device():
        assert train.train(cfg) == 0

    assert [step for step, _, _ in lines] == [0, 4, 8, 12, 15]
    for (was, then, _), (step, now, text) in zip(lines, lines[1:]):
        wall, steps = now - then, step - was
        tokens_per_sec = figure(r"([\d.]+)([kM]?) tok/s", text)
        assert tokens_per_sec * wall == pytest.approx(tokens * steps, rel=RELATIVE, abs=ABSOLUTE * tokens_per_sec), text
        mfu = figure(r"MFU ([\d.]+)()%", text) / 100
        assert mfu <= 1 and mfu == pytest.approx(tokens_per_sec * flops_per_token / peak, rel=0.01, abs=1e-3), text
        assert figure(r"([\d.]+)() s/step", text) == pytest.approx(wall / steps, abs=0.005 + RELATIVE * wall / steps)
        assert eta_seconds(text) == pytest.approx(wall / steps * (STEPS - 1 - step), abs=1), text
        assert f"of {metrics._si(peak)}FLOP/s" in text

    records = [json.loads(line) for line in open(cfg.metrics_file)]
    assert records[0]["peak_flops_per_device"] == peak  # the run's MFU denominator, on record
    assert all("peak_flops_per_device" not in r for r in records[1:])
    for r in records[1:]:  # the first step's time includes compilation
        device = PACE[r["step"] % LOG_PERIOD][1]
        assert r["step_time"] >= device / 2 and r["mfu"] <= 1, r  # / 2: calibrated on a machine under load
    # The steps' times add up to the wall time between the first line and the last.
    run_time = lines[-1][1] - lines[0][1]
    assert sum(r["step_time"] for r in records[1:]) == pytest.approx(run_time, rel=RELATIVE, abs=ABSOLUTE)


def test_a_measured_peak_is_named_in_the_log_and_recorded(tmp_path, monkeypatch, caplog):
    caplog.set_level("INFO", logger="unitrain")
    monkeypatch.setattr(metrics, "measure_matmul_peak", lambda dtype, n: 1e12)
    cfg = config(tmp_path, "steps=1", "peak_flops_per_device=null")
    assert train.train(cfg) == 0
    assert "jnp.dot reached on one device just now" in caplog.text and "1e+12 FLOP/s" in caplog.text
    assert json.loads(open(cfg.metrics_file).readline())["peak_flops_per_device"] == 1e12
