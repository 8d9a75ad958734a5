"""Sharding: how a table's rows and a step's values are split over tasks.

The bottom of the package, beneath tables, communication and placement, importing none
of them: which shard holds each row and how a gradient's rows are split and joined with
them (rows.py), and how everything one task sends another in an exchange crosses as one
tensor, in a wire dtype (wire.py).
"""
