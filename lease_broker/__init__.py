"""jupyter-gpulease lease broker: owns the GPU inventory and grants time-limited leases."""

__version__ = "0.1.0"
