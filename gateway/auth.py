"""API keys and the tenant each one speaks for.

With keys configured (vLLM's `--api-key`, and/or `--api-keys-file`), the OpenAI
API and the gRPC Generate API serve only callers that send one (`Authorization:
Bearer KEY`, in gRPC metadata as `authorization`), and the key decides the
request's tenant (whose suffix tree on the drafter it feeds and drafts from) and
its concurrency limit. No keys: no authentication, and the client's
`x-tenant-id` names the tenant (a trusted network).

The gateway keeps a SHA-256 digest of each key, never the key itself, and logs
keys only by `key_id`, a short prefix of that digest.
"""

import hashlib
import json
import pathlib
from dataclasses import dataclass

import structlog
import yaml  # a dependency of transformers, which the gateway needs anyway

from gateway.errors import InvalidRequest
from protos.conventions import TENANT_METADATA_KEY

AUTHORIZATION_METADATA_KEY = "authorization"
DEFAULT_TENANT = ""  # the drafter's tenant of requests that name none
MAX_TENANT_LENGTH = 128
_ENTRY_FIELDS = frozenset({"tenant", "max_concurrent_requests"})

log = structlog.get_logger()


@dataclass(frozen=True)
class ApiKey:
    """What the gateway knows of a caller's key: never the key itself."""

    key_id: str  # a short digest, for logs and per-key limits
    tenant: str
    max_concurrent_requests: int | None = None  # None: only the server's limit


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def key_id(key: str) -> str:
    return _digest(key).hex()[:12]


class Keyring:
    """The configured keys, by digest. Empty: authentication is off."""

    def __init__(self, keys: dict[str, ApiKey] | None = None):
        self._by_digest = {_digest(key): api_key for key, api_key in (keys or {}).items()}

    def __len__(self) -> int:
        return len(self._by_digest)

    @classmethod
    def load(cls, api_keys: tuple[str, ...] = (), keys_file: str = "") -> "Keyring":
        """`--api-key` keys share the default tenant (as every unauthenticated
        request did); an entry of the keys file, also for such a key, says otherwise."""
        keys = {key: ApiKey(key_id(key), DEFAULT_TENANT) for key in api_keys}
        if keys_file:
            keys.update(read_keys_file(keys_file))
        return cls(keys)

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The caller's key from an `Authorization: Bearer KEY` value, or None."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        # Looked up by digest: the lookup's timing can tell a caller at most how much of a
        # key's digest matches that of what it sent, which brings it no closer to the key.
        return self._by_digest.get(_digest(token.strip()))


def tenant_for(caller: ApiKey | None, claimed: str | None) -> str:
    """The tenant a request drafts in. A caller with a key gets its key's tenant and
    a tenant the client names is ignored: clients that send one (the bundled clients'
    `tenant=`) keep working when keys are turned on, and none can reach another's
    tree. Without keys the network is trusted and the named tenant is taken."""
    if caller is None:
        # It travels to the drafter as gRPC metadata, which takes printable ASCII only: a
        # bad one would fail the drafter session there, and rest the drafter for everyone.
        if claimed and not (len(claimed) <= MAX_TENANT_LENGTH and claimed.isascii() and claimed.isprintable()):
            raise InvalidRequest(f"{TENANT_METADATA_KEY} must be 1 to {MAX_TENANT_LENGTH} printable ASCII "
                                 "characters", TENANT_METADATA_KEY)
        return claimed or DEFAULT_TENANT
    if claimed and claimed != caller.tenant:
        log.debug("tenant_header_ignored", key_id=caller.key_id, claimed=claimed, tenant=caller.tenant)
    return caller.tenant


def read_keys_file(path: str) -> dict[str, ApiKey]:
    """Reads and checks a keys file (JSON, or YAML by its suffix):
    `{"KEY": {"tenant": "team-a", "max_concurrent_requests": 4}, ...}`, both fields optional.

    Raises ValueError naming the entry by its position, never by its key.
    """
    file = pathlib.Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"api_keys_file {path}: cannot read it ({exc.__class__.__name__})") from None
    if file.suffix.lower() == ".json":
        entries = _parse_json(path, text)
    elif file.suffix.lower() in (".yaml", ".yml"):
        entries = _parse_yaml(path, text)
    else:
        raise ValueError(f"api_keys_file {path}: the name must end in .json, .yaml or .yml")
    if not isinstance(entries, dict) or not entries:
        raise ValueError(f"api_keys_file {path}: must map each key to its settings, and name at least one key")
    return {key: _entry(path, position, key, settings)
            for position, (key, settings) in enumerate(entries.items(), start=1)}


def _parse_json(path: str, text: str):
    def unique(pairs):
        names = [name for name, _ in pairs]
        if len(set(names)) != len(names):
            raise ValueError(f"api_keys_file {path}: a name appears twice in one object")
        return dict(pairs)

    try:
        return json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as exc:  # its message quotes no content, only where
        raise ValueError(f"api_keys_file {path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None


def _parse_yaml(path: str, text: str):
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if isinstance(root, yaml.MappingNode):
            names = [name.value for name, _ in root.value]
            if len(set(names)) != len(names):
                raise ValueError(f"api_keys_file {path}: a key appears twice")
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # Not str(exc): it quotes the offending line, which may hold a key.
        mark = getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"api_keys_file {path}: not valid YAML ({getattr(exc, 'problem', None)}{where})") from None


def _entry(path: str, position: int, key, settings) -> ApiKey:
    where = f"api_keys_file {path}: entry {position}"
    # A key travels in an HTTP header and in gRPC metadata, after "Bearer ".
    if not isinstance(key, str) or not key or not key.isascii() or not key.isprintable() or " " in key:
        raise ValueError(f"{where}: a key must be a non-empty string of printable ASCII without spaces")
    settings = {} if settings is None else settings
    if not isinstance(settings, dict):
        raise ValueError(f"{where}: the settings must be a mapping (tenant, max_concurrent_requests)")
    if unknown := set(settings) - _ENTRY_FIELDS:
        raise ValueError(f"{where}: unknown setting(s) {', '.join(sorted(map(str, unknown)))}; "
                         f"known: {', '.join(sorted(_ENTRY_FIELDS))}")
    # Never the key itself: a tenant name shows in logs and travels as metadata.
    tenant = settings.get("tenant", f"key-{key_id(key)}")
    if not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT_LENGTH or not tenant.isascii() \
            or not tenant.isprintable():
        raise ValueError(f"{where}: tenant must be 1 to {MAX_TENANT_LENGTH} printable ASCII characters")
    limit = settings.get("max_concurrent_requests")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"{where}: max_concurrent_requests must be a whole number >= 1")
    return ApiKey(key_id(key), tenant, limit)
