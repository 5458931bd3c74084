"""Tools under the names NVRx users import them by: ``inprocess.tools.inject_fault``."""

from . import inject_fault

__all__ = ["inject_fault"]
