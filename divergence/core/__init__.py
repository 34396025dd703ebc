"""The numpy-only core every layer may import: record and event types, requests,
name tables, hashing of K/V bytes, the host facts (cores), and the label and composition formatters that
the report, bisect and the TUI share. Nothing here imports MLX or loads a BLAS."""
