"""`bamboo-scale`: the control plane of N nodes emulated on one machine against one
real etcd, and what it costs as N grows."""
