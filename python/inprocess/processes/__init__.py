"""The processes a job starts beside its training ranks: a monitor per rank,
the store host (the TCPStore server, once per job) and a node agent per node.
Each is a ``python -m`` entry point and a console script; only the store host
imports torch.
"""
