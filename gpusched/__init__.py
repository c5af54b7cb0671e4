"""gpusched: GPU-aware scheduling for Apache Airflow on heterogeneous GPU fleets.

The vocabulary (catalog, fleet model, GPU requests, errors) is re-exported here; the policy,
edges and Airflow faces live in their sub-packages (see ARCHITECTURE.md).
"""

from typing import TYPE_CHECKING, Any

from gpusched.catalog import AcceleratorModel, Catalog, LinkKind, Vendor, default_catalog
from gpusched.errors import GPURequestError, GpuschedError
from gpusched.model import Device, DeviceSample, DeviceShare, DeviceUsage, FleetSnapshot, Health, Node
from gpusched.request import GPURequest, Interconnect, Partition

if TYPE_CHECKING:
    from gpusched.hardware.envexport import devices_env

__version__ = "0.1.0"  # the release; pyproject.toml reads it (one source)

__all__ = [
    "AcceleratorModel",
    "Catalog",
    "Device",
    "DeviceSample",
    "DeviceShare",
    "DeviceUsage",
    "FleetSnapshot",
    "GPURequest",
    "GPURequestError",
    "GpuschedError",
    "Health",
    "Interconnect",
    "LinkKind",
    "Node",
    "Partition",
    "Vendor",
    "__version__",
    "default_catalog",
    "devices_env",
]


def __getattr__(name: str) -> Any:
    if name == "devices_env":
        # Resolved on first use: parsing a DAG imports gpusched and must not load gpusched.hardware.
        from gpusched.hardware.envexport import devices_env

        return devices_env
    raise AttributeError(f"module 'gpusched' has no attribute {name!r}")
