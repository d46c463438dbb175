"""What a CUDA-graph capture keeps alive: the pinned host tables of the grouped quantization kernel live exactly as
long as the ``graph_step`` capture that recorded them (freed with its graph), and only captures fp8tensor cannot see
the end of share process-wide buffers (one per distinct table). Runs on the CPU: "capturing" is simulated, and the
pinned buffers are plain tensors."""
from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from fp8tensor.core import capture
from fp8tensor.numerics import kernels


@pytest.fixture
def capturing(monkeypatch):
    """The current stream reports a capture in progress; tables are plain CPU tensors; the process-wide table store
    starts empty and is restored afterwards."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(kernels, "_pinned_table", lambda values: torch.tensor(values, dtype=torch.int64))
    monkeypatch.setattr(kernels, "_CAPTURED_TABLES", {})


def test_graph_step_capture_owns_its_tables(capturing):
    cap = capture.begin_capture()
    try:
        a = kernels._captured_host_table([1, 2, 3])
        b = kernels._captured_host_table([1, 2, 3])
    finally:
        capture.end_capture(cap)
    assert a is not b and [x for x in cap.kept] == [a, b]
    assert kernels._CAPTURED_TABLES == {}, "a graph_step capture's tables leaked to the process"
    refs = [weakref.ref(a), weakref.ref(b)]
    del a, b
    assert all(r() is not None for r in refs), "freed while the capture (its graph) lives"
    del cap
    gc.collect()
    assert all(r() is None for r in refs), "the tables outlived their capture"


def test_other_captures_share_one_process_wide_buffer_per_table(capturing):
    a = kernels._captured_host_table([4, 5])
    b = kernels._captured_host_table([4, 5])
    c = kernels._captured_host_table([4, 6])
    assert a is b and a is not c and torch.equal(a, torch.tensor([4, 5]))
    assert set(kernels._CAPTURED_TABLES) == {(4, 5), (4, 6)}


def test_after_the_capture_nothing_is_kept_by_it(capturing):
    cap = capture.begin_capture()
    capture.end_capture(cap)
    kernels._captured_host_table([7])
    assert cap.kept == [] and set(kernels._CAPTURED_TABLES) == {(7,)}


def test_a_capture_keeps_only_its_own_thread_s_tables(capturing):
    """Another thread's capture (``torch.cuda.graph`` on its own stream) is not the graph_step capture of this
    thread: its tables must not die with this thread's graph."""
    cap = capture.begin_capture()
    got = {}
    try:
        t = threading.Thread(target=lambda: got.setdefault("buf", kernels._captured_host_table([9, 9])))
        t.start()
        t.join()
    finally:
        capture.end_capture(cap)
    assert cap.kept == [] and kernels._CAPTURED_TABLES[(9, 9)] is got["buf"]

