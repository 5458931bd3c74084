"""The Wrapper in one process: argument injection, refusals, a 1-rank job on TCP and file stores."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

import inprocess

pytestmark = pytest.mark.timeout(30)


# -- the wrapper, without processes ---------------------------------------------

# Short, and ordered as Wrapper requires (hard + grace < barrier).
SINGLE_RANK_TIMEOUTS = dict(
    soft_timeout=datetime.timedelta(seconds=5),
    hard_timeout=datetime.timedelta(seconds=10),
    barrier_timeout=datetime.timedelta(seconds=20),
)


def test_disabled_wrapper_returns_the_function_untouched():
    def f(x):
        return x

    assert inprocess.Wrapper(enabled=False)(f) is f


def test_call_wrapper_parameter_is_found_by_annotation():

    from inprocess.wrap import _call_wrapper_parameter

    def a(x, cw: inprocess.CallWrapper):
        pass

    def b(cw: inprocess.CallWrapper | None = None):
        pass

    def c(*args, **kwargs):
        pass

    assert _call_wrapper_parameter(a) == "cw"
    assert _call_wrapper_parameter(b) == "cw"
    assert _call_wrapper_parameter(c) is None  # then inprocess.current_call() is the way in


def test_refuses_to_start_when_a_process_group_exists(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"not torch\.distributed\.is_initialized\(\)"):
            inprocess.Wrapper()(lambda: None)()
    finally:
        dist.destroy_process_group()


def test_single_rank_job_runs_with_current_call(monkeypatch):
    from inprocess.launch import free_port

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    calls = []

    @inprocess.Wrapper(
        **SINGLE_RANK_TIMEOUTS,
    )
    def train(*args, **kwargs):
        cw = inprocess.current_call()
        calls.append(cw.iteration)
        cw.ping()
        if cw.iteration == 0:
            raise ValueError("first attempt fails")
        return "done"

    assert train() == "done"
    assert calls == [0, 1]
    assert inprocess.current_call() is None
    assert os.environ["RANK"] == "0"

def test_single_host_job_on_a_file_store(monkeypatch, tmp_path):
    """store_factory=inprocess.store.FileStore: the single-host store, no TCP server."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    calls = []

    @inprocess.Wrapper(
        store_factory=inprocess.store.FileStore,
        store_kwargs={"file_name": str(tmp_path / "store")},
        **SINGLE_RANK_TIMEOUTS,
    )
    def train(call_wrapper: inprocess.CallWrapper = None):
        calls.append(call_wrapper.iteration)
        dist.init_process_group("gloo", store=call_wrapper.store, rank=0, world_size=1)
        dist.all_reduce(torch.ones(2))
        if call_wrapper.iteration < 2:
            raise ValueError("fails twice")
        dist.destroy_process_group()
        return call_wrapper.iteration

    assert train() == 2
    assert calls == [0, 1, 2]
    assert not dist.is_initialized()
