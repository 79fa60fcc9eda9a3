"""One worker's life: the worker process, the executor that runs a node's
instruction stream, failover inside an iteration, the boundary that ends an
iteration, the data-parallel reduce and replica sync, and evaluation. It imports the
rooms below it (control, data, model, transport, state) and `schedules`; the agents
start it as a process."""

WORKER = "bamboo.runtime.worker"  # the module a launcher or an agent starts, one per node
