"""Invalid Wrapper configuration is refused with a ValueError that names the value."""

from __future__ import annotations

import datetime

import pytest

import inprocess

pytestmark = pytest.mark.timeout(30)
td = datetime.timedelta


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"soft_timeout": 5}, "soft_timeout=5 (int): expected a datetime.timedelta"),
        ({"barrier_timeout": "60s"}, "barrier_timeout='60s' (str)"),
        ({"hard_timeout": td(seconds=-1)}, "hard_timeout=-1s: expected a duration > 0"),
        ({"heartbeat_interval": td(0)}, "heartbeat_interval=0s: expected a duration > 0"),
        ({"last_call_wait": td(seconds=-0.5)}, "last_call_wait=-0.5s: expected a duration >= 0"),
        ({"soft_timeout": td(seconds=100), "hard_timeout": td(seconds=90)},
         "soft_timeout=100s must be less than hard_timeout=90s"),
        ({"monitor_thread_interval": td(seconds=70)}, "monitor_thread_interval=70s must be less than soft_timeout=60s"),
        ({"progress_watchdog_interval": td(seconds=60)},
         "progress_watchdog_interval=60s must be less than soft_timeout=60s"),
        ({"heartbeat_interval": td(seconds=60), "heartbeat_timeout": td(seconds=30)},
         "heartbeat_interval=60s must be less than heartbeat_timeout=30s"),
        ({"monitor_process_interval": td(seconds=90)},
         "monitor_process_interval=90s must be less than heartbeat_timeout=60s"),
        ({"barrier_timeout": td(seconds=90)},
         "hard_timeout=90s + termination_grace_time=5s must be less than barrier_timeout=90s"),
        ({"enabled": "yes"}, "enabled='yes' (str): expected True or False"),
        ({"initialize": 3}, "initialize=3 (int): expected a callable or None"),
        ({"health_check": "check"}, "health_check='check' (str)"),
        ({"store_kwargs": [1]}, "store_kwargs=[1]: expected a dict"),
        ({"store_factory": None}, "store_factory=None (NoneType)"),
        ({"monitor_process_pidfile": 7}, "monitor_process_pidfile=7 (int): expected a path"),
        ({"rank_assignment": None}, "rank_assignment=None"),
        ({"rank_assignment": lambda ctx: ctx}, "expected inprocess.rank_assignment.RankAssignment"),
    ],
)
def test_invalid_configuration_names_the_value(kwargs, fragment):
    with pytest.raises(ValueError) as info:
        inprocess.Wrapper(**kwargs)
    assert fragment in str(info.value)


def test_defaults_are_valid_and_ordered():
    w = inprocess.Wrapper()
    t = w.timeouts
    assert t.progress_watchdog_interval < t.soft_timeout < t.hard_timeout < t.barrier_timeout
    assert t.heartbeat_interval < t.heartbeat_timeout


@pytest.mark.parametrize(
    "factory, fragment",
    [
        (lambda: inprocess.initialize.RetryController(max_iterations=0), "max_iterations=0: expected an int >= 1"),
        (lambda: inprocess.initialize.RetryController(min_world_size=True), "min_world_size=True"),
        (lambda: inprocess.health_check.FaultCounter(-1), "max_rank_faults=-1"),
        (lambda: inprocess.rank_assignment.MaxActiveWorldSize(0), "max_active_world_size=0"),
        (lambda: inprocess.rank_assignment.ActiveWorldSizeDivisibleBy(2.0), "divisor=2.0"),
        (lambda: inprocess.Compose(), "at least one instance"),
        (lambda: inprocess.Compose(1), "Compose argument 0=1 (int) is not callable"),
        (lambda: inprocess.finalize.ThreadedFinalize(td(0), print), "timeout=datetime.timedelta(0)"),
    ],
)
def test_invalid_hook_arguments_name_the_value(factory, fragment):
    with pytest.raises(ValueError) as info:
        factory()
    assert fragment in str(info.value)


def test_each_wait_has_a_budget_in_seconds_derived_from_its_keyword():
    t = inprocess.Wrapper(soft_timeout=td(seconds=10), hard_timeout=td(seconds=12), barrier_timeout=td(seconds=20),
                          heartbeat_timeout=td(seconds=45)).timeouts
    budgets = {
        "barrier_wait_s": 20.0, "abort_wait_s": 20.0, "release_wait_s": 20.0, "monitor_store_op_s": 20.0,
        "monitor_barrier_wait_s": 20.0, "agent_store_op_s": 20.0, "agent_connect_s": 20.0, "store_host_idle_s": 45.0,
    }
    got = {name: getattr(t, name) for name in budgets}
    assert got == budgets and all(type(v) is float for v in got.values())
    # The agent's connect budget is capped: a rank does not wait minutes for an agent it can do without.
    assert inprocess.Wrapper(barrier_timeout=td(seconds=300)).timeouts.agent_connect_s == 30.0
    # Every budget is documented in the Timeouts docstring.
    doc = type(t).__doc__ or ""
    assert all(f"``{name}``" in doc for name in budgets)
