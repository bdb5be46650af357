"""The cost model the collectives choose algorithms with, and the probe that fits it to hosts."""
