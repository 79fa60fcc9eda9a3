"""The elastic agent, one per node: it registers in etcd, joins the rendezvous,
starts and watches its worker, and reconfigures the cluster between iterations
with the policy (a pure function the simulator shares), the redundancy mode's choice
and the preemption-notice watchers. Cloud provisioning lives above it, in
`cloud`."""
