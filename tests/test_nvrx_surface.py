"""inprocess against the public surface of nvidia_resiliency_ext.inprocess (NVRx) 0.4.1 to main.

tests/nvrx_surface.json lists, as read from NVRx's sources, every public name of its public modules
and the parameter names of every class, method and function (its "about" says how). Each must
exist here under the same module and name, with parameters a call written for NVRx can use:

* NVRx's positional parameters are ours, by name and in order (a call by position binds alike);
  its keyword-only ones exist here by name; a parameter NVRx 0.4.1 had and later versions dropped
  is still accepted; ``*args`` and ``**kwargs`` are kept;
* a parameter of ours that NVRx lacks has a default (a call written for NVRx never needs it);
* an enum has NVRx's members, an exception derives from a class of NVRx's first base's name.

Anything else is a failure unless EXCEPTIONS names it, with the reason it differs. An exception no
longer needed fails too, so that the list stays true.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import io
import json
import logging
import pathlib
import sys
import types
import typing
from typing import Any

import pytest

SURFACE: dict[str, dict[str, dict[str, Any]]] = json.loads(
    (pathlib.Path(__file__).parent / "nvrx_surface.json").read_text())["modules"]

_INTERNAL = ("an internal module of NVRx's engine, which the engine here replaces (README, \"Migrating\"); "
             "no documented use imports it")

# Where inprocess differs from NVRx's surface on purpose: "module.name" (a name), "module.name(param)"
# (one parameter), "module.name.method" (a method), "module.name:base" (an exception's base).
EXCEPTIONS: dict[str, str] = {
    # Internal modules of NVRx's package (each listed in the README's migration notes).
    "inprocess.attribution": _INTERNAL + " (NVRx's fault attribution of its own monitor records)",
    "inprocess.monitor_process": _INTERNAL + " (its monitor process: inprocess.processes.monitor here)",
    "inprocess.monitor_thread": _INTERNAL + " (its monitor thread; RankShouldRestart, defined there, is "
                                            "inprocess.RankShouldRestart here)",
    "inprocess.param_utils": _INTERNAL + " (its argument checks and CallWrapper injection)",
    "inprocess.progress_watchdog": _INTERNAL + " (its watchdog thread: a native thread here)",
    "inprocess.sibling_monitor": _INTERNAL + " (its sibling heartbeats: the monitor processes here)",
    "inprocess.utils": _INTERNAL + " (logging and formatting helpers)",
    "inprocess.rank_filter": "NVRx 0.4.1's deprecated rank filters, removed in 0.5.0; Wrapper(rank_filter=...) "
                             "is refused with a message naming rank_assignment and MaxActiveWorldSize",
    # Internals of NVRx's wrap module, never called by user code.
    "inprocess.wrap.HealthCheckPassed": "a control-flow exception internal to NVRx's restart loop, caught there "
                                        "and never seen by a caller",
    "inprocess.wrap.reserve_fn": "NVRx's loop for a spare rank waiting for activation; a spare here waits at the "
                                 "barrier, inside the engine",
    "inprocess.CallWrapper.shutdown": "NVRx's teardown of a CallWrapper, called by its Wrapper when the call "
                                      "ends; here the call's resources are released by the engine on every exit "
                                      "path, so there is nothing left for a caller to shut down",
    "inprocess.wrap.CallWrapper.shutdown": "the same CallWrapper as inprocess.CallWrapper",
    # NVRx's store protocol: methods its engine calls on the store; the engine here has its own.
    **{f"inprocess.store.{store}.{method}": (
        "a method of NVRx's store protocol, called by its engine only; the engine here speaks its own "
        "protocol (inprocess.control.protocol), and a custom store needs none of these (StoreMixin's docstring)")
       for store, entry in SURFACE["inprocess.store"].items() for method in entry.get("methods", {})},
    # Steps of NVRx's per-rank algorithms, methods of its classes.
    **{f"inprocess.rank_assignment.Tree.{method}": (
        "a step of NVRx's per-rank Tree algorithm, called by its __call__ only; Tree here decides once for the "
        "whole job (inprocess.rank_assignment.tree_decision), and Node, bounded_activate and "
        "propagate_terminations are provided for code that walks a tree itself")
       for method in ("build_tree", "filter_active_world_size", "get_state_from_tree", "recompute_rank",
                      "replace_with_backfill", "replace_with_inactive", "shift_ranks", "update_tree")},
    **{f"inprocess.abort.AbortTorchDistributed.{method}": (
        "a step of NVRx's abort, called by its __call__ only; the abort here releases NCCL on a deadline "
        "(inprocess.gpu.nccl_abort) and gloo through its connections, and dumps the flight recorder itself")
       for method in ("collect_fr_trace", "shutdown_all_process_group_backends", "shutdown_process_group_backend")},
    # NVRx 0.4.1/0.5's fault injection helpers (the module was removed in 0.6.0).
    **{f"inprocess.tools.inject_fault.{name}": (
        "one of the per-fault functions behind NVRx's inject_fault() (each with delay and callback), called by "
        "its dispatcher only; inject_fault(), Fault, register_fault() and dispatch_fault_injection() are the "
        "entry points, and inprocess.faults performs each fault here")
       for name in ("abort", "async_raise", "async_raise_exception", "gpu_sleep", "lock_gil", "raise_gpu_error",
                    "segfault", "send_signal", "termination_signal_handler", "workload_exception")},
}


def _sig(obj: Any) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return None


_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


class _Ours:
    """The parameters of one of our signatures, as a call binds them."""

    def __init__(self, params: list[inspect.Parameter]):
        self.params = params
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self.positional = [p.name for p in params if p.kind in positional]
        self.by_keyword = {p.name for p in params if p.kind not in _VARIADIC + (inspect.Parameter.POSITIONAL_ONLY,)}
        self.var_positional = any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params)
        self.var_keyword = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)

    def takes_keyword(self, name: str) -> bool:
        return name in self.by_keyword or self.var_keyword

    def at(self, index: int) -> str | None:
        return self.positional[index] if index < len(self.positional) else None


def _one_parameter(path: str, name: str, index: int | None, ours: _Ours, used: set[str]) -> str | None:
    """The problem with NVRx's parameter ``name`` (positional number ``index``, None: keyword-only), if any."""
    if name.startswith("**"):
        return None if ours.var_keyword else f"{path}: NVRx takes {name}, this takes no **kwargs"
    if name.startswith("*"):
        if ours.var_positional or _excepted(f"{path}({name[1:]})", used):
            return None
        return f"{path}: NVRx takes {name}, this takes no *args"
    if _excepted(f"{path}({name})", used):
        return None
    if not ours.takes_keyword(name):
        return f"{path}: NVRx's parameter {name!r} is missing (this has {[p.name for p in ours.params]})"
    if index is not None:
        here = ours.at(index)
        absorbed = here is None and ours.var_positional  # this takes any positional argument
        if here != name and name in ours.by_keyword and not absorbed:
            return f"{path}: NVRx's positional parameter {index} is {name!r}, here it is {here!r}"
    return None


def parameter_problems(path: str, theirs: list[str], params: list[inspect.Parameter] | None,
                       older: list[str], used: set[str]) -> list[str]:
    """What a call written for NVRx's parameters ``theirs`` could not do with ``params``."""
    if params is None:
        return [f"{path}: no signature to compare with NVRx's {theirs}"]
    ours = _Ours(params)
    problems = []
    index: int | None = 0
    for name in theirs:
        if name == "*" or (name.startswith("*") and not name.startswith("**")):
            index = None  # what follows is keyword-only
        problem = _one_parameter(path, name, index, ours, used) if name != "*" else None
        if problem:
            problems.append(problem)
        if index is not None:
            index += 1
    for name in older:
        if not ours.takes_keyword(name) and not _excepted(f"{path}({name})", used):
            problems.append(f"{path}: parameter {name!r} of an older NVRx is not accepted")
    named = {n.lstrip("*") for n in theirs} | set(older)
    for p in params:
        if p.name not in named and p.default is inspect.Parameter.empty and p.kind not in _VARIADIC:
            problems.append(f"{path}: parameter {p.name!r}, which NVRx lacks, has no default")
    return problems


def _excepted(key: str, used: set[str]) -> bool:
    if key in EXCEPTIONS:
        used.add(key)
        return True
    return False


def _enum_problems(path: str, obj: type, entry: dict[str, Any]) -> list[str]:
    if not issubclass(obj, enum.Enum):
        return [f"{path}: expected an enum"]
    missing = [m for m in entry["members"] if m not in obj.__members__]
    return [f"{path}: members {missing} missing"] if missing else []


def _exception_problems(path: str, obj: type, entry: dict[str, Any], used: set[str]) -> list[str]:
    if not issubclass(obj, BaseException):
        return [f"{path}: expected an exception class"]
    base = entry["bases"][0]
    bases = [c.__name__ for c in obj.__mro__[1:]]
    if base not in bases and not _excepted(f"{path}:base", used):
        return [f"{path}: NVRx derives it from {base}, here its bases are {bases}"]
    return []


def _method_params(obj: type, method: str) -> list[inspect.Parameter] | None:
    """The parameters a caller passes to ``obj().method`` (None: it is an attribute here, not a method)."""
    found = inspect.getattr_static(obj, method)
    if isinstance(found, property):
        return None
    params = _sig(getattr(obj, method))
    unbound = not isinstance(found, (staticmethod, classmethod))
    if params and unbound and params[0].name == "self":
        params = params[1:]
    return params


def _class_problems(path: str, obj: type, entry: dict[str, Any], used: set[str]) -> list[str]:
    problems = []
    if entry.get("init") is not None:
        problems += parameter_problems(path, entry["init"], _sig(obj), entry.get("older", {}).get("init", []), used)
    if entry.get("call") is not None:
        params = _method_params(obj, "__call__")
        problems += parameter_problems(f"{path}.__call__", entry["call"], params, [], used)
    for method, theirs in entry.get("methods", {}).items():
        method_path = f"{path}.{method}"
        if _excepted(method_path, used):
            continue
        if inspect.getattr_static(obj, method, None) is None:
            problems.append(f"{method_path}: missing")
            continue
        params = _method_params(obj, method)
        if params is not None:  # a property here where NVRx has a method taking nothing: nothing to call
            problems += parameter_problems(method_path, theirs, params, [], used)
    return problems


def entry_problems(module: Any, module_name: str, name: str, entry: dict[str, Any], used: set[str]) -> list[str]:
    """Everything about one NVRx name that inprocess's ``module`` does differently."""
    path = f"{module_name}.{name}"
    if _excepted(path, used):
        return []
    if not hasattr(module, name):
        return [f"{path}: missing (NVRx {', '.join(entry['versions'])}: {entry['kind']})"]
    obj = getattr(module, name)
    kind = entry["kind"]
    if kind == "module":
        return [] if isinstance(obj, types.ModuleType) else [f"{path}: expected a module, found {obj!r}"]
    if kind == "value":
        return [] if isinstance(obj, typing.TypeVar) else [f"{path}: expected a TypeVar, found {obj!r}"]
    if kind == "function":
        if not callable(obj):
            return [f"{path}: expected a function, found {obj!r}"]
        return parameter_problems(path, entry["params"], _sig(obj), entry.get("older", {}).get("params", []), used)
    if not isinstance(obj, type):
        return [f"{path}: expected a class, found {obj!r}"]
    if kind == "enum":
        return _enum_problems(path, obj, entry)
    if kind == "exception":
        return _exception_problems(path, obj, entry, used)
    return _class_problems(path, obj, entry, used)


def module_problems(module_name: str, used: set[str]) -> list[str]:
    if _excepted(module_name, used):
        return []
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        return [f"{module_name}: cannot be imported: {e}"]
    problems = []
    for name, entry in sorted(SURFACE[module_name].items()):
        problems += entry_problems(module, module_name, name, entry, used)
    return problems


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module_name", sorted(SURFACE))
def test_every_public_name_of_nvrx_is_here_with_its_parameters(module_name: str) -> None:
    problems = module_problems(module_name, set())
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(120)
def test_every_exception_is_still_needed_and_says_why() -> None:
    used: set[str] = set()
    for module_name in SURFACE:
        module_problems(module_name, used)
    unneeded = sorted(set(EXCEPTIONS) - used)
    assert unneeded == [], f"exceptions no longer needed, remove them: {unneeded}"
    assert all(len(reason) > 40 for reason in EXCEPTIONS.values())


@pytest.mark.timeout(60)
def test_the_comparison_reports_what_differs() -> None:
    """The checks above can fail: a missing name, a renamed or reordered parameter, a new required one."""

    class Hook:
        def __init__(self, timeout: float, function: Any, args: tuple[Any, ...] = ()) -> None: ...

        def __call__(self, state: Any) -> Any: ...

    fake = types.SimpleNamespace(Hook=Hook)
    entry = {"kind": "class", "versions": ["x"], "init": ["timeout", "fn", "args", "kwargs"], "call": ["state"]}
    problems = entry_problems(fake, "fake", "Hook", entry, set())
    assert any("'fn' is missing" in p for p in problems), problems
    assert any("'kwargs' is missing" in p for p in problems), problems
    assert any("'function', which NVRx lacks, has no default" in p for p in problems), problems
    assert entry_problems(fake, "fake", "Gone", {"kind": "function", "versions": ["x"], "params": []}, set()) == [
        "fake.Gone: missing (NVRx x: function)"]
    reordered = {"kind": "class", "versions": ["x"], "init": ["function", "timeout"]}
    assert any("positional parameter 0 is 'function', here it is 'timeout'" in p
               for p in entry_problems(fake, "fake", "Hook", reordered, set()))
    # A real name taken away from inprocess is reported.
    import inprocess.abort

    module = types.SimpleNamespace(**{k: v for k, v in vars(inprocess.abort).items() if k != "AbortTransformerEngine"})
    missing = entry_problems(module, "inprocess.abort", "AbortTransformerEngine",
                             SURFACE["inprocess.abort"]["AbortTransformerEngine"], set())
    assert missing and "missing" in missing[0]


# -- the names added for NVRx behave as NVRx documents them ---------------------------------------


def _state(rank: int = 0, world_size: int = 1) -> Any:
    import inprocess

    return inprocess.FrozenState(rank=rank, world_size=world_size)


@pytest.mark.timeout(60)
def test_threaded_finalize_calls_fn_with_its_args_and_kwargs_not_the_state() -> None:
    import datetime

    from inprocess.exception import TimeoutError as RestartTimeout
    from inprocess.finalize import ThreadedFinalize

    calls: list[tuple[Any, ...]] = []
    timeout = datetime.timedelta(seconds=5)
    ThreadedFinalize(timeout, lambda: calls.append(()))(_state())  # Megatron's no-argument destroy_state
    ThreadedFinalize(timeout, lambda a, b, c=0: calls.append((a, b, c)), args=(1, 2), kwargs={"c": 3})(_state())
    ThreadedFinalize(timeout, lambda *a: calls.append(a), args=None, kwargs=None)(_state())
    assert calls == [(), (1, 2, 3), ()]
    with pytest.raises(RestartTimeout, match="did not return within 0.2s"):
        ThreadedFinalize(datetime.timedelta(seconds=0.2), __import__("time").sleep, args=(2,))(_state())
    with pytest.raises(ValueError, match="args=\\[1\\]: expected a tuple"):
        ThreadedFinalize(timeout, print, args=[1])  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_fault_counter_raises_fault_counter_exceeded_past_max_rank_faults() -> None:
    import dataclasses

    from inprocess.exception import RestartError
    from inprocess.health_check import FaultCounter, FaultCounterExceeded

    counter = FaultCounter(max_rank_faults=1)
    failed = dataclasses.replace(_state(), fn_exception=RuntimeError("step failed"))
    counter(_state())  # a restart caused elsewhere: not counted
    counter(failed)
    assert counter.faults_count == 1
    with pytest.raises(FaultCounterExceeded, match="raised 2 faults, more than max_rank_faults=1"):
        counter(failed)
    assert issubclass(FaultCounterExceeded, RestartError)


@pytest.mark.timeout(60)
def test_barrier_errors_are_nvrx_names_and_what_was_raised_before() -> None:
    import builtins

    import inprocess
    from inprocess.store import BarrierError, BarrierOverflow, BarrierTimeout

    assert issubclass(BarrierTimeout, BarrierError) and issubclass(BarrierOverflow, BarrierError)
    assert issubclass(BarrierError, inprocess.RestartError)
    # What a barrier raised before these names existed still catches them.
    assert issubclass(BarrierTimeout, inprocess.TimeoutError) and issubclass(BarrierTimeout, builtins.TimeoutError)
    assert issubclass(BarrierOverflow, inprocess.InternalError)
    assert issubclass(inprocess.RankDiscarded, inprocess.RestartError)  # an Exception, as there


@pytest.mark.timeout(60)
def test_abort_hooks_of_optional_libraries_do_nothing_without_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from inprocess.abort import AbortPersistentCheckpointProcesses, AbortTransformerEngine

    for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.fp8",
                 "nvidia_resiliency_ext", "nvidia_resiliency_ext.checkpointing",
                 "nvidia_resiliency_ext.checkpointing.async_ckpt",
                 "nvidia_resiliency_ext.checkpointing.async_ckpt.core"):
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: the import fails
    state = _state()
    assert AbortTransformerEngine()(state) is state
    assert AbortPersistentCheckpointProcesses()(state) is state


@pytest.mark.timeout(60)
def test_abort_hooks_call_what_the_libraries_provide(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fakes of the two entry points NVRx's hooks call: TransformerEngine's
    ``transformer_engine.pytorch.module.base.destroy_ub()`` and ``transformer_engine.pytorch.fp8.
    FP8GlobalStateManager.reset()`` (TE's transformer_engine/pytorch/module/base.py and fp8.py, as
    NVRx's abort.py calls them), and nvidia_resiliency_ext's ``checkpointing/async_ckpt/core.py:
    abort_nvrx_checkpoint()``."""
    from inprocess.abort import AbortPersistentCheckpointProcesses, AbortTransformerEngine

    called: list[str] = []
    te = types.ModuleType("transformer_engine.pytorch")
    te.module = types.SimpleNamespace(base=types.SimpleNamespace(destroy_ub=lambda: called.append("destroy_ub")))  # type: ignore[attr-defined]
    fp8 = types.ModuleType("transformer_engine.pytorch.fp8")
    fp8.FP8GlobalStateManager = types.SimpleNamespace(reset=lambda: called.append("fp8 reset"))  # type: ignore[attr-defined]
    core = types.ModuleType("nvidia_resiliency_ext.checkpointing.async_ckpt.core")
    core.abort_nvrx_checkpoint = lambda: called.append("abort_nvrx_checkpoint")  # type: ignore[attr-defined]
    for name, module in (("transformer_engine", types.ModuleType("transformer_engine")),
                         ("transformer_engine.pytorch", te), ("transformer_engine.pytorch.fp8", fp8),
                         ("nvidia_resiliency_ext.checkpointing.async_ckpt.core", core)):
        monkeypatch.setitem(sys.modules, name, module)
    AbortTransformerEngine()(_state())
    AbortPersistentCheckpointProcesses()(_state())
    assert called == ["destroy_ub", "fp8 reset", "abort_nvrx_checkpoint"]


@pytest.mark.timeout(60)
def test_nested_restarter_hooks_take_nvrx_keywords() -> None:
    from inprocess.nested_restarter import (
        NestedRestarterAborted,
        NestedRestarterCallback,
        NestedRestarterFinalized,
        NestedRestarterHandlingStarting,
        NestedRestarterLogger,
    )

    lines: list[tuple[int | None, str]] = []

    class Recorder:
        rank: int | None = None

        def set_connected_rank(self, rank: int | None) -> None:
            self.rank = rank

        def log_for_restarter(self, message: str) -> None:
            lines.append((self.rank, message))

    recorder = Recorder()
    NestedRestarterHandlingStarting(logger=recorder, special_rank=1)(_state(1, 2))
    NestedRestarterHandlingStarting(logger=recorder, special_rank=1)(_state(0, 2))  # not the special rank
    NestedRestarterFinalized(restarter_stage="done", logger=recorder)(_state())
    NestedRestarterAborted(restarter_state="gone", logger=recorder)(_state())
    NestedRestarterCallback("custom", "stage", recorder, 0)(_state())
    assert lines == [(1, "[NestedRestarter] name=[InProcess] state=handling stage=starting"),
                     (0, "[NestedRestarter] name=[InProcess] state=finalized stage=done"),
                     (0, "[NestedRestarter] name=[InProcess] state=gone"),
                     (0, "[NestedRestarter] name=[InProcess] state=custom stage=stage")]
    logger = NestedRestarterLogger()
    assert logger.name == "InprocessRestarter" and logger.restarter_logger.name == "InprocessRestarter.Restarter"
    # The contract line's handler holds the sys.stdout of the first test that made it (once per
    # process), not this test's captured one: read it through a stream of this test's own. It is
    # the handler the library marked: other tests may leave handlers of their own on that logger
    # (a fresh-clone run of the whole suite found two StreamHandlers there).
    (handler,) = [h for h in logger.restarter_logger.handlers if getattr(h, "_inprocess_nested_restarter", False)]
    assert isinstance(handler, logging.StreamHandler)
    buffer = io.StringIO()
    previous = handler.setStream(buffer)
    try:
        NestedRestarterFinalized(logger=logger)(_state())
    finally:
        handler.setStream(previous)
    assert buffer.getvalue().rstrip().endswith("[NestedRestarter] name=[InProcess] state=finalized")
    with pytest.raises(ValueError, match="logger=.*expected an object with set_connected_rank"):
        NestedRestarterFinalized(logger=object())


@pytest.mark.timeout(60)
def test_nodes_activate_bounded_and_propagate_terminations() -> None:
    import inprocess
    from inprocess.rank_assignment import Layer, LayerFlag, Node, bounded_activate, propagate_terminations

    # Two hosts of three ranks; at most 4 active in all, 2 per host; a host with fewer than 2 healthy goes.
    root = Node(None, "job", Layer(max_ranks=4, flag=LayerFlag.RESERVE), None)
    hosts = [root.add_child(f"host{h}", Layer(min_ranks=2, max_ranks=2, flag=LayerFlag.BACKFILL), None)
             for h in range(2)]
    leaves = [hosts[r // 3].add_child(r, None, inprocess.State(r, 6)) for r in range(6)]
    assert bounded_activate(root, 0) == 4
    assert [leaf.state.mode.name for leaf in leaves] == ["ACTIVE", "ACTIVE", "INACTIVE"] * 2
    assert [leaf.state.active_rank for leaf in leaves] == [0, 1, None, 2, 3, None]
    assert set(root.inactive_nodes) == {2, 5} and set(hosts[1].inactive_nodes) == {5}
    leaves[3].terminate()
    assert set(root.inactive_nodes) == {2, 5}  # an active rank's termination frees no spare
    # host1: rank 3 terminated, 4 leaving, 1 healthy < min_ranks=2: its ranks not terminated yet go too.
    assert propagate_terminations(root, {4}) == {4, 5}
    leaves[0].assign_backfill_domain()
    assert leaves[0].backfill_domain is hosts[0]
    assert [leaf.name for leaf in root.iter_leaves()] == list(range(6)) and not root.is_leaf()


@pytest.mark.timeout(60)
def test_a_grouping_key_may_be_any_hashable_value_of_this_rank() -> None:
    from inprocess.rank_assignment import FilterCountGroupedByKey, Layer

    state = _state(5, 8)
    assert FilterCountGroupedByKey(key_or_fn=5 // 2, condition=bool).local_keys(state) == ("2",)
    assert FilterCountGroupedByKey(key_or_fn=lambda s: s.rank // 2, condition=bool).local_keys(state) == ("2",)
    assert FilterCountGroupedByKey(key_or_fn=("rack", 1), condition=bool).local_keys(state) == ("('rack', 1)",)
    with pytest.raises(ValueError) as info:
        Layer(key_or_fn=["not", "hashable"])
    message = str(info.value)
    assert "key_or_fn=['not', 'hashable'] (list) is not hashable" in message
    assert "same on every rank" not in message and "ranks with equal keys form one group" in message


@pytest.mark.timeout(60)
def test_a_per_rank_assignment_whose_peers_never_come_raises_barrier_timeout() -> None:
    """Called per rank outside the Wrapper, FilterCountGroupedByKey meets the other ranks in the store,
    as NVRx's does at its store barrier, and raises what that barrier raises when they do not come."""
    import datetime

    import torch.distributed as dist

    import inprocess
    from inprocess.rank_assignment import FilterCountGroupedByKey, RankAssignmentCtx
    from inprocess.store import BarrierTimeout

    assignment = FilterCountGroupedByKey(key_or_fn=0, condition=bool, timeout=datetime.timedelta(seconds=0.2))
    with pytest.raises(BarrierTimeout, match=r"ranks \[1\] of \[0, 1\] did not publish"):
        assignment(RankAssignmentCtx(inprocess.State(rank=0, world_size=2), dist.HashStore(), set()))
