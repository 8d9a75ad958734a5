"""Communication: what crosses between tasks in a step.

Each gradient routed where it is summed (routing.py): sparse aggregation per worker and
on the PS (aggregation.py), the dense sum on the PS or by all-reduce
(hierarchical_allreduce.py); what rides with the gradients (riders.py); clipping of
summed gradients (clipping.py) and the order of side effects per task (side_effects.py).
What one task sends another in an exchange crosses as one tensor (sharding/wire.py).
"""
