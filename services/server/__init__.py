"""What runs only in a state server (one Ray actor per host): the actor, its gRPC
service and the bulk socket's server end, in front of the segment store
(:mod:`cargohold.services.segments`). Nothing here imports :mod:`cargohold.services.worker`."""
