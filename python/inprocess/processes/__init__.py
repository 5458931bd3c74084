"""The processes a job starts beside its training ranks: a monitor per rank,
the store host (the TCPStore server, once per job) and a node agent per node.
Each is a ``python -m`` entry point and a console script; only the store host
imports torch. :mod:`.contract` is what each is told (a frozen config per
process), the ``main`` the three share, and the handle a rank holds on one.
"""
