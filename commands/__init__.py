"""The commands people run, one sub-package each: `train` (bamboo-train, bamboo-plot),
`status` (bamboo-status and its dashboard) and `chaos` (bamboo-chaos). They sit on
top of the agents: the training launcher starts agent processes, the dashboard reads
the mode choice's estimates; nothing below imports them."""
