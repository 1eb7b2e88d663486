"""The Triton launch-configuration tuner: choice, persistent cache, other processes, failures, and the numerics of
every candidate configuration of every tuned kernel.

Timing is replaced by fake timers (``autotune.timer``), so the choice is known in advance and the tests never time
anything; candidates still launch for real (on CUDA, or on the CPU under Triton's interpreter).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

from torchport.backends import get_backend
from torchport.kernels.glu import geglu_reference, swiglu_reference
from torchport.kernels.layer_norm import layer_norm_reference
from torchport.kernels.rms_norm import rms_norm_reference
from torchport.kernels.rope import rope_reference
from torchport.kernels.triton import autotune, cross_entropy, cross_entropy_tuning, glu, next_power_of_2, norm, rope

from kernel_cases import call, check_close, gradients, leaf

CPU = torch.device("cpu")
_names = itertools.count()


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """A fresh cache directory, no fake timer, tuning on, and no choice remembered from another test."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("TORCHPORT_CACHE_DIR", str(directory))
    monkeypatch.setattr(autotune, "timer", None)
    previous = autotune.set_enabled(True)
    autotune.clear_cache(files=False)
    yield directory
    autotune.set_enabled(previous)
    autotune.clear_cache(files=False)


@pytest.fixture
def triton_device() -> torch.device:
    """Where the real kernels run here: CUDA, else the CPU under Triton's interpreter."""
    if get_backend("cuda").is_available():
        return torch.device("cuda")
    if autotune._interpreted():
        return CPU
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")


def _tunable(configs, name=None):
    """A kernel whose bucket is its size rounded up to a power of two."""
    return autotune.Tunable(name or f"test.kernel{next(_names)}", ("n",), lambda n: (next_power_of_2(n),),
                            lambda n: [dict(c) for c in configs])


def _timer(times, calls=None):
    """A fake timer: milliseconds by the config's ``x``; records what it timed."""
    def time_one(run, config, device):
        if calls is not None:
            calls.append(dict(config))
        run()
        return times[config["x"]]
    return time_one


CONFIGS = [{"x": 0}, {"x": 1}, {"x": 2}]  # the first is the heuristic


def test_coarse_buckets():
    assert [autotune.coarse(m, 256, 65536) for m in (0, 1, 256, 257, 1024, 1025, 8192, 65536, 10**7)] == [
        256, 256, 256, 1024, 1024, 4096, 16384, 65536, 65536]


def test_fastest_candidate_is_chosen_and_written(cache_dir, monkeypatch):
    calls, launched = [], []
    monkeypatch.setattr(autotune, "timer", _timer({0: 3.0, 1: 1.0, 2: 2.0}, calls))
    tunable = _tunable(CONFIGS)
    assert tunable.lookup(CPU, torch.float32, 60) is None
    chosen = tunable.tune(CPU, torch.float32, (60,), launched.append)
    assert chosen == {"x": 1}
    assert calls == CONFIGS and launched == [c for c in CONFIGS for _ in (1, 2)]  # a launch, then the timer's run
    assert tunable.lookup(CPU, torch.float32, 60) is chosen  # the hot path: the same dict, no second tuning
    assert tunable.lookup(CPU, torch.float32, 50) is None  # the exact-size memo has not seen 50 yet...
    assert tunable.tune(CPU, torch.float32, (50,), launched.append) is chosen  # ...but its bucket, 64, is tuned
    assert calls == CONFIGS and tunable.lookup(CPU, torch.float32, 50) is chosen
    path = autotune.cache_path(CPU)
    assert os.path.dirname(path) == str(cache_dir / "autotune")
    data = json.loads(open(path).read())
    assert data["format"] == autotune.FORMAT and data["torchport"] and data["triton"]
    entry = data["entries"][f"{tunable.name} float32 n=64"]
    assert entry["config"] == {"x": 1} and entry["ms"] == 1.0
    assert [t["ms"] for t in entry["timings"]] == [3.0, 1.0, 2.0] and entry["failed"] == []
    [shown] = autotune.entries()
    assert shown["key"] == f"{tunable.name} float32 n=64" and shown["config"] == {"x": 1} and shown["file"] == path
    # another bucket, another dtype: tuned apart
    assert tunable.tune(CPU, torch.bfloat16, (64,), launched.append) == {"x": 1}
    assert tunable.tune(CPU, torch.float32, (65,), launched.append) == {"x": 1}
    assert [e["key"] for e in autotune.entries()] == [f"{tunable.name} bfloat16 n=64", f"{tunable.name} float32 n=128",
                                                      f"{tunable.name} float32 n=64"]


def test_per_device_candidates_see_the_device(monkeypatch):
    """A tunable made with ``per_device=True`` lists its candidates for the launch's device (its heuristic too, used
    untimed with tuning off); the others are called with the bucket alone."""
    seen = []

    def listed(n, device=None):
        seen.append((n, device))
        return [{"x": 1 if device is not None and device.type == "meta" else 0}, {"x": 2}]

    tunable = autotune.Tunable(f"test.kernel{next(_names)}", ("n",), lambda n: (next_power_of_2(n),), listed,
                               per_device=True)
    autotune.set_enabled(False)
    assert tunable.tune(torch.device("meta"), torch.float32, (60,), lambda c: None) == {"x": 1}
    assert tunable.tune(CPU, torch.float32, (60,), lambda c: None) == {"x": 0}
    assert seen == [(64, torch.device("meta")), (64, CPU)]
    plain = autotune.Tunable(f"test.kernel{next(_names)}", ("n",), lambda n: (next_power_of_2(n),),
                             lambda n: [{"x": n}])
    assert plain.tune(CPU, torch.float32, (60,), lambda c: None) == {"x": 64}


def test_heuristic_is_kept_within_timing_noise(monkeypatch):
    monkeypatch.setattr(autotune, "timer", _timer({0: 1.0, 1: 0.99, 2: 1.2}))
    assert _tunable(CONFIGS).tune(CPU, torch.float32, (8,), lambda c: None) == {"x": 0}
    [entry] = autotune.entries()
    assert entry["config"] == {"x": 0} and entry["ms"] == 1.0 and len(entry["timings"]) == 3


def test_failing_candidates_are_skipped_and_remembered(monkeypatch):
    monkeypatch.setattr(autotune, "timer", _timer({0: 3.0, 1: 1.0, 2: 2.0}))
    tunable = _tunable(CONFIGS)

    def launch(config):
        if config["x"] == 1:  # the fastest by the timer, but it does not run on this device
            raise RuntimeError("out of resource: shared memory, Required: 262144, Hardware limit: 232448")

    assert tunable.tune(CPU, torch.float32, (8,), launch) == {"x": 2}
    [entry] = autotune.entries()
    assert entry["failed"] == [{"config": {"x": 1}, "error": "RuntimeError: out of resource: shared memory, "
                                                             "Required: 262144, Hardware limit: 232448"}]
    assert [t["config"] for t in entry["timings"]] == [{"x": 0}, {"x": 2}]

    def broken_timer(run, config, device):
        return float("nan") if config["x"] == 2 else 5.0

    monkeypatch.setattr(autotune, "timer", broken_timer)
    assert tunable.tune(CPU, torch.float32, (16,), launch) == {"x": 0}


def test_every_candidate_failing_gives_the_heuristic_and_writes_nothing(cache_dir, monkeypatch):
    monkeypatch.setattr(autotune, "timer", _timer({0: 1.0, 1: 1.0, 2: 1.0}))

    def launch(config):
        raise ValueError("no such kernel")

    assert _tunable(CONFIGS).tune(CPU, torch.float32, (8,), launch) == {"x": 0}
    assert autotune.entries() == []


def test_out_of_memory_stops_tuning_without_writing(monkeypatch):
    monkeypatch.setattr(autotune, "timer", _timer({0: 2.0, 1: 1.0, 2: 2.0}))

    def launch(config):
        if config["x"] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory")

    assert _tunable(CONFIGS).tune(CPU, torch.float32, (8,), launch) == {"x": 0}
    assert autotune.entries() == []


def test_without_a_timer_or_events_the_heuristic_is_used_untimed(cache_dir):
    """The CPU has no device events (and Triton runs there only interpreted): nothing is timed or written."""
    launched = []
    tunable = _tunable(CONFIGS)
    assert tunable.tune(CPU, torch.float32, (8,), launched.append) == {"x": 0}
    assert launched == [] and not cache_dir.exists()
    assert tunable.lookup(CPU, torch.float32, 8) == {"x": 0}


class _ClockEvent:
    """An event of a device whose work runs on the host as it is queued: it records the host clock."""

    def record(self) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: _ClockEvent) -> float:
        return (end.at - self.at) * 1e3


class _ClockBackend:
    def event(self, enable_timing: bool = False) -> _ClockEvent:
        return _ClockEvent()

    def synchronize(self, index: int) -> None:
        pass

    def current_index(self) -> int:
        return 0


def test_device_timer_counts_each_run_without_the_l2_write(monkeypatch):
    """The default timer times each run between its own two events, after the write that clears L2: a run of 2 ms
    measures 2 ms although each write before it takes longer; the writes queued ahead stay within their limit."""
    monkeypatch.setattr(autotune, "get_backend", lambda device_type: _ClockBackend())
    monkeypatch.setattr(autotune, "_CLEAR_BYTES", 128 * 2**20)  # a 128 MB write: about 5 ms on a CPU
    calls = []

    def run() -> None:
        calls.append(None)
        time.sleep(0.002)

    ms = autotune._do_bench(run, {"x": 0}, CPU)
    assert 1.9 <= ms < 3.5, ms
    assert 3 + 5 + 1 < len(calls) < 1000  # the first run, the estimate, the warm-up, at least three timed runs


def test_interpreter_launches_real_kernels_with_the_heuristic(cache_dir, triton_device):
    if triton_device.type != "cpu":
        pytest.skip("Triton's interpreter runs on the CPU")
    x = torch.randn(5, 40)
    y = call("rms_norm", "triton", x, torch.ones(40), 1e-6, 0.0, False)
    check_close("y", y, rms_norm_reference(x.double(), torch.ones(40, dtype=torch.float64), 1e-6), torch.float32)
    tunable = norm._FORWARD[True, True]
    assert tunable.lookup(CPU, torch.float32, 5, 40) == tunable.candidates(64, 256)[0]
    assert not cache_dir.exists()


def test_disabled_uses_the_heuristic_without_reading_the_cache(monkeypatch):
    monkeypatch.setattr(autotune, "timer", _timer({0: 3.0, 1: 1.0, 2: 2.0}))
    tunable = _tunable(CONFIGS)
    assert tunable.tune(CPU, torch.float32, (8,), lambda c: None) == {"x": 1}
    assert autotune.set_enabled(False) is True
    assert tunable.lookup(CPU, torch.float32, 8) is None  # choices are forgotten on a switch
    assert tunable.tune(CPU, torch.float32, (8,), lambda c: None) == {"x": 0}
    autotune.set_enabled(True)
    assert tunable.tune(CPU, torch.float32, (8,), lambda c: None) == {"x": 1}  # from the file again


def test_tracing_uses_the_heuristic_and_chooses_later(monkeypatch):
    calls = []
    monkeypatch.setattr(autotune, "timer", _timer({0: 3.0, 1: 1.0, 2: 2.0}, calls))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    tunable = _tunable(CONFIGS)
    assert tunable.tune(CPU, torch.float32, (8,), lambda c: None) == {"x": 0}
    assert calls == [] and tunable.lookup(CPU, torch.float32, 8) is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert tunable.tune(CPU, torch.float32, (8,), lambda c: None) == {"x": 1}


def test_stale_entry_is_tuned_again(monkeypatch):
    monkeypatch.setattr(autotune, "timer", _timer({0: 3.0, 1: 1.0, 2: 2.0, 7: 0.1}))
    name = f"test.kernel{next(_names)}"
    old = _tunable([{"x": 7}, {"x": 0}], name=name)
    assert old.tune(CPU, torch.float32, (8,), lambda c: None) == {"x": 7}
    autotune._tunables.pop(name)  # the same kernel with other candidates, as after an upgrade in place
    new = _tunable(CONFIGS, name=name)
    assert new.tune(CPU, torch.float32, (8,), lambda c: None) == {"x": 1}
    assert [e["config"] for e in autotune.entries()] == [{"x": 1}]


def test_entry_chosen_among_other_candidates_is_tuned_again(monkeypatch):
    """A cached choice that is still a candidate is timed once more when the candidates it was chosen among changed
    (a release added one); the same candidates in another order, or a hand-written entry without timings, keep it."""
    calls = []
    monkeypatch.setattr(autotune, "timer", _timer({0: 3.0, 1: 1.0, 2: 2.0, 3: 0.5}, calls))
    name = f"test.kernel{next(_names)}"
    old = _tunable(CONFIGS, name=name)
    assert old.tune(CPU, torch.float32, (8,), lambda c: None) == {"x": 1} and len(calls) == 3
    for configs, timed, chosen in ((CONFIGS[::-1], 0, {"x": 1}), (CONFIGS + [{"x": 3}], 4, {"x": 3})):
        autotune._tunables.pop(name)
        autotune.clear_cache(files=False)
        calls.clear()
        assert _tunable(configs, name=name).tune(CPU, torch.float32, (8,), lambda c: None) == chosen
        assert len(calls) == timed
    path = autotune.cache_path(CPU)
    data = json.loads(open(path).read())
    [key] = data["entries"]
    data["entries"][key] = {"config": {"x": 2}, "ms": 0.5}  # no record of what it was chosen among
    with open(path, "w") as f:
        json.dump(data, f)
    autotune._tunables.pop(name)
    autotune.clear_cache(files=False)
    calls.clear()
    assert _tunable(CONFIGS, name=name).tune(CPU, torch.float32, (8,), lambda c: None) == {"x": 2} and calls == []


def test_duplicate_tunable_name_is_refused():
    tunable = _tunable(CONFIGS)
    with pytest.raises(ValueError, match=f"{tunable.name}.*already exists"):
        autotune.Tunable(tunable.name, ("n",), lambda n: (n,), lambda n: CONFIGS)
    assert tunable.name in autotune.list_tunables() and "rms_norm.forward" in autotune.list_tunables()


@pytest.mark.parametrize("damage", ["{not json", '{"format": 999, "entries": {}}', "[]"])
def test_corrupt_cache_file_warns_once_and_is_ignored(damage, monkeypatch):
    monkeypatch.setattr(autotune, "timer", _timer({0: 3.0, 1: 1.0, 2: 2.0}))
    path = autotune.cache_path(CPU)
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write(damage)
    tunable = _tunable(CONFIGS)
    with pytest.warns(RuntimeWarning, match="autotune cache .* ignoring it"):
        assert tunable.tune(CPU, torch.float32, (8,), lambda c: None) == {"x": 1}
    assert [e["config"] for e in autotune.entries()] == [{"x": 1}]  # rewritten whole
    with open(path, "w") as f:
        f.write(damage)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same cause is not reported twice
        assert tunable.tune(CPU, torch.float32, (16,), lambda c: None) == {"x": 1}


def test_unwritable_cache_dir_warns_and_keeps_the_choice_in_memory(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TORCHPORT_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(autotune, "timer", _timer({0: 3.0, 1: 1.0, 2: 2.0}))
    tunable = _tunable(CONFIGS)
    with pytest.warns(RuntimeWarning, match="cannot be written") as record:
        assert tunable.tune(CPU, torch.float32, (8,), lambda c: None) == {"x": 1}
    assert len(record) == 1
    assert tunable.lookup(CPU, torch.float32, 8) == {"x": 1}


def test_write_merges_with_what_another_process_wrote(monkeypatch):
    monkeypatch.setattr(autotune, "timer", _timer({0: 3.0, 1: 1.0, 2: 2.0}))
    tunable = _tunable(CONFIGS)
    tunable.tune(CPU, torch.float32, (8,), lambda c: None)
    path = autotune.cache_path(CPU)
    data = json.loads(open(path).read())
    data["entries"]["other.kernel float32 n=1"] = {"config": {"x": 2}, "ms": 0.5}  # another process, meanwhile
    with open(path, "w") as f:
        json.dump(data, f)
    tunable.tune(CPU, torch.float32, (16,), lambda c: None)
    keys = {e["key"] for e in autotune.entries()}
    assert keys == {f"{tunable.name} float32 n=8", f"{tunable.name} float32 n=16", "other.kernel float32 n=1"}


def test_clear_cache_deletes_files_and_forgets(monkeypatch):
    monkeypatch.setattr(autotune, "timer", _timer({0: 3.0, 1: 1.0, 2: 2.0}))
    tunable = _tunable(CONFIGS)
    tunable.tune(CPU, torch.float32, (8,), lambda c: None)
    assert autotune.clear_cache() == 1
    assert autotune.entries() == [] and tunable.lookup(CPU, torch.float32, 8) is None
    assert autotune.clear_cache() == 0


def test_tuning_is_logged(monkeypatch, caplog):
    monkeypatch.setenv("TORCHPORT_LOG", "kernels")
    monkeypatch.setattr(autotune, "timer", _timer({0: 3.0, 1: 1.0, 2: 2.0}))
    tunable = _tunable(CONFIGS)
    with caplog.at_level("INFO", logger="torchport.kernels"):
        tunable.tune(CPU, torch.float32, (8,), lambda c: None)
        autotune.clear_cache(files=False)
        tunable.tune(CPU, torch.float32, (8,), lambda c: None)
    tuned, cached = [r.getMessage() for r in caplog.records if r.name == "torchport.kernels"]
    assert f"autotune {tunable.name} float32 n=8: timed 3 candidates" in tuned
    assert "chose {'x': 1}, 1.0000 ms (heuristic {'x': 0}, 3.0000 ms)" in tuned
    assert cached.startswith(f"autotune {tunable.name} float32 n=8: {{'x': 1}} from ")


_CONCURRENT = textwrap.dedent("""
    import sys, time, torch
    from torchport.kernels.triton import autotune
    name, index = sys.argv[1], int(sys.argv[2])
    def slow_timer(run, config, device):
        time.sleep(0.05)  # long enough for the processes to overlap
        return {0: 3.0, 1: 1.0, 2: 2.0}[config["x"]]
    autotune.timer = slow_timer
    tunable = autotune.Tunable(name, ("n",), lambda n: (n,), lambda n: [{"x": 0}, {"x": 1}, {"x": 2}])
    assert tunable.tune(torch.device("cpu"), torch.float32, (index,), lambda c: None) == {"x": 1}
""")


def test_concurrent_processes_merge_their_entries():
    name = f"test.concurrent{next(_names)}"
    children = [subprocess.Popen([sys.executable, "-c", _CONCURRENT, name, str(i)], stderr=subprocess.PIPE, text=True)
                for i in range(3)]
    for child in children:
        _, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
    assert sorted(e["key"] for e in autotune.entries()) == [f"{name} float32 n={i}" for i in range(3)]


_SECOND_PROCESS = textwrap.dedent("""
    import json, sys, torch
    import torchport
    from torchport.kernels import registry
    from torchport.kernels.triton import autotune, norm
    timed = []
    autotune.timer = lambda run, config, device: timed.append(config) or 1.0
    device = torch.device(sys.argv[1])
    x = torch.randn(50, 300, device=device)
    with torchport.settings.override(kernels="triton"):
        registry.implementation("rms_norm", "triton").fn(x, torch.ones(300, device=device), 1e-6, 0.0, False)
    print(json.dumps({"timed": timed, "config": norm._FORWARD[True, True].lookup(x.device, x.dtype, 50, 300)}))
""")


def _prefer(target):
    """A fake timer under which ``target`` is the fastest config (None: the last one timed)."""
    count = itertools.count()

    def time_one(run, config, device):
        run()
        return 0.5 if config == target else 10.0 - next(count) * (target is None)
    return time_one


def test_second_process_reads_the_cache_and_does_not_tune(triton_device, monkeypatch):
    tunable = norm._FORWARD[True, True]
    target = tunable.candidates(512, 256)[2]  # not the heuristic
    monkeypatch.setattr(autotune, "timer", _prefer(target))
    x = torch.randn(50, 300, device=triton_device)
    y = call("rms_norm", "triton", x, torch.ones(300, device=triton_device), 1e-6, 0.0, False)
    ref = rms_norm_reference(x.cpu().double(), torch.ones(300, dtype=torch.float64), 1e-6)
    check_close("y", y, ref, torch.float32)
    assert tunable.lookup(x.device, x.dtype, 50, 300) == target
    [entry] = autotune.entries()
    assert entry["key"] == "rms_norm.forward float32 block_n=512,rows=256"
    assert entry["config"] == target and entry["shape_bucket"] == {"block_n": 512, "rows": 256}
    child = subprocess.run([sys.executable, "-c", _SECOND_PROCESS, str(triton_device)], capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    seen = json.loads(child.stdout.strip().splitlines()[-1])
    assert seen == {"timed": [], "config": target}


@pytest.mark.parametrize("op", ["rms_norm", "swiglu"])
def test_in_place_backward_tunes_on_scratch_gradients(op, triton_device, monkeypatch):
    """In place, dx is written over dy (rms_norm), the gradients over gate and up (swiglu): tuning first launches
    every candidate, which must not touch the memory the final launch reads."""
    monkeypatch.setattr(autotune, "timer", _prefer(None))
    gen = torch.Generator().manual_seed(5)
    a, b, dy = (torch.randn(6, 70, generator=gen, dtype=torch.float64) for _ in range(3))
    if op == "rms_norm":
        b = b[0]
        fn, ref_fn = (lambda x, w: call("rms_norm", "triton", x, w, 1e-6, 0.0, True),
                      lambda x, w: rms_norm_reference(x, w, 1e-6))
    else:  # in place needs intermediates, as after a projection
        fn, ref_fn = (lambda g, u: call("swiglu", "triton", g * 1, u * 1, True)), swiglu_reference
    _, ref_grads = gradients(ref_fn, [leaf(a, CPU, a.dtype), leaf(b, CPU, b.dtype)], [dy])
    inputs = [leaf(a, triton_device, torch.float32), leaf(b, triton_device, torch.float32)]
    _, grads = gradients(fn, inputs, [dy.to(triton_device, torch.float32)])
    for i, (got, want) in enumerate(zip(grads, ref_grads)):
        check_close(f"grad {i}", got, want, torch.float32)
    assert {e["config"] != e["timings"][0]["config"] for e in autotune.entries()} == {True}  # not the heuristic
    assert len(autotune.entries()) == 2  # the forward and the backward were tuned


# -- every candidate of every tuned kernel computes the reference's result ---------------------------------------
def _each_candidate(monkeypatch, tunables, run):
    """Call ``run()`` once per candidate index, each tunable offering only its index-th candidate (its last when it
    has fewer), until every candidate of every bucket ``run`` meets has launched."""
    originals = {t.name: t.candidates for t in tunables}
    offered: dict[tuple[str, tuple[int, ...]], list[dict[str, int]]] = {}
    launched: set[tuple[str, tuple[int, ...], str]] = set()
    index = 0

    def only_one(tunable):
        def candidates(*bucket):
            configs = originals[tunable.name](*bucket)
            assert 1 <= len(configs) <= 6 and all(isinstance(v, int) for c in configs for v in c.values())
            offered[tunable.name, bucket] = configs
            chosen = configs[min(index, len(configs) - 1)]
            launched.add((tunable.name, bucket, json.dumps(chosen, sort_keys=True)))
            return [chosen]
        return candidates

    for tunable in tunables:
        monkeypatch.setattr(tunable, "candidates", only_one(tunable))
    while True:
        autotune.clear_cache(files=False)
        run()
        index += 1
        if index >= max(len(configs) for configs in offered.values()):
            break
    assert {name for name, _ in offered} == {t.name for t in tunables}
    assert launched == {(name, bucket, json.dumps(c, sort_keys=True))
                        for (name, bucket), configs in offered.items() for c in configs}


@pytest.mark.parametrize("chunked, shape", [(False, (3, 5, 37)), (False, (3, 2000)), (True, (3, 5000))],
                         ids=["fused", "fused, one program per SM", "chunked"])
def test_every_norm_candidate_matches_the_reference(chunked, shape, triton_device, monkeypatch):
    """Short rows; rows whose backward's heuristic runs one program per multiprocessor (its candidates then include
    two per multiprocessor); and rows past the fused kernels' width."""
    if chunked:
        monkeypatch.setattr(norm, "MAX_FUSED", 4096)  # 5000 columns take the chunked kernels: 1 to 3 chunks
    gen = torch.Generator().manual_seed(4)
    x, dy = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 0.5 for _ in range(2))
    w, b = (torch.randn(shape[-1], generator=gen, dtype=torch.float64) for _ in range(2))
    ref_rms = gradients(lambda x, w: rms_norm_reference(x, w, 1e-6), [leaf(x, CPU, x.dtype), leaf(w, CPU, x.dtype)],
                        [dy])
    ref_ln = gradients(lambda x, w, b: layer_norm_reference(x, w, b, 1e-5),
                       [leaf(t, CPU, x.dtype) for t in (x, w, b)], [dy])

    def run():
        for op, args, (ref, ref_grads) in (("rms_norm", (x, w), ref_rms), ("layer_norm", (x, w, b), ref_ln)):
            inputs = [leaf(t, triton_device, torch.float32) for t in args]
            extra = (1e-6, 0.0, False) if op == "rms_norm" else (1e-5,)
            out, grads = gradients(lambda *t: call(op, "triton", *t, *extra), inputs, [dy])
            check_close(f"{op} y", out, ref, torch.float32)
            for i, (got, want) in enumerate(zip(grads, ref_grads)):
                check_close(f"{op} grad {i}", got, want, torch.float32)

    suffix = "_chunked" if chunked else ""
    _each_candidate(monkeypatch, [norm._FORWARD[True, not chunked], norm._BACKWARD[True, not chunked],
                                  norm._FORWARD[False, not chunked], norm._BACKWARD[False, not chunked]], run)
    assert norm._FORWARD[True, not chunked].name == f"rms_norm.forward{suffix}"


def test_norm_backward_pipelines_its_row_loop_only_where_the_tiles_fit(monkeypatch):
    """The heuristic of 2048-8192 columns buffers two tiles of 8192 values of x and dy: 64 KiB in bf16, 128 KiB in
    float32 (1024 columns: two tiles of 2048 values). Where they do not fit (float32 on an RTX 4090's 99 KiB a
    program), or off NVIDIA GPUs, the launch takes the earlier unpipelined heuristic instead; the interpreter keeps
    the stages (it ignores them)."""
    from torchport.kernels.triton import norm_tuning

    for block_n in (2048, 4096, 8192):
        for is_rms in (True, False):
            m, w, p, s = norm_tuning._bwd_heuristic(block_n, is_rms)
            assert (m * block_n, w, p, s) == (8192, 8, 1, 3)
    for is_rms in (True, False):
        assert norm_tuning._bwd_heuristic(1024, is_rms) == (2, 4, 4, 3)
        assert norm_tuning.unpipelined_backward(1024, is_rms) == {"BLOCK_M": 2, "num_warps": 4, "per_sm": 4,
                                                                  "stages": 1}
        candidates = norm_tuning._bwd_candidates(is_rms)(1024, 8192)
        assert candidates[:2] == [{"BLOCK_M": 2, "num_warps": 4, "per_sm": 4, "stages": 3},
                                  norm_tuning.unpipelined_backward(1024, is_rms)]
        # no candidate buffers more than the heuristic's tiles, nor runs more programs per multiprocessor
        assert all(c["BLOCK_M"] * c["per_sm"] <= 8 and c["per_sm"] <= 4 for c in candidates)
    assert norm_tuning._bwd_heuristic(16384, True)[3] == norm_tuning._bwd_heuristic(512, False)[3] == 1
    for is_rms in (True, False):  # 256 columns: two warps; the earlier four stay a candidate
        assert norm_tuning._bwd_heuristic(256, is_rms) == (8, 2, 4, 1)
        earlier = {"BLOCK_M": 8, "num_warps": 4, "per_sm": 4, "stages": 1}
        assert earlier in norm_tuning._bwd_candidates(is_rms)(256, 8192)
    assert norm_tuning.unpipelined_backward(4096, True) == {"BLOCK_M": 4, "num_warps": 16, "per_sm": 1, "stages": 1}
    assert norm_tuning.unpipelined_backward(4096, False) == {"BLOCK_M": 2, "num_warps": 8, "per_sm": 1, "stages": 1}
    heuristic = {"BLOCK_M": 2, "num_warps": 8, "per_sm": 1, "stages": 3}
    gpu = torch.device("cuda", 0)
    launch, unpipelined = norm_tuning.backward_launch, norm_tuning.unpipelined_backward
    monkeypatch.setattr(norm_tuning, "nvidia", lambda device: True)
    monkeypatch.setattr(norm_tuning, "shared_memory_per_program", lambda device: 227 * 1024)
    assert launch(heuristic, 4096, 2 + 2, gpu, True) is heuristic
    assert launch(heuristic, 4096, 4 + 4, gpu, True) is heuristic
    monkeypatch.setattr(norm_tuning, "shared_memory_per_program", lambda device: 99 * 1024)
    assert launch(heuristic, 4096, 2 + 2, gpu, True) is heuristic
    assert launch(heuristic, 4096, 4 + 4, gpu, True) == unpipelined(4096, True)
    assert launch(heuristic, 4096, 4 + 4, gpu, False) == unpipelined(4096, False)
    # 1024 columns, four programs per multiprocessor: 4 x 32 KiB in bf16 pass an RTX 4090's 99 KiB, fit an H100's
    short = {"BLOCK_M": 2, "num_warps": 4, "per_sm": 4, "stages": 3}
    assert launch(short, 1024, 2 + 2, gpu, True) == dict(short, stages=1) == unpipelined(1024, True)
    monkeypatch.setattr(norm_tuning, "shared_memory_per_program", lambda device: 227 * 1024)
    assert launch(short, 1024, 2 + 2, gpu, True) is short
    assert launch(short, 1024, 4 + 4, gpu, False) is short  # float32: 4 x 48 KiB
    monkeypatch.setattr(norm_tuning, "shared_memory_per_program", lambda device: 163 * 1024)  # an A100
    assert launch(short, 1024, 4 + 4, gpu, False) == unpipelined(1024, False)
    assert launch(short, 1024, 2 + 2, gpu, False) is short
    monkeypatch.setattr(norm_tuning, "shared_memory_per_program", lambda device: 99 * 1024)
    one_stage = dict(heuristic, stages=1)
    assert launch(one_stage, 4096, 4 + 4, gpu, True) is one_stage
    monkeypatch.setattr(norm_tuning, "nvidia", lambda device: False)  # a ROCm GPU: not measured there
    monkeypatch.setattr(norm_tuning, "shared_memory_per_program", lambda device: 227 * 1024)
    assert launch(heuristic, 4096, 2 + 2, gpu, True) == unpipelined(4096, True)
    assert launch(heuristic, 4096, 4 + 4, torch.device("cpu"), True) is heuristic


def test_norm_backward_logs_once_why_it_runs_unpipelined(monkeypatch, caplog):
    from torchport.kernels.triton import norm_tuning

    monkeypatch.setenv("TORCHPORT_LOG", "kernels")
    monkeypatch.setattr(norm_tuning, "_LOGGED_FALLBACKS", set())
    monkeypatch.setattr(norm_tuning, "nvidia", lambda device: True)
    monkeypatch.setattr(norm_tuning, "shared_memory_per_program", lambda device: 99 * 1024)
    heuristic = {"BLOCK_M": 2, "num_warps": 8, "per_sm": 1, "stages": 3}
    gpu = torch.device("cuda", 0)
    with caplog.at_level("INFO", logger="torchport.kernels"):
        for _ in range(3):  # every backward call asks; the reason is logged once per device and shape
            norm_tuning.backward_launch(heuristic, 4096, 4 + 4, gpu, True)
        norm_tuning.backward_launch(heuristic, 4096, 2 + 2, gpu, True)  # fits: nothing to say
        monkeypatch.setattr(norm_tuning, "nvidia", lambda device: False)
        norm_tuning.backward_launch(heuristic, 2048, 2 + 2, gpu, False)
    messages = [r.getMessage() for r in caplog.records if r.name == "torchport.kernels"]
    assert len(messages) == 2, messages
    assert messages[0].startswith("rms_norm backward, 4096 columns, 8 bytes per x + dy value on cuda:0: the buffered "
                                  "tiles of its 1 program(s) per multiprocessor need 147456 bytes of shared memory, "
                                  "the device has 101376")
    assert "running {'BLOCK_M': 4, 'num_warps': 16, 'per_sm': 1, 'stages': 1} instead of" in messages[0]
    assert messages[1].startswith("layer_norm backward, 2048 columns") and "not an NVIDIA GPU" in messages[1]


@pytest.mark.parametrize("shape", [(45, 1000), (37, 2000), (9, 4100)], ids=["1024 columns", "2048 columns",
                                                                           "8192 columns"])
def test_pipelined_norm_backward_walks_many_rows_per_program(shape, triton_device, monkeypatch):
    """One program per multiprocessor and a single multiprocessor: each program's row loop runs many steps, the last
    one over a part tile, with the pipelined heuristic and with the earlier one."""
    from torchport.kernels.triton import norm_tuning

    monkeypatch.setattr(norm, "multiprocessor_count", lambda device: 1)
    gen = torch.Generator().manual_seed(9)
    x, dy = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 0.5 for _ in range(2))
    w, b = (torch.randn(shape[-1], generator=gen, dtype=torch.float64) for _ in range(2))
    block_n = next_power_of_2(shape[-1])
    for op, is_rms, args, fn in (("rms_norm", True, (x, w), lambda x, w: rms_norm_reference(x, w, 1e-6)),
                                 ("layer_norm", False, (x, w, b), lambda x, w, b: layer_norm_reference(x, w, b, 1e-5))):
        ref, ref_grads = gradients(fn, [leaf(t, CPU, x.dtype) for t in args], [dy])
        extra = (1e-6, 0.0, False) if is_rms else (1e-5,)
        for config in (norm_tuning._bwd_candidates(is_rms)(block_n, shape[0])[0],
                       norm_tuning.unpipelined_backward(block_n, is_rms)):
            monkeypatch.setattr(norm._BACKWARD[is_rms, True], "candidates", lambda *bucket, c=config: [c])
            autotune.clear_cache(files=False)
            inputs = [leaf(t, triton_device, torch.float32) for t in args]
            out, grads = gradients(lambda *t: call(op, "triton", *t, *extra), inputs, [dy])
            check_close(f"{op} y", out, ref, torch.float32)
            for i, (got, want) in enumerate(zip(grads, ref_grads)):
                check_close(f"{op} grad {i} with {config}", got, want, torch.float32)


@pytest.mark.parametrize("layout", ["contiguous", "halves"])
def test_every_glu_candidate_matches_the_reference(layout, triton_device, monkeypatch):
    gen = torch.Generator().manual_seed(6)
    shape = (3, 5, 37) if layout == "contiguous" else (3, 4, 50)
    gate, up, dout = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2 for _ in range(3))
    refs = {op: gradients(fn, [leaf(gate, CPU, gate.dtype), leaf(up, CPU, gate.dtype)], [dout])
            for op, fn in (("swiglu", swiglu_reference), ("geglu", geglu_reference))}

    def run():
        for op, (ref, ref_grads) in refs.items():
            if layout == "contiguous":
                inputs = [leaf(gate, triton_device, torch.float32), leaf(up, triton_device, torch.float32)]
                out, grads = gradients(lambda g, u: call(op, "triton", g, u, False), inputs, [dout])
            else:  # strided rows: the two halves of one fused projection
                fused = leaf(torch.cat([gate, up], dim=-1), triton_device, torch.float32)
                out = call(op, "triton", *(fused * 1).chunk(2, dim=-1), False)
                out.backward(dout.to(triton_device, torch.float32))
                grads = fused.grad.chunk(2, dim=-1)
            check_close(f"{op} out", out, ref, torch.float32)
            for i, (got, want) in enumerate(zip(grads, ref_grads)):
                check_close(f"{op} grad {i}", got, want, torch.float32)

    _each_candidate(monkeypatch, list(glu._TUNED.values()), run)


def test_every_rope_candidate_matches_the_reference(triton_device, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    batch, hq, hk, seq, dim = 2, 3, 2, 7, 20
    q = torch.randn(batch, seq, hq, dim, generator=gen, dtype=torch.float64).transpose(1, 2)  # a [b, s, h, d] view
    k = torch.randn(batch, hk, seq, dim, generator=gen, dtype=torch.float64)
    angles = torch.rand(batch, seq, dim // 2, generator=gen, dtype=torch.float64) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    dq, dk = torch.randn(q.shape, generator=gen, dtype=torch.float64), torch.randn(k.shape, generator=gen,
                                                                                   dtype=torch.float64)
    ref, ref_grads = gradients(lambda a, b: rope_reference(a, b, cos, sin),
                               [leaf(q, CPU, q.dtype), leaf(k, CPU, k.dtype)], [dq, dk])
    c, s = cos.to(triton_device, torch.float32), sin.to(triton_device, torch.float32)

    def run():
        inputs = [leaf(q, triton_device, torch.float32), leaf(k, triton_device, torch.float32)]
        out, grads = gradients(lambda a, b: call("rope", "triton", a, b, c, s), inputs, [dq, dk])
        for name, got, want in zip(("q", "k", "dq", "dk"), [*out, *grads], [*ref, *ref_grads]):
            check_close(name, got, want, torch.float32)

    _each_candidate(monkeypatch, list(rope._TUNED.values()), run)


def _cross_entropy_case(rows: int = 6, columns: int = 5000):
    """float64 logits with some ignored rows, their per-row losses and ``0.5 · d Σ loss / d logits``."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(rows, columns, generator=gen, dtype=torch.float64) * 3
    t = torch.randint(0, columns, (rows,), generator=gen)
    t[1] = -100
    ref_x = x.clone().requires_grad_()
    loss = torch.nn.functional.cross_entropy(ref_x, t, ignore_index=-100, reduction="none")
    (0.5 * loss.sum()).backward()
    return x, t, loss.detach(), ref_x.grad


@pytest.mark.parametrize("columns", [300, 5000], ids=["rows held whole", "longer rows"])
@pytest.mark.parametrize("in_place", [False, True], ids=["new buffer", "in place"])
def test_every_cross_entropy_candidate_matches_the_reference(in_place, columns, triton_device, monkeypatch):
    """300 columns: rows the kernel holds in registers (both kernels among the candidates); 5000: longer rows, one or
    two chunks by candidate."""
    x, t, ref_loss, ref_grad = _cross_entropy_case(columns=columns)

    def run():
        for want_grad in (True, False):
            logits = x.to(triton_device, torch.float32)
            grad = (logits if in_place else torch.empty_like(logits)) if want_grad else None
            loss = cross_entropy.loss_and_grad(logits, t.to(triton_device), -100, 0.0, 0.0, 0.5, grad)
            check_close("loss", loss, ref_loss, torch.float32)
            if want_grad:
                check_close("grad", grad, ref_grad, torch.float32)

    _each_candidate(monkeypatch, [cross_entropy_tuning._TUNED], run)


def test_cross_entropy_candidates_start_with_the_heuristic_and_fit_the_row():
    """Every bucket's candidates: the heuristic first (what runs where nothing is timed), at most six, no repeats,
    and no chunk wider than the row rounded up to a power of two."""
    for width in (256, 1024, 4096, 8192, 16384, 32768, 65536, 131072, 262144):
        for rows in (256, 16384):
            for grad in (0, 1, 2):
                configs = cross_entropy_tuning._candidates(width, rows, grad)
                heuristic = cross_entropy_tuning._to_config(cross_entropy_tuning.launch_for(rows, width, 2, 0))
                if heuristic["kind"] == 1:
                    heuristic["BLOCK"] = min(heuristic["BLOCK"], width)
                assert configs[0] == heuristic, (width, rows, grad)
                assert 2 <= len(configs) <= 6 and len(autotune.distinct(configs)) == len(configs), (width, configs)
                assert all(c["kind"] == 0 or c["BLOCK"] <= width for c in configs), (width, configs)


class _Recording:
    """A kernel whose launches are recorded (their compile-time arguments) and then made."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def launch(self, grid, *args, **meta):
        self.launches.append(meta)
        return self.kernel.launch(grid, *args, **meta)


@pytest.mark.parametrize("layout", ["contiguous", "strided rows"])
def test_in_place_cross_entropy_tunes_on_a_copy_and_runs_its_choice(layout, triton_device, monkeypatch):
    """In place (the fused linear cross-entropy's chunks), the gradient is written over the logits: tuning times the
    candidates in place on a copy, so the logits the final launch reads are intact, also when they are a view into
    a wider buffer (whose other columns nothing touches); the chosen launch is the one that runs, then and later."""
    x, t, ref_loss, ref_grad = _cross_entropy_case()
    target = cross_entropy_tuning._candidates(8192, 256, 2)[2]
    monkeypatch.setattr(autotune, "timer", _prefer(target))
    recording = _Recording(cross_entropy._CHUNKED)
    monkeypatch.setattr(cross_entropy, "_CHUNKED", recording)
    wide = torch.full((6, 6000 if layout == "strided rows" else 5000), 7.0, device=triton_device)
    logits = wide[:, :5000]
    logits.copy_(x)
    loss = cross_entropy.loss_and_grad(logits, t.to(triton_device), -100, 0.0, 0.0, 0.5, logits)
    check_close("loss", loss, ref_loss, torch.float32)
    check_close("grad", logits, ref_grad, torch.float32)
    assert bool((wide[:, 5000:] == 7.0).all())
    [entry] = autotune.entries()
    assert entry["key"] == "cross_entropy.launch float32 block_v=8192,rows=256,grad=2"
    assert entry["config"] == target
    assert len(entry["timings"]) == len(cross_entropy_tuning._candidates(8192, 256, 2))  # every candidate timed

    def last_launch():
        return recording.launches[-1]["BLOCK"], recording.launches[-1]["num_warps"]

    assert last_launch() == (target["BLOCK"], target["num_warps"])  # the tuning call's final launch
    recording.launches.clear()
    again = x.to(triton_device, torch.float32)
    loss = cross_entropy.loss_and_grad(again, t.to(triton_device), -100, 0.0, 0.0, 0.5, again)  # a later call
    check_close("grad, later call", again, ref_grad, torch.float32)
    assert len(recording.launches) == 1 and last_launch() == (target["BLOCK"], target["num_warps"])
    assert len(autotune.entries()) == 1
    # a gradient in its own buffer is a bucket of its own, timed as it runs
    cross_entropy.loss_and_grad(x.to(triton_device, torch.float32), t.to(triton_device), -100, 0.0, 0.0, 0.5,
                                torch.empty(6, 5000, device=triton_device))
    assert sorted(e["key"][-6:] for e in autotune.entries()) == ["grad=1", "grad=2"]
