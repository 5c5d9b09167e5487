"""The dispatcher's measured choice (hal.dispatch.measure) with kernels of known cost: a test plugin
whose kernels sleep for a set time, so which one is fastest is known on any machine."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import hal
from hal import dispatch
from hal.dispatch import measure
from hal.plugin import Plugin

RAN: list[str] = []


def sleeping_softmax(tag: str, seconds: float):
    def softmax(x, dim):
        RAN.append(tag)
        time.sleep(seconds)
        return torch.softmax(x, dim)

    return softmax


def plugin(costs: dict[str, float], name: str = "timed", version: str = "1.0") -> Plugin:
    """A CPU backend whose softmax kernels (highest priority first, in ``costs``' order) sleep for
    their cost."""
    p = Plugin(name, version)
    p.define_backend(priority=1000, device_types=("cpu",))
    for rank, (kernel, seconds) in enumerate(costs.items()):
        p.kernel("softmax", name=kernel, priority=100 - rank)(sleeping_softmax(kernel, seconds))
    return p


@pytest.fixture
def tuning(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Measured choice on, into a cache of this test's own."""
    monkeypatch.setenv("HAL_TUNE", "on")
    monkeypatch.setenv("HAL_TUNE_CACHE", str(tmp_path / "tune"))
    dispatch.reset()
    RAN.clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: intra-op threads only add noise (on a loaded machine, milliseconds)
    yield tmp_path / "tune"
    torch.set_num_threads(threads)
    dispatch.reset()


def test_the_fastest_kernel_wins_and_explain_shows_the_times(tuning, install_plugins):
    install_plugins([plugin({"slow": 0.004, "fast": 0.0})])
    x = torch.randn(4, 8)
    torch.testing.assert_close(hal.ops.softmax(x, 1), torch.softmax(x, 1))
    assert RAN[-1] == "fast"
    RAN.clear()
    hal.ops.softmax(x, 1)
    assert RAN == ["fast"], "a decided call runs the winner alone"
    d = hal.explain("softmax", x, 1)
    assert d.kernel == "fast" and d.measurement is not None
    assert d.measurement.context == "eager" and d.measurement.source == "cache"
    times = dict(d.measurement.times_us)
    assert times["timed/slow"] >= 4000 > times["timed/fast"]
    assert {c.kernel: c.time_us for c in d.candidates}["slow"] == times["timed/slow"]
    text = str(d)
    assert "by measured time" in text and "timed/slow" in text and "-> timed/fast" in text
    assert hal.stats()[("softmax", "timed", "fast")]["calls"] == 2, "the timed runs count nothing"
    assert ("softmax", "timed", "slow") not in hal.stats()


def test_equal_kernels_keep_the_priority_choice(tuning, install_plugins):
    install_plugins([plugin({"first": 0.001, "second": 0.001})])
    hal.ops.softmax(torch.randn(4, 8), 1)
    d = hal.explain("softmax", torch.randn(4, 8), 1)
    assert d.kernel == "first", f"within {measure.MARGIN:.0%} the priority choice stays: {d.measurement}"


@pytest.mark.parametrize("mode", ["off", "cached"])
def test_off_and_cached_rank_by_priority_without_measuring(tuning, install_plugins, monkeypatch, mode):
    monkeypatch.setenv("HAL_TUNE", mode)
    dispatch.reset()
    install_plugins([plugin({"slow": 0.002, "fast": 0.0})])
    before = len(measure.LOG)
    hal.ops.softmax(torch.randn(4, 8), 1)
    assert RAN == ["slow"] and len(measure.LOG) == before
    d = hal.explain("softmax", torch.randn(4, 8), 1)
    assert d.measurement is None and (mode == "off" or "HAL_TUNE=cached" in d.tuning)


def test_cached_mode_takes_what_was_measured(tuning, install_plugins, monkeypatch):
    install_plugins([plugin({"slow": 0.002, "fast": 0.0})])
    hal.ops.softmax(torch.randn(4, 8), 1)  # measures
    monkeypatch.setenv("HAL_TUNE", "cached")
    dispatch.reset()  # the tune cache is read again from disk
    RAN.clear()
    before = len(measure.LOG)
    hal.ops.softmax(torch.randn(4, 8), 1)
    assert RAN == ["fast"] and len(measure.LOG) == before


def test_bad_hal_tune_is_an_error(tuning, install_plugins, monkeypatch):
    install_plugins([plugin({"a": 0.0, "b": 0.0})])
    monkeypatch.setenv("HAL_TUNE", "sometimes")
    dispatch.reset()
    with pytest.raises(hal.InvalidArgumentError, match="HAL_TUNE"):
        hal.ops.softmax(torch.randn(4, 8), 1)


def test_a_shape_bucket_is_measured_once(tuning, install_plugins):
    install_plugins([plugin({"slow": 0.002, "fast": 0.0})])
    before = len(measure.LOG)
    hal.ops.softmax(torch.randn(40, 100), 1)
    hal.ops.softmax(torch.randn(40, 120), 1)  # 100 and 120 share the bucket 128
    hal.ops.softmax(torch.randn(40, 300), 1)  # 512: a new bucket
    assert len(measure.LOG) - before == 2


def test_nothing_is_measured_while_torch_compile_traces(tuning, install_plugins):
    """Kernels made of torch's ops are chosen while AOTAutograd traces, on fake tensors: there the
    priority decides (nothing cached yet) and nothing is measured; the next eager call measures."""
    p = Plugin("traced", "1.0")
    p.define_backend(priority=1000, device_types=("cpu",))
    p.kernel("softmax", name="slow", priority=10, differentiable=True)(sleeping_softmax("slow", 0.002))
    p.kernel("softmax", name="fast", priority=1, differentiable=True)(sleeping_softmax("fast", 0.0))
    install_plugins([p])
    before = len(measure.LOG)
    fn = torch.compile(lambda x: hal.ops.softmax(x, 1) * 2, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 8)
    torch.testing.assert_close(fn(x), torch.softmax(x, 1) * 2)
    assert RAN and set(RAN) == {"slow"}, "traced by priority: the kernel's ops are the graph's (its Python ran only while tracing)"
    assert len(measure.LOG) == before, "nothing measured while tracing"
    hal.ops.softmax(x, 1)
    assert len(measure.LOG) == before + 1 and RAN[-1] == "fast"
    torch._dynamo.reset()


def test_measuring_leaves_the_callers_arrays_alone(tuning, install_plugins):
    """An in-place op is timed on copies: the caller's tensors are scaled once, by the call."""
    p = Plugin("inplace", "1.0")
    p.define_backend(priority=1000, device_types=("cpu",))

    def unscale(tag, seconds):
        def amp_unscale_(tensors, inv_scale):
            RAN.append(tag)
            time.sleep(seconds)
            found = torch.zeros((), dtype=torch.float32)
            for t in tensors:
                t.mul_(inv_scale)
                found = torch.maximum(found, (~torch.isfinite(t)).any().float())
            return found

        return amp_unscale_

    p.kernel("amp_unscale_", name="slow", priority=10)(unscale("slow", 0.002))
    p.kernel("amp_unscale_", name="fast", priority=1)(unscale("fast", 0.0))
    install_plugins([p])
    tensors = [torch.randn(5), torch.randn(3)]
    expected = [t * 0.5 for t in tensors]
    hal.ops.amp_unscale_(tensors, torch.tensor(0.5))
    assert RAN.count("slow") > 1 and RAN[-1] == "fast"
    for got, want in zip(tensors, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_training_calls_are_timed_forward_and_backward(tuning, install_plugins):
    """A kernel whose backward op is slow loses to one torch's autograd records, although its
    forward is faster: the /train context times the pair."""
    p = Plugin("train", "1.0")
    p.define_backend(priority=1000, device_types=("cpu",))
    p.kernel("softmax", name="fused", priority=10)(sleeping_softmax("fused", 0.0))
    p.kernel("softmax", name="recorded", priority=5, differentiable=True)(sleeping_softmax("recorded", 0.001))

    def slow_backward(grad_out, out, dim):
        time.sleep(0.006)
        return out * (grad_out - (grad_out * out).sum(dim, keepdim=True))

    p.kernel("softmax_backward", name="slow")(slow_backward)
    install_plugins([p])
    x = torch.randn(4, 8, requires_grad=True)
    y = hal.ops.softmax(x, 1)
    d = hal.explain("softmax", x, 1)
    assert d.measurement.context == "eager/train"
    assert d.kernel == "recorded" and d.autograd_by == "torch", str(d)
    g = torch.randn_like(y)
    y.backward(g)
    ref = x.detach().requires_grad_(True)
    torch.softmax(ref, 1).backward(g)
    torch.testing.assert_close(x.grad, ref.grad)
    assert hal.stats()[("softmax", "train", "recorded")]["calls"] == 1
    assert ("softmax_backward", "train", "slow") not in hal.stats(), "torch's autograd ran the backward; timed runs count nothing"


def test_a_failing_alternative_is_never_chosen(tuning, install_plugins, caplog):
    p = plugin({"slow": 0.002})

    def broken(x, dim):
        raise RuntimeError("broken kernel")

    p.kernel("softmax", name="broken", priority=1)(broken)
    install_plugins([p])
    with caplog.at_level(logging.INFO, logger="hal"):
        hal.ops.softmax(torch.randn(4, 8), 1)
    d = hal.explain("softmax", torch.randn(4, 8), 1)
    assert d.kernel == "slow" and dict(d.measurement.times_us)["timed/broken"] == float("inf")
    assert "raised" in str(d)


def test_hal_tune_measures_a_step_once(tuning, install_plugins):
    install_plugins([plugin({"slow": 0.002, "fast": 0.0})])

    def step(x):
        return hal.ops.softmax(x, 1).sum() + hal.ops.softmax(x.T.contiguous(), 1).sum()

    report = hal.tune(step, torch.randn(16, 48))
    assert len(report.measurements) == 2 and report.measuring_seconds > 0
    assert all(m.winner == "timed/fast" for m in report.measurements)
    assert "2 calls measured" in str(report)
    again = hal.tune(step, torch.randn(16, 48))
    assert again.measurements == []


def test_the_cache_survives_a_restart_and_a_version_change_measures_again(tuning, tmp_path):
    """Two real processes with the same plugin: the second measures nothing; a new plugin version
    (another runtime signature) measures again."""
    script = tmp_path / "measure_once.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys, time, torch, hal
        torch.set_num_threads(1)
        from hal import dispatch
        from hal.dispatch import measure
        from hal.plugin import Plugin
        from hal.runtime import Runtime
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_measured_choice import plugin
        dispatch.install(Runtime.from_plugins([plugin({{"slow": 0.002, "fast": 0.0}}, version=sys.argv[1])]))
        hal.ops.softmax(torch.randn(4, 8), 1)
        print(json.dumps({{"measured": len(measure.LOG), "kernel": hal.explain("softmax", torch.randn(4, 8), 1).kernel}}))
    """))

    def run(version: str) -> dict:
        out = subprocess.run([sys.executable, str(script), version], capture_output=True, text=True, timeout=300, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert run("1.0") == {"measured": 1, "kernel": "fast"}
    assert run("1.0") == {"measured": 0, "kernel": "fast"}, "the second process reads the first one's measurement"
    assert run("2.0") == {"measured": 1, "kernel": "fast"}, "another plugin version is another cache"


def test_an_unreadable_cache_is_ignored_with_a_warning(tuning, install_plugins, caplog):
    install_plugins([plugin({"slow": 0.002, "fast": 0.0})])
    hal.ops.softmax(torch.randn(4, 8), 1)
    files = list(tuning.glob("*.json"))
    assert len(files) == 1
    files[0].write_text("{ not json")
    dispatch.reset()
    RAN.clear()
    with caplog.at_level(logging.WARNING, logger="hal"):
        hal.ops.softmax(torch.randn(4, 8), 1)
    assert RAN[-1] == "fast" and "ignored" in caplog.text
    assert json.loads(files[0].read_text())["entries"], "measured again and written back"


@pytest.mark.parametrize("damage", [None, [3.0, 1.0], {"timed/fast": "quick"}], ids=["times_us null", "a list", "a string time"])
def test_a_cached_record_with_a_field_of_the_wrong_type_is_measured_again(tuning, install_plugins, caplog, damage):
    """Before: the call matching the record raised AttributeError (times_us null or a list) or
    ValueError (a time as a string) on every run. Now the record is dropped with a warning naming
    the file and the field, the call is measured again and the file rewritten with a good record."""
    install_plugins([plugin({"slow": 0.002, "fast": 0.0})])
    x = torch.randn(4, 8)
    hal.ops.softmax(x, 1)
    [path] = tuning.glob("*.json")
    document = json.loads(path.read_text())
    [key] = document["entries"]
    document["entries"][key]["times_us"] = damage
    path.write_text(json.dumps(document))
    dispatch.reset()
    RAN.clear()
    with caplog.at_level(logging.WARNING, logger="hal"):
        torch.testing.assert_close(hal.ops.softmax(x, 1), torch.softmax(x, 1))
    assert RAN[-1] == "fast" and len(RAN) > 1, "measured again"
    assert str(path) in caplog.text and f"record {key!r}: field 'times_us' must be" in caplog.text
    assert json.loads(path.read_text())["entries"][key]["times_us"]["timed/fast"] >= 0


def test_hal_tune_command_end_to_end(tuning, tmp_path):
    """``hal tune module:callable`` in a real process: measures, exports a seed file, and a second
    run finds everything cached."""
    module = tmp_path / "tuned_step.py"
    module.write_text(textwrap.dedent(f"""
        import sys, torch, hal
        torch.set_num_threads(1)
        from hal import dispatch
        from hal.runtime import Runtime
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_measured_choice import plugin

        def make():
            dispatch.install(Runtime.from_plugins([plugin({{"slow": 0.002, "fast": 0.0}})]))
            return (lambda x: hal.ops.softmax(x, 1)), (torch.randn(8, 32),)
    """))
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    cmd = [sys.executable, "-m", "hal", "tune", "tuned_step:make", "--export", str(tmp_path / "seeds"), "--json"]
    first = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True, env=env).stdout)
    assert first["rows"][0]["calls_measured"] == 1
    assert first["rows"][0]["measurements"][0]["winner"] == "timed/fast"
    seeds = list((tmp_path / "seeds").glob("*.json"))
    assert len(seeds) == 1 and json.loads(seeds[0].read_text())["entries"]
    second = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True, env=env).stdout)
    assert second["rows"][0]["calls_measured"] == 0


def test_a_plugins_seeds_answer_before_any_measurement(tuning, install_plugins, tmp_path):
    """Measurements exported on one machine (TuneCache.export) and shipped by a plugin decide on
    another process of the same device model, without measuring."""
    install_plugins([plugin({"slow": 0.002, "fast": 0.0})])
    hal.ops.softmax(torch.randn(4, 8), 1)  # measured here: fast
    slug = measure.device_slug(torch.device("cpu"))
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    measure.cache_for(torch.device("cpu"), dispatch.DISPATCHER.runtime()).export(seeds / f"{slug}.json")
    record = json.loads((seeds / f"{slug}.json").read_text())
    for entry in record["entries"].values():  # as if the other machine had found "slow" faster
        entry["winner"] = "timed/slow"
    (seeds / f"{slug}.json").write_text(json.dumps(record))
    shipped = plugin({"slow": 0.002, "fast": 0.0})
    shipped.backend.tuning_seeds = seeds
    for f in tuning.glob("*.json"):
        f.unlink()  # this machine's own measurements gone: only the seed is left
    install_plugins([shipped])
    before = len(measure.LOG)
    RAN.clear()
    hal.ops.softmax(torch.randn(4, 8), 1)
    assert RAN == ["slow"] and len(measure.LOG) == before
    d = hal.explain("softmax", torch.randn(4, 8), 1)
    assert d.measurement.source == "seed" and "seeded" in str(d)


def test_measuring_leaves_torchs_random_stream_where_it_was(tuning, install_plugins):
    """A first call that measures its kernels (drawing gradients, running them again) must not move
    torch's global generator: the next draw is the one a run without measuring makes, so dropout
    masks do not depend on whether a shape was measured yet (activation checkpointing replays them)."""
    p = Plugin("rng", "1.0")
    p.define_backend(priority=1000, device_types=("cpu",))
    p.kernel("softmax", name="a", priority=10)(sleeping_softmax("a", 0.0))
    p.kernel("softmax", name="b", priority=5)(sleeping_softmax("b", 0.0005))
    p.kernel("softmax_backward", name="plain")(lambda grad_out, out, dim: out * (grad_out - (grad_out * out).sum(dim, keepdim=True)))
    install_plugins([p])
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1234)
    expected = torch.rand(5)
    torch.manual_seed(1234)
    hal.ops.softmax(x, 1).sum().backward()
    assert hal.explain("softmax", x, 1).measurement is not None, "the call was meant to be measured"
    torch.testing.assert_close(torch.rand(5), expected, rtol=0, atol=0)


def test_numpy_and_torch_callers_keep_their_own_measurements(tuning, install_plugins, monkeypatch):
    """A kernel may serve NumPy callers only (hal.plugin.Inputs.numpy_caller), and a NumPy call's
    times include the conversions: a torch caller's measurement of the same shape must neither
    answer a NumPy call nor replace its record (it did, under one key for both)."""
    import numpy as np

    p = plugin({"slow": 0.004, "fast": 0.001})  # fast costs something: a NumPy call's numpy_only (free) wins it under load too
    p.kernel("softmax", name="numpy_only", priority=200,
             check=lambda inputs: [] if inputs.numpy_caller else ["torch tensors: not this kernel's"])(sleeping_softmax("numpy_only", 0.0))
    install_plugins([p])
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    hal.ops.softmax(x, 1)
    hal.ops.softmax(torch.from_numpy(x), 1)  # measures slow against fast for torch callers
    monkeypatch.setenv("HAL_TUNE", "cached")
    dispatch.reset()  # the tune cache is read again from disk
    RAN.clear()
    hal.ops.softmax(x, 1)
    hal.ops.softmax(torch.from_numpy(x), 1)
    assert RAN == ["numpy_only", "fast"]
    keys = [m.key for m in measure.LOG[-2:]]
    assert keys[0].split("|")[:3] == ["softmax", "eager", "numpy"] and "numpy" not in keys[1].split("|"), keys
