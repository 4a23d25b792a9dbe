"""Tiered storage of a state server's optimizer state: RAM, then NVMe files.

Pure logic (partition math, the planner, the file format) lives apart from the I/O
(the NVMe tier, the I/O pool, the pipeline); :mod:`.storage` puts them together.
"""
