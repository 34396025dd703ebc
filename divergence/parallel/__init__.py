"""Tensor parallelism in one package: the process group and its environment names,
sharding, launching ranks, running a command as ranks, and the all-reduce probe.
The engine never imports it: a TensorParallel object is handed to the Engine."""
