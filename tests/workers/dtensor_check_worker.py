"""One process (a gloo world of 1): a snapshot of an FSDP2 module and its Adam state, loaded into
modules that do not fit it. Prints one JSON line: what each load raised, and whether the module's
parameters changed (they must not: the check comes before anything is loaded)."""

import collections
import datetime
import json

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from inprocess.peer_state.objects import Objects
from inprocess.peer_state.snapshot import load, take

store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
mesh = dist.device_mesh.init_device_mesh("cpu", (1,))


def model(names=("0", "1")):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 6), torch.nn.Linear(6, 4)]
    return torch.nn.Sequential(collections.OrderedDict(zip(names, layers, strict=True)))


def sharded(m):
    for layer in m:
        fully_shard(layer, mesh=mesh)
    return fully_shard(m, mesh=mesh)


def stepped(m):
    optimizer = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return optimizer


source = sharded(model())
first = stepped(source)
snapshot, finish = take(Objects("ShardedState", {"model": source, "optimizer": first}), {}, False, 1, None)
finish()
out = {}
targets = {
    "same": lambda: sharded(model()),
    "other_fqns": lambda: sharded(model(("0", "head"))),
    "other_placements": lambda: parallelize_module(model(), mesh, {"0": RowwiseParallel(), "1": RowwiseParallel()}),
    "plain": lambda: model(),
}


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


for name, build in targets.items():
    target = build()
    before = [full(t).clone() for t in target.state_dict().values()]
    optimizer = torch.optim.Adam(target.parameters())
    try:
        load(Objects("ShardedState", {"model": target, "optimizer": optimizer}), snapshot, False)
        error = None
    except RuntimeError as e:
        error = str(e)
    after = [full(t) for t in target.state_dict().values()]
    unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    equal = None
    if error is None:  # parameters and Adam state as the source's
        pairs = list(zip(target.parameters(), source.parameters(), strict=True))
        equal = all(torch.equal(full(a), full(b)) for a, b in pairs) and all(
            torch.equal(full(optimizer.state[a][k]), full(first.state[b][k]))
            for a, b in pairs for k in ("step", "exp_avg", "exp_avg_sq"))
    out[name] = {"error": error, "unchanged": unchanged, "equal_to_source": equal}
dist.destroy_process_group()
print(json.dumps(out))
