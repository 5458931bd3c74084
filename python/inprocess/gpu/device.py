"""Which GPU this rank uses: ``LOCAL_RANK`` modulo the number of devices
this process can see, unless a device is given.

The modulo is the rule torch and Megatron-LM follow where a rank is not
told its device: torch's ``ProcessGroupNCCL::guessDeviceForRank``
(``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp``) takes
``rank_ % at::cuda::getNumGPUs()`` when no device is bound to the group,
Megatron-LM's ``_initialize_distributed`` (``megatron/initialize.py``) sets
``rank % torch.cuda.device_count()`` and asserts that ``LOCAL_RANK`` equals
it, and NVRx's flight-recorder collector
(``attribution/trace_analyzer/trace_collector.py``) takes
``rank % torch.cuda.device_count()``. It gives ``LOCAL_RANK`` itself on a
node whose processes each see every GPU, and device 0 where a launcher gives
each task one GPU of its own (SLURM ``--gpus-per-task=1``: ``LOCAL_RANK=3``
with one visible device is CUDA device 0, not the invalid device 3).

CUDA numbers devices after ``CUDA_VISIBLE_DEVICES``; NVML numbers all of
them. So NVML is given the PCI bus id the CUDA driver reports where that is
known, or else the device's UUID or physical index from
``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import os

# cuInit's answers that mean "no GPU here" rather than "a GPU in trouble":
# CUDA_ERROR_NO_DEVICE (100; also what CUDA_VISIBLE_DEVICES="" gives) and
# CUDA_ERROR_STUB_LIBRARY (34: the stub libcuda of a CUDA toolkit, no
# driver). cuda.h 12.9 lines 2525 and 2538.
NO_DEVICE_ERRORS = (100, 34)


def visible_in_environment() -> int | None:
    """How many devices ``CUDA_VISIBLE_DEVICES`` names (None where it is
    unset: then every device of the node is visible). Used where the CUDA
    driver cannot be asked."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    return len([e for e in visible.split(",") if e.strip()])


def torch_visible_devices() -> int | None:
    """How many devices this process sees, for code that runs beside torch's
    own use of CUDA (the NCCL abort, a finalize thread): torch's count where
    torch has initialised CUDA already (it creates no context), else
    :func:`visible_in_environment`. Asking torch before it initialised CUDA
    would initialise the runtime in a rank that may never use it."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return int(torch.cuda.device_count())
    return visible_in_environment()


def cuda_ordinal(device: int | None = None, visible: int | None = None) -> int:
    """The CUDA device of this rank: `device`, else ``LOCAL_RANK`` modulo
    `visible` (the devices this process sees; None: not known, taken as
    is), else 0."""
    if visible is not None and visible <= 0:
        raise ValueError(f"visible={visible!r}: expected at least one visible device")
    if device is not None:
        value: object = device
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"device={device!r}: expected a CUDA device ordinal >= 0")
        if visible is not None and value >= visible:
            raise ValueError(f"device={device!r}: this process sees {visible} CUDA device(s), 0 to {visible - 1}")
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
    return ordinal if visible is None else ordinal % visible


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
