"""The control plane: everything the nodes agree on goes through etcd. The keys and
records (protocol), the cluster client built on them, the etcd server and the
rendezvous store, watches (changes), leases and liveness, the stage assignment and
the job's config and exit codes. It imports only `schedules`; every other room of
`bamboo` may import it."""
