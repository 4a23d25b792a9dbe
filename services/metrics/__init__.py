"""Every Prometheus metric cargohold exports.

Each process (a state server, a training worker, the driver) owns one metrics object
(:mod:`.server`, :mod:`.worker`, :mod:`.launcher`) with its own ``CollectorRegistry``
rather than prometheus_client's global default registry, so that a test (or one process
hosting several roles) can hold several without their values mixing or their names
clashing. The registry is served over HTTP (:mod:`.http`) on an explicit host, 127.0.0.1
unless told otherwise: a metrics port open on every interface is an easy leak.

Every series carries one identity label, ``server`` (state servers) or ``rank`` (workers),
bound at construction. The transport byte counters have the same names on both sides so
a dashboard can sum traffic over the cluster and split it by that label. :mod:`.names` is
the catalogue: the only ``cargohold_`` names dashboards may use.

Per-step numbers belong here, not in the logs.
"""
