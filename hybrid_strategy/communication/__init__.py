"""Communication: what crosses between tasks in a step.

Sparse aggregation per worker and on the PS (aggregation.py), the dense sum
(hierarchical_allreduce.py), the wire dtype of rows (wire.py), clipping of summed
gradients (clipping.py) and the order of side effects per task (side_effects.py).
"""
