"""gpusched: GPU-aware scheduling for Apache Airflow on heterogeneous GPU fleets.

The vocabulary (catalog, fleet model, GPU requests, errors) is re-exported here; the policy,
edges and Airflow faces live in their sub-packages (see ARCHITECTURE.md).
"""

from gpusched.catalog import AcceleratorModel, Catalog, LinkKind, Vendor, default_catalog
from gpusched.errors import GPURequestError, GpuschedError
from gpusched.hardware.envexport import devices_env  # pure (vocabulary only): cheap at DAG parse
from gpusched.model import Device, DeviceSample, DeviceShare, DeviceUsage, FleetSnapshot, Health, Node
from gpusched.request import GPURequest, Interconnect, Partition

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
