"""The tuning cache on real files: restarts, concurrent writers, damaged files, version changes,
unwritable directories, seeds and export."""

from __future__ import annotations

import fcntl
import json
import logging
import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest

from hal.tuning.cache import TuneCache, cache_dir
from tests.tuning.cache_worker import DEVICE, VERSIONS, put_keys


def measured(winner: str, time_us: float = 10.0) -> dict:
    """A record as the dispatcher writes one after timing kernels on this machine."""
    return {
        "winner": winner,
        "times_us": {winner: time_us, "cuda/torch": time_us * 2},
        "context": "eager",
        "measured": "2026-12-02T10:00:00Z",
        "source": "measured",
    }


def hal_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "hal" and r.levelno == logging.WARNING]


def write_document(path: Path, device: str = DEVICE, versions: dict = VERSIONS, entries: dict | None = None) -> None:
    """A cache or seed file written by hand, as a plugin would ship one."""
    document = {"format": 1, "device": device, "versions": versions, "entries": entries or {}}
    path.write_text(json.dumps(document))


def test_a_new_cache_reads_what_an_earlier_one_wrote(tmp_path: Path) -> None:
    TuneCache(DEVICE, VERSIONS, tmp_path).put("matmul|f16|128", measured("cuda/triton"))

    restarted = TuneCache(DEVICE, dict(reversed(VERSIONS.items())), tmp_path)  # order is irrelevant
    assert restarted.get("matmul|f16|128") == measured("cuda/triton")
    assert restarted.get("matmul|f16|256") is None
    document = json.loads(restarted.path.read_text())
    assert document == {
        "format": 1,
        "device": DEVICE,
        "versions": VERSIONS,
        "entries": {"matmul|f16|128": measured("cuda/triton")},
    }
    assert restarted.path.parent == tmp_path and restarted.path.name.startswith(f"{DEVICE}-")
    assert Path(f"{restarted.path}.lock").exists()


def test_the_file_is_read_at_construction_and_merged_by_put(tmp_path: Path) -> None:
    early = TuneCache(DEVICE, VERSIONS, tmp_path)
    other = TuneCache(DEVICE, VERSIONS, tmp_path)
    other.put("softmax", measured("cuda/torch"))
    other.put("shared", measured("cuda/torch", 20.0))
    assert early.get("softmax") is None  # get never reads the file

    early.put("shared", measured("cuda/triton", 5.0))
    assert early.get("softmax") == measured("cuda/torch")  # the put merged the file in
    assert early.get("shared") == measured("cuda/triton", 5.0)  # its own record wins its key
    assert TuneCache(DEVICE, VERSIONS, tmp_path).entries() == {
        "softmax": measured("cuda/torch"),
        "shared": measured("cuda/triton", 5.0),
    }


def test_processes_writing_at_once_lose_no_key(tmp_path: Path) -> None:
    workers, count = 3, 40
    spawn = multiprocessing.get_context("spawn")
    start = spawn.Barrier(workers)
    processes = [spawn.Process(target=put_keys, args=(str(tmp_path), w, count, start)) for w in range(workers)]
    for process in processes:
        process.start()
    path = TuneCache(DEVICE, VERSIONS, tmp_path).path
    while any(p.is_alive() for p in processes):  # meanwhile, every read sees a whole file or none
        if path.exists():
            json.loads(path.read_text())
        time.sleep(0.002)  # leave the shared cores to the writers
    for process in processes:
        process.join(timeout=300)
    assert [p.exitcode for p in processes] == [0] * workers

    entries = json.loads(TuneCache(DEVICE, VERSIONS, tmp_path).path.read_text())["entries"]
    assert set(entries) == {f"w{w}-k{i}" for w in range(workers) for i in range(count)}
    assert entries["w2-k7"] == {"winner": "worker2", "times_us": {"a": 7.0}, "source": "measured"}
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.corrupt"))


def test_put_waits_for_the_file_lock(tmp_path: Path) -> None:
    cache = TuneCache(DEVICE, VERSIONS, tmp_path)
    writer = threading.Thread(target=cache.put, args=("matmul", measured("cuda/triton")))
    with open(f"{cache.path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as another process in the middle of its put
        writer.start()
        writer.join(timeout=0.5)
        assert writer.is_alive() and not cache.path.exists()
        assert cache.get("matmul") == measured("cuda/triton")  # served from memory meanwhile
    writer.join(timeout=60)
    assert json.loads(cache.path.read_text())["entries"] == {"matmul": measured("cuda/triton")}


def test_threads_writing_at_once_lose_no_key(tmp_path: Path) -> None:
    cache = TuneCache(DEVICE, VERSIONS, tmp_path)
    start = threading.Barrier(6)

    def put_many(thread: int) -> None:
        start.wait()
        for i in range(30):
            cache.put(f"t{thread}-{i}", measured(f"thread{thread}"))

    threads = [threading.Thread(target=put_many, args=(t,)) for t in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    expected = {f"t{t}-{i}" for t in range(6) for i in range(30)}
    assert set(cache.entries()) == expected
    assert set(TuneCache(DEVICE, VERSIONS, tmp_path).entries()) == expected


def _other_versions(path: Path) -> None:
    write_document(path, versions={"hal": "9.9.9"}, entries={"old": measured("x")})


def _other_device(path: Path) -> None:
    write_document(path, device="nvidia-h200-sm90", entries={"old": measured("x")})


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda p: p.write_text('{"format": 1, "entries": {"half'), "not valid JSON"),
        (lambda p: p.write_bytes(b"\xff\xfe\x00garbage"), "cannot read it"),
        (lambda p: p.write_text("[1, 2, 3]"), "not a tuning cache"),
        (lambda p: p.write_text(json.dumps({"format": 2, "device": DEVICE, "versions": VERSIONS, "entries": {}})), "format 2"),
        (_other_versions, "measured with versions"),
        (_other_device, "measured on device 'nvidia-h200-sm90'"),
        (lambda p: p.mkdir(), "cannot read it"),  # a directory in the file's place: read fails
    ],
    ids=["bad-json", "not-utf8", "wrong-structure", "other-format", "other-versions", "other-device", "unreadable"],
)
def test_an_unusable_file_is_ignored_with_one_warning_then_set_aside_and_rewritten(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage, reason: str
) -> None:
    path = TuneCache(DEVICE, VERSIONS, tmp_path).path
    damage(path)
    damaged = path.read_bytes() if path.is_file() else None

    with caplog.at_level(logging.WARNING, logger="hal"):
        cache = TuneCache(DEVICE, VERSIONS, tmp_path)
        assert cache.get("old") is None and cache.entries() == {}
        TuneCache(DEVICE, VERSIONS, tmp_path)  # the same path again: no second warning
        cache.put("new", measured("cuda/triton"))  # re-reads the damaged file under the lock: still one

    [warning] = hal_warnings(caplog)
    assert str(path) in warning and reason in warning
    assert "ignored" in warning and "rewritten" in warning
    corrupt = Path(f"{path}.corrupt")
    assert corrupt.exists() and (damaged is None or corrupt.read_bytes() == damaged)
    assert json.loads(path.read_text())["entries"] == {"new": measured("cuda/triton")}
    assert TuneCache(DEVICE, VERSIONS, tmp_path).entries() == {"new": measured("cuda/triton")}


BAD_RECORDS = {
    "times_us null": ({**measured("cuda/triton"), "times_us": None}, "field 'times_us' must be", "null"),
    "times_us a list": ({**measured("cuda/triton"), "times_us": [1.0, 2.0]}, "field 'times_us' must be", "[1.0, 2.0]"),
    "times_us a string": ({**measured("cuda/triton"), "times_us": "fast"}, "field 'times_us' must be", '"fast"'),
    "a time a string": ({**measured("cuda/triton"), "times_us": {"cuda/triton": "fast"}}, "field 'times_us' must be", '"fast"'),
    "a time null": ({**measured("cuda/triton"), "times_us": {"cuda/triton": None}}, "field 'times_us' must be", "null"),
    "a time negative": ({**measured("cuda/triton"), "times_us": {"cuda/triton": -3.0}}, "field 'times_us' must be", "-3.0"),
    "a time true": ({**measured("cuda/triton"), "times_us": {"cuda/triton": True}}, "field 'times_us' must be", "true"),
    "a time NaN": ({**measured("cuda/triton"), "times_us": {"cuda/triton": float("nan")}}, "field 'times_us' must be", "NaN"),
    "times_us missing": ({"winner": "cuda/triton"}, "field 'times_us' is missing", "times_us"),
    "winner a number": ({**measured("cuda/triton"), "winner": 3}, "field 'winner' must be", "got 3"),
    "winner a list": ({**measured("cuda/triton"), "winner": ["cuda/triton"]}, "field 'winner' must be", '["cuda/triton"]'),
    "winner missing": ({"times_us": {"a": 1.0}}, "field 'winner' is missing", "winner"),
    "context an object": ({**measured("cuda/triton"), "context": {"a": 1}}, "field 'context' must be", '{"a": 1}'),
    "source null": ({**measured("cuda/triton"), "source": None}, "field 'source' must be", "null"),
    "not an object": ([1, 2], "not an object", "[1, 2]"),
}


@pytest.mark.parametrize("case", list(BAD_RECORDS))
def test_a_record_with_a_field_of_the_wrong_type_is_dropped_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    """Before: such a record was served, and every call it matched raised AttributeError or
    ValueError in the dispatcher. Now it is dropped on load, the other records of the file serve,
    one warning names the file, the record and the field, and the next write leaves it out."""
    bad, field, shown = BAD_RECORDS[case]
    path = TuneCache(DEVICE, VERSIONS, tmp_path).path
    write_document(path, entries={"good": measured("cuda/torch"), "bad": bad, "bad too": bad})
    with caplog.at_level(logging.WARNING, logger="hal"):
        cache = TuneCache(DEVICE, VERSIONS, tmp_path)
        assert cache.get("bad") is None and cache.get("bad too") is None
        assert cache.entries() == {"good": measured("cuda/torch")}
        cache.put("new", measured("cuda/triton"))  # re-reads the file under the lock: no second warning
    [warning] = hal_warnings(caplog)
    assert str(path) in warning and "2 unusable record(s)" in warning
    assert f"record 'bad': {field}" in warning and shown in warning and "measured again" in warning
    assert json.loads(path.read_text())["entries"] == {"good": measured("cuda/torch"), "new": measured("cuda/triton")}
    assert not Path(f"{path}.corrupt").exists()


def test_a_seed_record_with_a_field_of_the_wrong_type_is_dropped_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seed = tmp_path / "seed.json"
    write_document(seed, entries={"matmul": measured("cuda/triton"), "gelu": {**measured("cuda/torch"), "times_us": None}})
    with caplog.at_level(logging.WARNING, logger="hal"):
        cache = TuneCache(DEVICE, VERSIONS, tmp_path / "cache", seeds=[seed])
    assert cache.get("gelu") is None and cache.get("matmul") == {**measured("cuda/triton"), "source": "seed"}
    [warning] = hal_warnings(caplog)
    assert str(seed) in warning and "record 'gelu': field 'times_us' must be" in warning


@pytest.mark.parametrize("case", ["times_us null", "a time a string", "winner missing"])
def test_put_refuses_a_record_that_a_load_would_drop(tmp_path: Path, case: str) -> None:
    bad, field, _ = BAD_RECORDS[case]
    with pytest.raises(TypeError, match=f"tuning record for 'k': {field}"):
        TuneCache(DEVICE, VERSIONS, tmp_path).put("k", bad)


def test_a_version_change_reads_another_file_and_serves_no_old_record(tmp_path: Path) -> None:
    before = TuneCache(DEVICE, VERSIONS, tmp_path)
    before.put("matmul", measured("cuda/triton"))

    upgraded = TuneCache(DEVICE, {**VERSIONS, "torch": "2.12.0"}, tmp_path)
    assert upgraded.path != before.path and upgraded.path.parent == before.path.parent
    assert upgraded.get("matmul") is None
    upgraded.put("matmul", measured("cuda/torch"))
    assert TuneCache(DEVICE, VERSIONS, tmp_path).get("matmul") == measured("cuda/triton")  # old file untouched
    assert TuneCache(DEVICE, {**VERSIONS, "torch": "2.12.0"}, tmp_path).get("matmul") == measured("cuda/torch")


def _file_in_the_way(tmp_path: Path) -> Path:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache directory should be")
    return blocker


def _read_only(tmp_path: Path) -> Path:
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    directory = tmp_path / "read-only"
    directory.mkdir(mode=0o555)
    return directory


@pytest.mark.parametrize("unwritable", [_file_in_the_way, _read_only], ids=["file-in-the-way", "read-only"])
def test_an_unwritable_directory_keeps_records_in_memory_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, unwritable
) -> None:
    directory = unwritable(tmp_path)
    with caplog.at_level(logging.WARNING, logger="hal"):
        cache = TuneCache(DEVICE, VERSIONS, directory)
        assert hal_warnings(caplog) == []  # nothing to read is no problem
        cache.put("matmul", measured("cuda/triton"))
        cache.put("softmax", measured("cuda/torch"))

    assert cache.get("matmul") == measured("cuda/triton") and cache.get("softmax") == measured("cuda/torch")
    [warning] = hal_warnings(caplog)
    assert str(cache.path) in warning and "kept in memory" in warning and "HAL_TUNE_CACHE" in warning
    assert TuneCache(DEVICE, VERSIONS, directory).get("matmul") is None


def test_seeds_are_served_until_measured_here(tmp_path: Path) -> None:
    seed = tmp_path / "seeds" / f"{DEVICE}.json"
    seed.parent.mkdir()
    write_document(  # measured on the project's machines with older versions: still used
        seed,
        versions={"hal": "0.0.1"},
        entries={"matmul": measured("cuda/triton", 3.0), "softmax": measured("cuda/torch")},
    )
    cache = TuneCache(DEVICE, VERSIONS, tmp_path / "cache", seeds=[seed, tmp_path / "missing.json"])
    assert cache.get("matmul") == {**measured("cuda/triton", 3.0), "source": "seed"}

    cache.put("matmul", measured("cuda/torch", 4.0))
    assert cache.get("matmul") == measured("cuda/torch", 4.0)
    assert cache.get("softmax")["source"] == "seed"

    restarted = TuneCache(DEVICE, VERSIONS, tmp_path / "cache", seeds=[seed])
    assert restarted.get("matmul") == measured("cuda/torch", 4.0)  # the file beats the seed
    assert restarted.entries() == {
        "matmul": measured("cuda/torch", 4.0),
        "softmax": {**measured("cuda/torch"), "source": "seed"},
    }
    assert json.loads(restarted.path.read_text())["entries"] == {"matmul": measured("cuda/torch", 4.0)}


def test_a_later_seed_wins_a_key_over_an_earlier_one(tmp_path: Path) -> None:
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    write_document(first, entries={"matmul": measured("a"), "gelu": measured("a")})
    write_document(second, entries={"matmul": measured("b")})
    cache = TuneCache(DEVICE, VERSIONS, tmp_path, seeds=[first, second])
    assert cache.get("matmul")["winner"] == "b" and cache.get("gelu")["winner"] == "a"


def test_a_seed_for_another_device_or_unreadable_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other_device, broken, good = tmp_path / "h100.json", tmp_path / "broken.json", tmp_path / "good.json"
    write_document(other_device, device="nvidia-h100-sm90", entries={"matmul": measured("cuda/triton")})
    broken.write_text("{not json")
    write_document(good, entries={"gelu": measured("cuda/torch")})

    with caplog.at_level(logging.WARNING, logger="hal"):
        cache = TuneCache(DEVICE, VERSIONS, tmp_path, seeds=[other_device, broken, good])
    assert cache.get("matmul") is None and cache.get("gelu")["source"] == "seed"
    first, second = hal_warnings(caplog)
    assert str(other_device) in first and "'nvidia-h100-sm90'" in first and "ignores" in first
    assert str(broken) in second and "not valid JSON" in second


def test_export_writes_the_measured_records_as_a_seed_file(tmp_path: Path) -> None:
    seed = tmp_path / "shipped.json"
    write_document(seed, entries={"softmax": measured("cuda/torch")})
    cache = TuneCache(DEVICE, VERSIONS, tmp_path / "cache", seeds=[seed])
    cache.put("matmul", measured("cuda/triton"))
    cache.put("forced", {**measured("cuda/torch"), "source": "forced"})  # not a measurement
    TuneCache(DEVICE, VERSIONS, tmp_path / "cache").put("gelu", measured("cuda/triton", 7.0))
    cache.put("layer_norm", measured("cuda/triton", 2.0))  # merges gelu, measured by the other process

    exported = tmp_path / "out" / f"{DEVICE}.json"
    cache.export(exported)
    assert set(json.loads(exported.read_text())["entries"]) == {"matmul", "gelu", "layer_norm"}

    elsewhere = TuneCache(DEVICE, {"hal": "0.2.0"}, tmp_path / "elsewhere", seeds=[exported])
    assert elsewhere.entries() == {
        "matmul": {**measured("cuda/triton"), "source": "seed"},
        "gelu": {**measured("cuda/triton", 7.0), "source": "seed"},
        "layer_norm": {**measured("cuda/triton", 2.0), "source": "seed"},
    }


def test_records_are_copied_and_must_be_json(tmp_path: Path) -> None:
    cache = TuneCache(DEVICE, VERSIONS, tmp_path)
    record = measured("cuda/triton")
    cache.put("matmul", record)
    record["times_us"]["cuda/triton"] = 99.0  # the caller's later change does not reach the cache
    assert cache.get("matmul") == measured("cuda/triton")

    with pytest.raises(TypeError, match="not JSON-able"):
        cache.put("bad", {"winner": object()})
    with pytest.raises(TypeError, match="must be a dict"):
        cache.put("bad", ["cuda/triton"])  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["", "../escape", "nvidia/h200", ".hidden"])
def test_a_device_that_is_not_a_slug_is_refused(tmp_path: Path, device: str) -> None:
    with pytest.raises(ValueError, match="not a slug"):
        TuneCache(device, VERSIONS, tmp_path)


def test_cache_dir_is_HAL_TUNE_CACHE_else_under_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HAL_TUNE_CACHE", str(tmp_path / "tune"))
    assert cache_dir() == tmp_path / "tune"
    assert TuneCache(DEVICE, VERSIONS).path.parent == tmp_path / "tune"
    monkeypatch.delenv("HAL_TUNE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "hal" / "tune"
