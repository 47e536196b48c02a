"""Configuration of the drafter service (flags `--max-tree-depth`, env `SPECLANE_DRAFTER_MAX_TREE_DEPTH`, ...)."""

import dataclasses
from dataclasses import dataclass

from speclane.config import option
from speclane.log import check_log_level
from speclane.speculation import MAX_TREE_DEPTH, DrafterLimits
from speclane.tls import TlsFiles, server_tls

ENV_PREFIX = "SPECLANE_DRAFTER_"


@dataclass(frozen=True)
class DrafterConfig:
    address: str = option("127.0.0.1:50061", "host:port the gRPC server listens on")
    max_tree_depth: int = option(24, "depth of every suffix tree, per-request and global "
                                     "(vLLM's suffix_decoding_max_tree_depth)")
    max_cached_requests: int = option(10000, "responses kept per tenant in the global suffix tree, "
                                             "evicted first in first out; 0 disables the global tree "
                                             "(vLLM's suffix_decoding_max_cached_requests)")
    max_cached_tokens: int = option(0, "response tokens kept in all global suffix trees together, evicting "
                                       "the oldest responses first; 0 means no token budget")
    share_tenants: bool = option(False, "one global tree for all tenants instead of one per tenant")
    snapshot_path: str = option("", "file the global trees are saved to (periodically and at shutdown) and "
                                    "restored from at start; empty disables persistence")
    snapshot_interval_seconds: float = option(300.0, "seconds between periodic snapshots")
    metrics_port: int = option(0, "port of the Prometheus /metrics endpoint; 0 disables it")
    # Sessions, not RPCs: health checks and GetInfo must answer however busy the drafter is.
    max_sessions: int = option(1024, "open sessions beyond which new ones get RESOURCE_EXHAUSTED (the gateway "
                                     "then generates without drafts)")
    # Each session's own suffix tree takes up to ~80 bytes a token: with max_sessions, a memory bound.
    max_session_tokens: int = option(131072, "prompt + output tokens one session may hold: a longer prompt is "
                                             "refused, a session growing past it ends (RESOURCE_EXHAUSTED)")
    log_level: str = option("info", "debug, info, warning or error")
    tls_cert: str = option("", "PEM certificate of the gRPC server: it then serves TLS (mTLS with --tls-ca)")
    tls_key: str = option("", "PEM private key of --tls-cert")
    tls_ca: str = option("", "PEM certificate of the CA that signs the clients' certificates: every client must then "
                             "show one (mTLS); needs --tls-cert")
    tls: TlsFiles = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"address must be host:port, got {self.address!r}")
        if not 1 <= self.max_tree_depth <= MAX_TREE_DEPTH:
            raise ValueError(f"max_tree_depth must be between 1 and {MAX_TREE_DEPTH}")
        if self.max_cached_requests < 0:
            raise ValueError("max_cached_requests must be >= 0")
        if self.max_cached_tokens < 0:
            raise ValueError("max_cached_tokens must be >= 0")
        if not self.snapshot_interval_seconds > 0:
            raise ValueError("snapshot_interval_seconds must be > 0")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError("metrics_port must be a port number (0 disables metrics)")
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        if self.max_session_tokens < 1:
            raise ValueError("max_session_tokens must be >= 1")
        check_log_level(self.log_level)
        object.__setattr__(self, "tls", server_tls(self.tls_cert, self.tls_key, self.tls_ca))

    @property
    def limits(self) -> DrafterLimits:
        return DrafterLimits(max_tree_depth=self.max_tree_depth, max_cached_requests=self.max_cached_requests)
