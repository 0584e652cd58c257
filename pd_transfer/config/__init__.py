"""Configuration: the sidecar's record, where each value came from, addresses, ``serve`` flags, worker geometry files, optional engines."""
