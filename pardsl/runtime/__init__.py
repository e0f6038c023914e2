"""What a rank runs: collectives as autograd functions, parameter gathers and gradient buckets, the
shared-memory transport, kernels, pipeline schedules, checkpoints. Imports nothing of the compiler."""
