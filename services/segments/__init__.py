"""The segment store: each segment's AdamW state in its tiers and the update that changes
it, wherever the state is held (a state server, a worker's device segments, the Python
API in one process)."""
