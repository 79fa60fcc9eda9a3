"""bamboo package."""
import os

# gRPC's fork handlers (on by default) can run its resolver in a child forked while
# another thread is inside gRPC; the child then aborts before it execs (CI: etcd
# started while a thread was connecting exited with "Check failure"). Bamboo's
# children never use their parent's gRPC state, so the handlers are turned off
# before grpc is first imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
