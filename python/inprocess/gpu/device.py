"""Which GPU this rank uses: ``LOCAL_RANK`` selects it, as in NVRx.

CUDA numbers devices after ``CUDA_VISIBLE_DEVICES``; NVML numbers all of
them. So the CUDA ordinal is ``LOCAL_RANK`` itself, and NVML is given the
device's UUID or physical index from ``CUDA_VISIBLE_DEVICES`` where it is
set, or the PCI bus id the CUDA driver reports where that is known.
"""

from __future__ import annotations

import os
from typing import Optional


def cuda_ordinal(device: Optional[int] = None) -> int:
    """The CUDA device of this rank: `device`, else ``LOCAL_RANK``, else 0."""
    if device is not None:
        value: object = device
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"device={device!r}: expected a CUDA device ordinal >= 0")
        return value
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None:
        return 0
    try:
        ordinal = int(local_rank)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={local_rank!r}: expected an integer >= 0") from None
    if ordinal < 0:
        raise ValueError(f"LOCAL_RANK={local_rank!r}: expected an integer >= 0")
    return ordinal


def nvml_identifier(ordinal: int, pci_bus_id: str = "") -> str:
    """The NVML device (``index:N``, ``uuid:GPU-...`` or ``pci:BUS``) behind
    CUDA device `ordinal`."""
    if pci_bus_id:
        return f"pci:{pci_bus_id}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or visible.strip() == "":
        return f"index:{ordinal}"
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if ordinal >= len(entries):
        raise ValueError(
            f"CUDA device {ordinal} is not among CUDA_VISIBLE_DEVICES={visible!r} ({len(entries)} visible)"
        )
    entry = entries[ordinal]
    if entry.isdigit():
        return f"index:{entry}"
    if entry.startswith("GPU-"):
        return f"uuid:{entry}"
    raise ValueError(
        f"CUDA_VISIBLE_DEVICES entry {entry!r}: expected a device index or a GPU-... UUID "
        "(MIG devices are not supported by the NVML checks)"
    )
