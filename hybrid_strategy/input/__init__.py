"""Input: how each worker reads its share of a dataset.

The sharding plan (input_plan.py, input_graph.py), each worker's own iterators
(worker_input.py), numpy arrays (array_input.py), the tf.data service
(service_input.py) and the end-of-data check (end_of_data.py).
"""
