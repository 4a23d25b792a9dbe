"""``cargohold plan``: the memory each tier needs and the bytes each step moves, from the
config and a cluster description, before anything is launched.

    cargohold plan --config examples/demo.yaml --host-memory 16GiB
    cargohold plan --config examples/llama-13b-1gpu.yaml --device-memory 24GiB --host-memory 256GiB --nvme 2TiB
    cargohold plan --config train.yaml --device-memory 80GiB --host-memory 480GiB --nvme 100GiB --json
    cargohold plan --config train.yaml --cluster cluster.yaml      # node groups, see ClusterDescription

Exit status: 0 when every checked resource fits, 3 when one does not (the reason is
printed per resource), 2 for a bad config or cluster description.

The modules, one concern each:

* :mod:`.description`: the cluster (``ClusterDescription``, ``NodeGroup``, ``load_cluster``);
* :mod:`.worker` and :mod:`.activations`: one worker's memory and traffic;
* :mod:`.server`: one state server's memory and traffic;
* :mod:`.checks`: each resource's need against what the cluster has;
* :mod:`.run`: the whole plan (``RunPlan``, ``plan_run``);
* :mod:`.render` and :mod:`.command`: the table and the command line.

Everything is computed from the same code a run uses: the model is built on the meta
device and cut into FSDP2 units and laid out by ``model_layout`` (what every worker
does), and each state server's partitions are placed by the tier planner itself
(``plan_tiers`` over the same ``PartitionDemand`` list ``TieredStorage`` builds). So:

* a worker's **buffers** (``weights``: its FSDP2 shards, the most any rank holds;
  ``exchange``: ``tuning.worker.exchange_slots`` gradient and weight slots of the largest unit,
  and the weights of its whole range with the delayed update) are
  exactly the sizes ``TrainingWorker.resident_bytes()`` reports;
* a state server's **state in RAM / on NVMe** (12 bytes per element) is exactly what it
  reports as ``cargohold_state_resident_bytes{tier}`` once every partition sits in its
  planned tier (partitions move after their first update); the **memory** those
  partitions occupy is their 4 KiB-aligned file layout (header and padding: at most
  16 KiB more per partition), which is what the RAM tier allocates and what the files
  hold on disk;
* push and fetch bytes are what the workers count in ``cargohold_transport_*_bytes_total``.

Estimates and bounds, said as such in the output: activations (a formula, see
:func:`~.activations.activation_bytes_estimate`), units in flight and per-step
temporaries (upper bounds: everything FSDP2 and the step may hold at once, counted as if
at the same moment), the state servers' per-step temporaries (every transfer a server may
hold at once), NVMe reads (at most every disk partition; those still in a staging buffer
from the previous step are not read again). Not counted at all: the Python/torch/Ray
runtime of each process (~0.5-1 GiB), the CUDA context and allocator caching and
fragmentation, NCCL's buffers, Ray's object store, and anything else running on the node.
"""
