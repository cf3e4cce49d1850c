"""profiler.py: stage seconds are collected in the context that asked for them (and the writer threads
the save starts), and nowhere else."""

from __future__ import annotations

import threading

import pytest

from slimtune import save_checkpoint
from slimtune.checkpoint.writer import WriteOptions
from slimtune.profiler import stage, timing_stages


def test_a_save_reports_its_producer_and_writer_thread_stages(qlora_model, tmp_path):
    with timing_stages() as profile:
        save_checkpoint(qlora_model, tmp_path / "ckpt", WriteOptions(progress=False))
    # dequantize and merge run in the producer; write and fsync in the writer thread and the coordinator
    assert {"dequantize", "merge", "write", "fsync"} <= set(profile.seconds), profile.seconds
    assert all(s >= 0 for s in profile.seconds.values())


def test_stages_outside_the_block_or_in_another_thread_are_not_counted():
    seen = []
    with timing_stages() as outer:
        with timing_stages() as inner:
            with stage("a", device_work=False):
                pass
        with stage("b", device_work=False):
            pass

        def elsewhere() -> None:  # a thread started plainly runs in an empty context: no profile
            with stage("c", device_work=False):
                seen.append(True)

        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
    with stage("d", device_work=False):
        pass
    assert set(inner.seconds) == {"a"} and set(outer.seconds) == {"b"} and seen == [True]


def test_a_stage_run_by_two_threads_at_once_sums_both_and_covers_its_wall_time_once():
    """``seconds`` adds every thread's time; ``wall()`` counts overlapping spans once and gaps not at all."""
    from slimtune.profiler import StageProfile

    profile = StageProfile(cuda_sync=False)
    for start, end in [(0.0, 1.0), (0.5, 1.5), (3.0, 4.0), (3.2, 3.4)]:
        profile.add("hash", start, end)
    profile.add("write", 10.0, 12.0)
    assert profile.seconds == pytest.approx({"hash": 3.2, "write": 2.0})
    assert profile.wall() == pytest.approx({"hash": 2.5, "write": 2.0})
