"""One rank of a plain gloo job (no Wrapper) that restores a ReplicatedState from its holders:
argv rank, world, port, holders (comma-separated ranks), chunk_bytes, and optionally a staging
device ("cpu": the NCCL path's staged, batched transfer, here over gloo) and a number of sends
after which a holder SIGKILLs itself (staged only). Holders train two Adam steps and commit step 2;
the others (newcomers) have a fresh model and optimizer. Prints one JSON line: the step restored,
the record, a digest of the model, the Adam state and the plain values, whether the model's
parameters kept their storage (received in place), and the staged batches posted; or, when the
restore raised, the exception (and the process leaves at once: a peer is gone)."""

import datetime
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from peer_state_common import STAGED, raw_bytes, stage_replicated_through

import inprocess

rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
holders = [int(r) for r in sys.argv[4].split(",")]
if len(sys.argv) > 6:
    stage_replicated_through(sys.argv[6])
if len(sys.argv) > 7 and rank in holders:
    STAGED["die_after"] = int(sys.argv[7])
store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
state = inprocess.ReplicatedState(model=model, optimizer=optimizer, chunk_bytes=int(sys.argv[5]))
if rank in holders:
    for step in range(2):
        model(torch.randn(16, 64, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    state.commit(2, position=[2, "two"])
storage = [p.data_ptr() for p in model.parameters()]
try:
    step = state.restore()
except Exception as e:
    print(json.dumps({"exception": f"{type(e).__name__}: {e}", "staged": STAGED}), flush=True)
    os._exit(0)
h = hashlib.sha256()
for t in model.state_dict().values():
    h.update(raw_bytes(t))
for entry in optimizer.state.values():
    for key, value in sorted(entry.items()):
        h.update(key.encode() + raw_bytes(value))
h.update(json.dumps(state.values).encode())
done = state.last_restore
print(json.dumps({"step": step, "digest": h.hexdigest(), "source": done.source, "receivers": list(done.receivers),
                  "nbytes": done.nbytes, "sent": done.sent, "staged": STAGED,
                  "in_place": storage == [p.data_ptr() for p in model.parameters()]}))
dist.barrier()  # every rank done before any leaves (rank 0 serves the store)
dist.destroy_process_group()
