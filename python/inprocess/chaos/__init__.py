"""Chaos with invariants: faults of every kind at random, and a checker of what must never happen.

* :mod:`inprocess.chaos.invariants`: the invariants, checked from a job's events
  (``python -m inprocess.chaos check DIR``);
* :mod:`inprocess.chaos.schedule`: a seeded schedule of faults, joiners and grow points;
* :mod:`inprocess.chaos.runner`: runs a job under a schedule and checks it
  (``python -m inprocess.chaos run --seed N``);
* :mod:`inprocess.chaos.simulator`: the control plane's own code under a deterministic scheduler
  (``python -m inprocess.chaos simulate``).

docs/chaos.md says how to use them.
"""
