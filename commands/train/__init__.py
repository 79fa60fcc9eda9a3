"""bamboo-train: its typed flags and job file, the checks behind them, the local
launcher that starts etcd, agents and workers on this machine, the single-process
reference, the metrics file and its sinks (progress bar, TensorBoard, bamboo-plot),
and the preemption plans of --preempt."""
