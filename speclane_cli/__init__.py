"""The `speclane` command line: the `serve` supervisor, `pull`, the benchmarks,
and each service on its own. Unlike `speclane` (the plumbing the services
share), this package may import every service, each only when its command runs."""
