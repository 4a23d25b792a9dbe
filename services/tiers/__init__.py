"""Tiered storage of a state server's optimizer state: RAM, then NVMe files.

Pure logic (partition math, the planner, the file format) lives apart from the I/O
(the NVMe tier, the I/O pool, the pipeline); :mod:`.tier_list` holds the tiers as a list,
fastest first, and :mod:`.storage` puts them together.
"""
