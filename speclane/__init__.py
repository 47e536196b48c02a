"""speclane: speculative-decoding serving as gRPC microservices.

This package holds only what the services share: configuration parsing,
logging, gRPC server plumbing, model management and the `speclane` CLI.
"""
