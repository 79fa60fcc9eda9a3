"""bamboo-chaos: faults injected from outside into a real local job (kills, bursts of
a zone, pauses, etcd restarts; with --network, vanished machines and partitions in
network namespaces), each trial compared with the single-process reference."""
