"""The commands people run: bamboo-train (cli, with the local launcher that starts
etcd, agents and workers on this machine, and the single-process reference),
bamboo-status, bamboo-plot and its board, bamboo-chaos and the preemption plans of
--preempt. They sit on top: they import the runtime and start the elastic agents of
`agents`; nothing below imports them."""
