"""The project's benchmarks.

Most are scripts (``python benchmarks/<name>.py``). The control-plane
simulator is a package, :mod:`benchmarks.control_plane`, which the tests import
from the repository root (pytest's ``pythonpath`` setting puts it on the path).
"""
