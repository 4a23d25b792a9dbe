"""What runs in a training worker (one Ray actor per accelerator): the FSDP2-sharded model
and its step, the weight window, the co-located collectives, and the port through which
the step reaches the state servers. Nothing here imports :mod:`cargohold.services.server`."""
