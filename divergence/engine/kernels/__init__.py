"""Kernels and the choice between them: the dispatcher (linear ops, attention and
experts), column splits, native-class probes, backend proofs and BLAS loading."""
