"""A custom per-rank rank assignment and Compose in the forms nvidia_resiliency_ext documents.

Written against that library's API, as its users write it; only the import
line changed:

* ``LoggingAssignment`` is a ``RankAssignment`` subclass with
  ``__call__(self, ctx)``: it reads ``ctx.state`` and ``ctx.terminated_ranks``
  (what it saw is recorded) and returns what its inner composition returns;
* the Wrapper's ``rank_assignment`` composes it with built-ins:
  ``Compose(MaxActiveWorldSize(n), ActivateAllRanks(), ShiftRanks(),
  LoggingAssignment())``, applied right to left: the last initial rank is a
  spare while ``n`` is less than the world size;
* ``initialize`` is ``Compose(RetryController(...), Init())`` and must be an
  ``Initialize`` (the common base of its members); ``finalize`` composes two
  ``Finalize`` hooks that run right to left; the no-argument, several-argument
  and None-returning forms of Compose are called directly and recorded.

MIGRATION_OUT as in basic.py; MIGRATION_FAULT ("<rank>:<step>:<kind>", kind
``raise`` or ``exit``): that rank raises, or ends its process with
``os._exit(3)``, at that step of the first iteration; MIGRATION_MAX_ACTIVE the
``MaxActiveWorldSize`` bound; MIGRATION_RA_RAISES=1: the custom assignment
raises at the restart.
"""

import datetime
import json
import os
import pathlib
import warnings

import torch

import inprocess  # was: import nvidia_resiliency_ext.inprocess as inprocess

OUT = pathlib.Path(os.environ["MIGRATION_OUT"])
_rank, _step, FAULT_KIND = os.environ.get("MIGRATION_FAULT", "-1:-1:raise").split(":")
FAULT_RANK, FAULT_STEP = int(_rank), int(_step)
MAX_ACTIVE = int(os.environ["MIGRATION_MAX_ACTIVE"])
RA_RAISES = os.environ.get("MIGRATION_RA_RAISES") == "1"
INITIAL_RANK = int(os.environ["RANK"])
seen = {"assignment": [], "finalize": [], "iterations": [], "compose": {}}


class LoggingAssignment(inprocess.rank_assignment.RankAssignment):
    """A pass-through that records what it was given."""

    def __call__(self, ctx):
        if RA_RAISES and seen["iterations"]:
            raise ValueError("rank assignment failed at the restart")
        entry = [ctx.state.iteration, sorted(ctx.terminated_ranks)]
        if entry not in seen["assignment"]:
            seen["assignment"].append(entry)
        return ctx


class Init(inprocess.initialize.Initialize):
    def __call__(self, state):
        return state


class FinalizeFirst(inprocess.finalize.Finalize):
    def __call__(self, state):
        seen["finalize"].append("first")
        return state


class FinalizeSecond(inprocess.finalize.Finalize):
    def __call__(self, state):
        seen["finalize"].append("second")
        return state


class Forty(inprocess.initialize.Initialize):
    def __call__(self, *args):
        return 41 if not args else args


class PlusOne(inprocess.initialize.Initialize):
    def __call__(self, x):
        return x + 1


class Sum(inprocess.initialize.Initialize):
    def __call__(self, *args):
        return sum(args)


class ReturnsNone(inprocess.initialize.Initialize):
    def __call__(self, x):
        return None


class Identity(inprocess.initialize.Initialize):
    def __call__(self, x):
        return x


def compose_forms():
    """Compose called the three ways its documentation allows, outside the wrapper."""
    ra = inprocess.rank_assignment
    forms = seen["compose"]
    forms["no_argument"] = inprocess.Compose(PlusOne(), Forty())()
    forms["several_arguments"] = inprocess.Compose(Sum(), Forty())(1, 2, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inprocess.Compose(Identity(), ReturnsNone())(1)
    forms["none_warns"] = len(caught) >= 1
    forms["is_rank_assignment"] = isinstance(
        inprocess.Compose(ra.ActivateAllRanks(), ra.ShiftRanks()), ra.RankAssignment
    )


initialize = inprocess.Compose(inprocess.initialize.RetryController(max_iterations=5), Init())
ra = inprocess.rank_assignment
rank_assignment = inprocess.Compose(
    ra.MaxActiveWorldSize(MAX_ACTIVE), ra.ActivateAllRanks(), ra.ShiftRanks(), LoggingAssignment()
)
seen["initialize_is_initialize"] = isinstance(initialize, inprocess.initialize.Initialize)


@inprocess.Wrapper(
    initialize=initialize,
    finalize=inprocess.Compose(FinalizeSecond(), FinalizeFirst()),
    rank_assignment=rank_assignment,
    soft_timeout=datetime.timedelta(seconds=20),
    hard_timeout=datetime.timedelta(seconds=30),
    barrier_timeout=datetime.timedelta(seconds=60),
    completion_timeout=datetime.timedelta(seconds=60),
)
def train(call_wrapper: inprocess.CallWrapper | None = None):
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    seen["iterations"].append([call_wrapper.iteration, rank, world_size])
    # The application's own store (MASTER_PORT + 1), hosted by whichever rank is 0; a prefix per iteration.
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1,
                                       is_master=rank == 0, multi_tenant=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=20))
    store = torch.distributed.PrefixStore(f"iteration{call_wrapper.iteration}", store)
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                         timeout=datetime.timedelta(seconds=10))
    total = torch.zeros(1)
    for step in range(8):
        if call_wrapper.iteration == 0 and (INITIAL_RANK, step) == (FAULT_RANK, FAULT_STEP):
            if FAULT_KIND == "exit":
                os._exit(3)
            raise RuntimeError(f"fault at {step=} on initial rank {INITIAL_RANK}")
        t = torch.ones(1)
        torch.distributed.all_reduce(t)
        total += t
    torch.distributed.destroy_process_group()
    return {"rank": rank, "world_size": world_size, "sum": float(total.item())}


compose_forms()
try:
    seen["outcome"] = {"returned": train()}
except BaseException as e:  # recorded for the test
    seen["outcome"] = {"raised": type(e).__name__, "message": str(e)}
(OUT / f"rank{INITIAL_RANK}.json").write_text(json.dumps(seen))
