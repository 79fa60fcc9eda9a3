"""Moving tensors between workers: messages over torch.distributed (comm), NCCL
channels for GPU payloads, process groups whose rendezvous is in etcd (groups),
pinned-host staging and the swap of FRC intermediates, and the choice of device per
worker. It imports `control` and `schedules.ir`; only the runtime and the commands
import it."""
