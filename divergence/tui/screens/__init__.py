"""The browser's screens: overview, tokens, steps, KV, help, go-to."""
