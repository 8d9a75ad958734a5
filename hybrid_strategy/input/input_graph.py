"""A dataset's graph, read into an `input_plan.Pipeline` and rewritten into each worker's share.

TensorFlow re-creates a distributed dataset on every worker from its serialized graph (a
GraphDef whose `_Retval` is the dataset); so does this module, after editing the graph
for each worker as `input_plan.plan` decided:

- the batch op batches the worker's examples of each global batch (its batch size is
  set to the worker's share, and the batch dimension after it becomes unknown);
- the worker's blocks are taken where the plan says: by cutting the constants of a
  `from_tensor_slices` source to the worker's rows, or by four ops above the split
  (batch by the global batch, rebatch into the workers' blocks, keep the worker's
  block, unbatch), which use no function and act on the examples as they come;
- shuffles below the split that have no seed get one seed, the same on every worker,
  so that every worker sees the examples in the same order there.

```python
graph = DatasetGraph(dataset)
pipeline = graph.pipeline(count_files=lambda graph_def, spec: None)
decided = input_plan.plan(pipeline, num_workers=2, replicas_per_worker=1)
graph.prepare(decided, seed=1234)
per_worker = [graph.worker_graph(i) for i in range(2)]      # serialized GraphDefs
```
"""

import numpy as np
import tensorflow as tf

# TF-private: the option a dataset is serialized with, as TensorFlow's own `replicate`
# does before it re-creates a dataset on other devices.
from hybrid_strategy.tensorflow_private import data_options

from hybrid_strategy.input import input_plan

_PREFIX = "hybrid_strategy_share"


def _name(reference):
    """A node's name from an input reference ("node:1" -> "node"); None for "^control"."""
    return None if reference.startswith("^") else reference.split(":")[0]


def _data_inputs(node):
    return [name for name in map(_name, node.input) if name is not None]


def _const_value(node):
    if node.op != "Const":
        return None
    return _ndarray(node.attr["value"].tensor)


def _ndarray(proto):
    """A TensorProto's value; strings too, which a dataset's graph encodes as raw bytes
    (`tensor_content`) that `tf.make_ndarray` cannot read."""
    if proto.dtype == tf.string.as_datatype_enum and proto.tensor_content:
        return tf.io.parse_tensor(proto.SerializeToString(), tf.string).numpy()
    return tf.make_ndarray(proto)


def _function_names(node):
    return [value.func.name for value in node.attr.values() if value.HasField("func")]


def _types(node):
    for key in ("output_types", "Toutput_types"):
        if key in node.attr:
            return list(node.attr[key].list.type)
    return [tf.string.as_datatype_enum]  # the readers' records


def _shapes(node):
    if "output_shapes" in node.attr:
        return [tf.TensorShape(shape) for shape in node.attr["output_shapes"].list.shape]
    return [tf.TensorShape(None) for _ in _types(node)]


def element_spec(node):
    """The flat element spec of the dataset `node` makes, from its attributes."""
    specs = tuple(tf.TensorSpec(shape, tf.as_dtype(dtype))
                  for shape, dtype in zip(_shapes(node), _types(node)))
    return specs[0] if len(specs) == 1 else specs


def _shapes_attr(shapes):
    value = tf.compat.v1.AttrValue()
    value.list.shape.extend(shape.as_proto() for shape in shapes)
    return value


def _without_batch_size(shape):
    return shape if shape.rank is None else tf.TensorShape([None]).concatenate(shape[1:])


def serialize(dataset):
    """The GraphDef TensorFlow sends to each worker for `dataset` (see `replicate`)."""
    # TF-private: the debug options and serialization TensorFlow's `replicate` applies.
    dataset = dataset._apply_debug_options()  # pylint: disable=protected-access
    serialized = dataset._as_serialized_graph(  # pylint: disable=protected-access
        strip_device_assignment=True, external_state_policy=data_options.ExternalStatePolicy.WARN)
    graph_def = tf.compat.v1.GraphDef()
    graph_def.ParseFromString(serialized.numpy())
    return graph_def


class DatasetGraph:
    """A dataset's GraphDef: its description for the plan, and each worker's version."""

    def __init__(self, dataset):
        self.graph_def = serialize(dataset)
        self.nodes = {node.name: node for node in self.graph_def.node}
        self.functions = {f.signature.name: f for f in self.graph_def.library.function}
        (retval,) = [node for node in self.graph_def.node if node.op == "_Retval"]
        self.chain = self._chain(_data_inputs(retval)[0])
        self._plan = None
        self._batch_size_node = self._index_node = None
        self._sliced = []

    # Reading --------------------------------------------------------------------

    def _chain(self, output):
        """Node names from `output` down, as `input_plan.Pipeline.ops` describes."""
        chain, name, batched = [], output, False
        while True:
            node = self.nodes[name]
            chain.append(name)
            if not batched and node.op in input_plan.BATCH_OPS:
                batched = True
            elif batched and node.op not in input_plan.ELEMENT_WISE:
                return chain
            elif not batched and node.op not in input_plan.BATCH_WISE:
                return chain
            inputs = _data_inputs(node)
            if not inputs:
                return chain
            name = inputs[0]

    def _batch_node(self):
        for name in self.chain:
            if self.nodes[name].op in input_plan.BATCH_OPS:
                return self.nodes[name]
        return None

    def _batch_argument(self, node, which):
        index = input_plan.BATCH_OPS[node.op][which]
        if index is None:
            return None
        value = _const_value(self.nodes[_data_inputs(node)[index]])
        return None if value is None else value.item()

    def _source_rows(self):
        """Rows of a `from_tensor_slices` source of constants only it reads, else None."""
        source = self.nodes[self.chain[-1]]
        if source.op != input_plan.SLICEABLE_SOURCE:
            return None
        components = [self.nodes[name] for name in _data_inputs(source)]
        if not components or any(node.op != "Const" for node in components):
            return None
        for node in components:
            if tf.as_dtype(node.attr["value"].tensor.dtype) in (tf.variant, tf.resource):
                return None
            if any(node.name in _data_inputs(other) and other is not source
                   and other.op != "Identity" for other in self.graph_def.node):
                return None
        return tf.TensorShape(components[0].attr["value"].tensor.tensor_shape)[0]

    def _reads_files(self, function_names, seen=()):
        """Whether these functions (or functions they call) read files."""
        for name in function_names:
            if name in seen or name not in self.functions:
                continue
            for node in self.functions[name].node_def:
                if input_plan.is_reader(node.op) or self._reads_files(
                        _function_names(node), seen + (name,)):
                    return True
        return False

    def _file_name_datasets(self):
        """Nodes whose input 0 is a dataset of file names their function reads."""
        return [node for node in self.graph_def.node
                if _data_inputs(node) and self._reads_files(_function_names(node))]

    def _subgraph(self, output):
        """A GraphDef returning the dataset `output` makes: its nodes, this library."""
        needed, pending = set(), [output]
        while pending:
            name = pending.pop()
            if name not in needed:
                needed.add(name)
                pending.extend(reference.lstrip("^").split(":")[0]
                               for reference in self.nodes[name].input)
        graph_def = tf.compat.v1.GraphDef()
        graph_def.library.CopyFrom(self.graph_def.library)
        for node in self.graph_def.node:
            if node.name in needed:
                graph_def.node.add().CopyFrom(node)
            elif node.op == "_Retval":
                retval = graph_def.node.add()
                retval.CopyFrom(node)
                retval.input[:] = [output]
        return graph_def.SerializeToString()

    def pipeline(self, policy=input_plan.AUTO, count_files=None):
        """This dataset's `input_plan.Pipeline` under `policy`.

        Args:
            policy: Its auto_shard_policy, by name.
            count_files: `count_files(serialized GraphDef, element spec)` counts the
                elements (file names) of that dataset, or returns None if it cannot.
        """
        batch = self._batch_node()
        counts = []
        readers = self._file_name_datasets()
        for node in readers:
            names = self.nodes[_data_inputs(node)[0]]
            count = count_files(self._subgraph(names.name), element_spec(names)) \
                if count_files else None
            counts.append(count)
        known = [count for count in counts if count is not None]
        return input_plan.Pipeline(
            ops=tuple(self.nodes[name].op for name in self.chain),
            batch_size=self._batch_argument(batch, 0) if batch is not None else None,
            drop_remainder=self._batch_argument(batch, 1) if batch is not None else None,
            source_rows=self._source_rows(),
            files=min(known) if known and len(known) == len(counts) else None,
            reads_files=bool(readers),
            data_service=any(node.op.startswith("DataServiceDataset")
                             for node in self.graph_def.node),
            policy=policy)

    # Writing --------------------------------------------------------------------

    def _add_const(self, value, dtype):
        """A new constant node holding `value`, of `dtype`."""
        node = self.graph_def.node.add()
        node.name = f"{_PREFIX}/Const_{len(self.graph_def.node)}"
        node.op = "Const"
        node.attr["value"].tensor.CopyFrom(
            tf.make_tensor_proto(np.asarray(value, dtype=dtype.as_numpy_dtype)))
        node.attr["dtype"].type = dtype.as_datatype_enum
        self.nodes[node.name] = node
        return node

    def prepare(self, plan, seed):
        """Edits the graph for `plan` (a SHARE plan); `seed` seeds shuffles below the split.

        `worker_graph(i)` then returns worker i's graph.
        """
        self._plan = plan
        batch = self._batch_node()
        # The batch size becomes the worker's; the batch dimension unknown from here on.
        # (A NodeDef lists its data inputs first, control inputs after.)
        self._batch_size_node = self._add_const(0, tf.int64)
        batch.input[input_plan.BATCH_OPS[batch.op][0]] = self._batch_size_node.name
        for name in self.chain[:self.chain.index(batch.name) + 1]:
            node = self.nodes[name]
            if "output_shapes" in node.attr:
                node.attr["output_shapes"].CopyFrom(
                    _shapes_attr(_without_batch_size(s) for s in _shapes(node)))
        split = self.nodes[self.chain[plan.split]]
        self._seed_shuffles_below(split, seed)
        if plan.slice_source:
            self._sliced = [(node, _ndarray(node.attr["value"].tensor))
                            for node in (self.nodes[n] for n in _data_inputs(split))]
        else:
            self._take_blocks_above(split, plan)

    def _take_blocks_above(self, split, plan):
        """Inserts the worker's blocks above `split`: batch, keep the block, unbatch.

        The ops come from a small dataset made here and serialized (the block is kept
        by a map, whose function this graph then carries); its worker index is a
        constant `worker_graph` sets.
        """
        template = serialize(_block_template(
            element_spec(split), sum(plan.worker_batches), len(plan.worker_batches),
            plan.replicas_per_worker, plan.drop_remainder_at_split))
        nodes = {node.name: node for node in template.node}
        (retval,) = [node for node in template.node if node.op == "_Retval"]
        (stand_in,) = [node for node in template.node if _data_inputs(node) and
                       nodes[_data_inputs(node)[0]].op == "RangeDataset"]
        # From the last op down to the batch, above the stand-in for the split.
        chain = [nodes[_data_inputs(retval)[0]]]
        while _data_inputs(chain[-1])[0] != stand_in.name:
            chain.append(nodes[_data_inputs(chain[-1])[0]])
        kept = chain + [nodes[name] for node in chain for name in _data_inputs(node)[1:]]
        (block,) = [node for node in chain if node.op == "MapDataset" and
                    len(_data_inputs(node)) > 1]
        renamed = {node.name: f"{_PREFIX}/{node.name}" for node in kept}
        for node in kept:
            copy = self.graph_def.node.add()
            copy.CopyFrom(node)
            copy.name = renamed[node.name]
            del copy.input[:]
            copy.input.extend(split.name if name == stand_in.name else renamed[name]
                              for name in _data_inputs(node))
            self.nodes[copy.name] = copy
        self._index_node = self.nodes[renamed[_data_inputs(block)[1]]]  # the captured index
        known = set(self.functions)
        for function in template.library.function:
            if function.signature.name not in known:
                self.graph_def.library.function.add().CopyFrom(function)
        consumer = self.nodes[self.chain[plan.split - 1]]
        consumer.input[list(consumer.input).index(split.name)] = renamed[chain[0].name]

    def _seed_shuffles_below(self, split, seed):
        """Makes every shuffle below `split` shuffle alike on every worker.

        An unseeded one gets the seeds (seed, seed + 1); a seeded one keeps its seeds.
        """
        pending, seen = [split.name], set()
        while pending:
            name = pending.pop()
            if name in seen:
                continue
            seen.add(name)
            node = self.nodes[name]
            pending.extend(_data_inputs(node))
            if node.op not in input_plan.PERMUTING:
                continue
            inputs = _data_inputs(node)
            seeds = [_const_value(self.nodes[n]) for n in inputs[2:4]] \
                if node.op != "ShuffleDatasetV2" else [0, 0]
            if any(s is None for s in seeds) or (node.op == "ShuffleDataset" and any(seeds)):
                continue
            if not any(seeds):
                seeds = [seed, seed + 1]
            # ShuffleDataset uses its seeds; the later versions draw them from a seed
            # generator, which each worker makes for itself, or which a global seed
            # (tf.random.set_seed) ties to the resource of the process that made the
            # dataset: either way the workers would not shuffle alike.
            del node.input[:]
            node.input.extend(inputs[:2] + [self._add_const(s, tf.int64).name for s in seeds])
            node.op = "ShuffleDataset"
            if "reshuffle_each_iteration" not in node.attr:  # ShuffleDatasetV2's default
                node.attr["reshuffle_each_iteration"].b = True

    def worker_graph(self, worker):
        """Worker `worker`'s serialized GraphDef (after `prepare`)."""
        plan = self._plan
        self._batch_size_node.attr["value"].tensor.CopyFrom(
            tf.make_tensor_proto(np.int64(plan.worker_batches[worker])))
        if self._index_node is not None:
            self._index_node.attr["value"].tensor.CopyFrom(
                tf.make_tensor_proto(np.int64(worker)))
        for node, full in self._sliced:
            starts, lengths = input_plan.worker_rows(
                len(full), sum(plan.worker_batches), worker, len(plan.worker_batches),
                plan.replicas_per_worker, plan.drop_remainder_at_split)
            node.attr["value"].tensor.CopyFrom(
                tf.make_tensor_proto(take_rows(full, starts, lengths)))
        return self.graph_def.SerializeToString()


def _block_template(spec, global_batch, num_workers, replicas_per_worker, drop_remainder):
    """A dataset that batches by `global_batch` and keeps worker 0's block, unbatched.

    Its source stands in for the split (elements of `spec`); the worker's index is a
    captured constant.
    """
    specs = tf.nest.flatten(spec)
    worker = tf.constant(0, tf.int64)

    def stand_in(_):
        return tuple(tf.compat.v1.placeholder_with_default(
            tf.zeros([d or 0 for d in s.shape] if s.shape.rank is not None else [],
                     s.dtype), s.shape) for s in specs)

    def block(*components):
        start, end = input_plan.block_bounds(
            tf.shape(components[0], out_type=tf.int64)[0],
            num_workers * replicas_per_worker, worker * replicas_per_worker,
            replicas_per_worker, minimum=tf.minimum)
        return tuple(component[start:end] for component in components)

    return (tf.data.Dataset.range(1).map(stand_in)
            .batch(global_batch, drop_remainder=drop_remainder).map(block).unbatch())


def take_rows(array, starts, lengths):
    """The rows [start, start + length) of `array` for each pair, in order."""
    if not starts:
        return array[:0]
    return np.concatenate([array[s:s + n] for s, n in zip(starts, lengths)])
