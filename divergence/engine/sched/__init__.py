"""Scheduling: which sequences run in the next step, with how many rows, and the KV
blocks they hold (numpy and the stdlib only: no MLX here)."""
