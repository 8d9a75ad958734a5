"""Tables: the PS-resident, row-partitioned table type and what acts on it.

The table and its lookups (table.py), row-sparse optimizer updates on the PS
(sparse_optimizers.py), regularizers computed on the PS (penalties.py), table
checkpoints (checkpointing.py, row_blocks.py) and one read per step of a mirrored
variable (mirrored_reads.py).
"""
