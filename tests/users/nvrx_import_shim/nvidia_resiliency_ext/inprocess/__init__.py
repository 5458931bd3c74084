"""``import nvidia_resiliency_ext.inprocess as inprocess`` gives this project's ``inprocess`` (the module
object itself, so its submodules and every attribute are ours), for running NVRx's published examples
unchanged (tests/test_nvrx_examples.py)."""

import sys

import inprocess as _ours

sys.modules[__name__] = _ours
