"""When each instruction of a schedule runs: the engine (event timing and list
scheduling, which lowering, recovery and evaluation use), the checks a schedule must
pass (each invariant a small function chosen from its options) and the drawings of a
timeline."""
