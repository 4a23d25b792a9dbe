"""cargohold: train models larger than accelerator memory by offloading Adam state to
host state servers (RAM, then NVMe).

The distribution maps its folders onto this namespace: ``cargohold.services`` (workers,
state servers, tiers, transport), ``cargohold.cluster`` (Ray launcher and CLI) and
``cargohold.v1`` (the generated gRPC API). See docs/architecture.md.
"""

__version__ = "0.1.0"
