"""Observability: Prometheus metrics and their label sets, structured logs, the served runbooks, listening sockets."""
