"""Test harness only, never on the path of our own runs: with this folder on PYTHONPATH,
``import inprocess`` in a migration program loads nvidia_resiliency_ext.inprocess instead, so the
same unchanged program can be run under both libraries and their records compared."""

import sys

import nvidia_resiliency_ext.inprocess as _nvrx

sys.modules[__name__] = _nvrx
