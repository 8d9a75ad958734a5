"""A step's push carries the next step's ids; their rows come back with the dense sum.

In a call of several synchronous steps (`compile(steps_per_execution=N)`), each step of a
worker crosses two exchanges with each PS task: its ids out and their rows back before the
model runs, its gradients out and the dense sum back after. When the next step's batch is
at hand while a step is traced (keras_integration/multi_step.py reads it first), its
lookups ride with this step instead: the ids go out in this step's push, and once this
step has updated the tables, each PS task gathers their rows and sends them back in the
same tensor as the dense sum. A step then crosses one exchange per PS task, the call's
first step's lookup and last step's push aside.

The dense sum is summed where the push arrives, but it cannot leave before the step's
updates of the tables are traced, which Keras does after it hands out the sums: the
values it hands out are stand-ins (`returned_later`), connected to the sums as they
arrive once the step is traced. The rows are gathered after every update the step
traced on their tables (automatic control dependencies order them so), so each step
reads what one device would.

```python
import tensorflow as tf
from hybrid_strategy.communication import rows_ahead

@tf.function
def step():
    with rows_ahead.reading_ahead(lambda replica_devices: []) as ahead:
        pass  # a HybridStrategy step on a cluster: its push takes the next step's lookups
    print(ahead.rows)  # {} here: no push took them
    return tf.constant(0)

step()
```
"""

import contextlib
import weakref

import tensorflow as tf

from hybrid_strategy.sharding import wire
from hybrid_strategy.tables import table as table_lib

_AHEAD = weakref.WeakKeyDictionary()  # graph of the step being traced -> Ahead


class Ahead:
    """The next step's lookups while one step is traced (`reading_ahead`).

    Args:
        lookups: `lookups(replica_devices) -> [(key, device, table, ids)]`: the next
            step's lookups, each of `ids` (checked, integer) in `table`, made on
            `device`, one of the replicas' devices.
    """

    def __init__(self, lookups):
        self._lookups = lookups
        self._requests = []  # (key, replica device, host, distinct request)
        self._sent = self._arrived = None
        self._back = None
        self._stand_ins = []  # (stand-in, ticket of what it stands for in self._back)
        self.rows = {}

    def send_ids(self, push, replica_devices):
        """Puts the next step's unique ids in `push`, from each replica's worker; whether
        there were any."""
        for key, device, table, ids in self._lookups(replica_devices):
            with tf.device(device):
                request = table_lib.distinct_requests([(table, ids)], checked=True)[0]
            self._requests.append((key, device, wire.host_of(device), request))
        if not self._requests:
            return False
        self._sent = table_lib.send_ids(
            push, self._unique_ids(), [host for _, _, host, _ in self._requests])
        return True

    def returning_to_all(self, tasks, destinations):
        """Those of `tasks` (PS devices), in order, that send the next step's rows to
        every one of `destinations`: what else they send there crosses in that tensor."""
        hosts = {}
        for _, _, host, request in self._requests:
            for shard in request[0].shards:
                hosts.setdefault(wire.canonical(shard.device), set()).add(
                    wire.canonical(host))
        wanted = {wire.canonical(device) for device in destinations}
        return [task for task in tasks if wanted <= hosts.get(wire.canonical(task), set())]

    def ids_arrived(self, arrived):
        """`arrived`: {ticket: tensor} of the push, once delivered."""
        self._arrived = arrived

    def returned_later(self, outbox, returns):
        """Stand-ins for what `outbox` would return: `returns` holds `(ticket, tensor
        put)` pairs, in any nesting of lists; the same nesting of stand-ins, each on its
        ticket's destination, made what arrived once the step is traced. Tensors of a
        shape not known when traced have no stand-in: they are returned now."""
        if not all(tensor.shape.is_fully_defined() for _, tensor in _flat(returns)):
            delivered = outbox.deliver()
            return _nested_map(lambda ticket_and_tensor: delivered[ticket_and_tensor[0]],
                               returns)
        self._back = outbox

        def stand_in(ticket_and_tensor):
            ticket, tensor = ticket_and_tensor
            with tf.device(ticket[1]):
                placeholder = tf.identity(tf.zeros(tensor.shape, tensor.dtype))
            self._stand_ins.append((placeholder, ticket))
            return placeholder

        return _nested_map(stand_in, returns)

    def _finish(self):
        """Gathers the rows (after the step's updates, as traced after them), sends them
        back with what waited for them, and connects the stand-ins."""
        if self._sent is None:
            return
        back = self._back or wire.Outbox()
        tickets = table_lib.send_rows(self._arrived, self._unique_ids(), self._sent, back,
                                      [host for _, _, host, _ in self._requests])
        returned = back.deliver()
        for placeholder, ticket in self._stand_ins:
            # TF-private: an op's input replaced after it was made; the public API only
            # builds ops on what exists when they are made.
            placeholder.op._update_input(0, returned[ticket])  # pylint: disable=protected-access
        rows = table_lib.rows_arrived(returned, self._unique_ids(), self._sent, tickets,
                                      [device for _, device, _, _ in self._requests])
        self.rows = {key: (request, r)
                     for (key, _, _, request), r in zip(self._requests, rows)}

    def _unique_ids(self):
        return [(request[0], request[2]) for _, _, _, request in self._requests]


@contextlib.contextmanager
def reading_ahead(lookups):
    """The step traced in this block takes the next step's `lookups` (see `Ahead`) with
    its push, when a push of this graph takes them; after it, `Ahead.rows` holds their
    rows, keyed as `lookups` keyed them ({} when no push took them)."""
    graph = tf.compat.v1.get_default_graph()
    ahead = Ahead(lookups)
    _AHEAD[graph] = ahead
    try:
        yield ahead
    finally:
        _AHEAD.pop(graph, None)
    ahead._finish()  # pylint: disable=protected-access


def current():
    """The `Ahead` of the step being traced in this graph, or None; a push takes it once."""
    return _AHEAD.pop(tf.compat.v1.get_default_graph(), None)


def _flat(value):
    if isinstance(value, list):
        return [leaf for item in value for leaf in _flat(item)]
    return [value]


def _nested_map(fn, value):
    if isinstance(value, list):
        return [_nested_map(fn, item) for item in value]
    return fn(value)
