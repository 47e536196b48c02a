"""API keys (vLLM's --api-key): with keys configured, the OpenAI API and the
gRPC Generate API serve only callers that send one (`Authorization: Bearer KEY`,
in gRPC metadata as `authorization`); /health and /metrics stay open for probes
and scrapers. No keys: no authentication."""

import hmac

AUTHORIZATION_METADATA_KEY = "authorization"


def authorized(api_keys: tuple[str, ...], authorization: str | None) -> bool:
    if not api_keys:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    # Compared in constant time, against every key: the answer leaks no prefix of a key.
    matches = [hmac.compare_digest(token.strip().encode(), key.encode()) for key in api_keys]
    return scheme.lower() == "bearer" and any(matches)
