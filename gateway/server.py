"""Runs the gateway: OpenAI HTTP API and gRPC Generate API over one orchestrator."""

import asyncio
import contextlib

import structlog
import uvicorn

from gateway.chat_template import read_chat_template
from gateway.config import ENV_PREFIX, GatewayConfig
from gateway.drafter_client import DrafterClient
from gateway.grpc_api import add_generation_servicer
from gateway.metrics import GatewayMetrics
from gateway.model_info import Backends
from gateway.openai_api import create_app
from gateway.orchestrator import Orchestrator
from gateway.planner import PlannerPolicy
from gateway.reasoning import REASONING_PARSERS
from gateway.response_store import ResponseStore
from gateway.sampling_defaults import read_sampling_defaults
from gateway.serving import ServingContext
from gateway.tokenizer import files_from_verifier, hide_torch, load_tokenizer
from gateway.tool_calls import TOOL_CALL_PARSERS
from gateway.verifier_pool import VerifierPool
from speclane import grpc_server
from speclane.config import parse_config
from speclane.log import configure_logging
from speclane.models import resolve_model, served_name
from speclane.speculation import DRAFTER_WIDE_KEYS
from speclane.tls import TlsFiles

log = structlog.get_logger()


class _EmbeddedHttpServer(uvicorn.Server):
    """uvicorn without its own signal handling: the gateway stops HTTP and gRPC together."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def _check_drafter(drafter: DrafterClient, drafter_wide: dict) -> None:
    """Learns the drafter's limits; warns where --speculative-config expects other drafter-wide values."""
    limits = await drafter.refresh_limits()
    if limits is None:
        log.warning("drafter_not_reached", address=drafter.address, action="generating without drafts until it is")
        return
    for key, value in drafter_wide.items():
        actual = getattr(limits, DRAFTER_WIDE_KEYS[key])
        if value != actual:
            log.warning("drafter_setting_differs", key=key, configured=value, drafter=actual,
                        action="the drafter's value applies; set it with the drafter's own flags")


def _load(model_dir, config: GatewayConfig):
    """The tokenizer (with its chat template) and the sampling defaults of the model in `model_dir`."""
    try:
        defaults = read_sampling_defaults(model_dir, config.generation_config)
    except ValueError as refused:
        raise SystemExit(f"gateway: refused to start: {refused}") from None
    return load_tokenizer(model_dir), defaults


async def run(config: GatewayConfig) -> None:
    configure_logging("gateway", config.log_level)
    if config.unused_speculation_keys:
        log.warning("speculative_config_keys_unused", keys=list(config.unused_speculation_keys),
                    action="ignored: speclane does not use them")
    verifiers = VerifierPool(config.verifier_addresses, step_timeout_seconds=config.verifier_timeout_s or None,
                             tls=config.tls)
    drafter = (DrafterClient(config.drafter_address, config.draft_timeout_ms / 1000, tls=config.tls)
               if config.drafter_address else None)
    log.info("waiting_for_verifier", addresses=config.verifier_addresses)
    await verifiers.wait_ready()
    info = await verifiers.model_info()
    if config.model:
        # Pulling converts weights with torch, which the gateway does without: `speclane pull` does it.
        model_dir = resolve_model(config.model, pull_if_missing=False)
        model_name = config.served_model_name or served_name(config.model)
        tokenizer, defaults = _load(model_dir, config)
    else:
        model_name = config.served_model_name or info.model_name
        async with files_from_verifier(verifiers) as model_dir:
            tokenizer, defaults = _load(model_dir, config)
    metrics = GatewayMetrics(model_name)
    # How many keys, never which: a key must not reach a log.
    log.info("authentication", api_keys=len(config.keyring), tenant_from="api_key" if config.keyring
             else "x-tenant-id header (trusted network)", protect_metrics=config.protect_metrics)
    verifiers.attach_metrics(metrics)
    debug = config.debug
    policy = PlannerPolicy(draft_token_costs=tuple(sorted(info.draft_token_cost_by_batch_size.items())),
                           draft_tokens_by_load=config.speculation_draft_tokens_by_load,
                           next_round=debug.next_round, lookup=debug.lookup, break_even=debug.break_even)
    orchestrator = Orchestrator(verifiers, drafter, metrics, policy)
    if drafter is not None:
        await _check_drafter(drafter, config.drafter_wide_speculation)
    context = ServingContext(
        model_name=model_name,
        tokenizer=tokenizer,
        generate=orchestrator.generate,
        default_speculation=config.speculation,
        max_context_len=info.max_context_len,
        max_concurrent_requests=config.max_concurrent_requests,
        metrics=metrics,
        sampling_defaults=defaults,
        keyring=config.keyring,
        protect_metrics=config.protect_metrics,
        max_tokens_limit=config.max_tokens_limit,
        max_request_body_bytes=config.max_request_body_bytes,
        chat_template=read_chat_template(config.chat_template),
        tool_call_parser=TOOL_CALL_PARSERS.get(config.tool_call_parser),
        auto_tool_choice=config.enable_auto_tool_choice,
        reasoning_parser=REASONING_PARSERS.get(config.reasoning_parser),
        responses=ResponseStore(config.max_stored_responses),
        ready=verifiers.ready,
        drafter_limits=(lambda: drafter.limits) if drafter is not None else (lambda: None),
        draft_head=info.draft_head,
    )
    http = _EmbeddedHttpServer(uvicorn.Config(
        create_app(context), host=config.host, port=config.port, log_config=None, access_log=False,
        timeout_graceful_shutdown=5, ssl_certfile=config.ssl_certfile or None, ssl_keyfile=config.ssl_keyfile or None,
    ))
    http_task = asyncio.ensure_future(http.serve())
    watching = asyncio.ensure_future(verifiers.watch())  # a restarted verifier gets work again

    async def wait_for_http():
        while not http.started:
            if http_task.done():
                http_task.result()
                raise OSError(f"HTTP server on {config.host}:{config.port} did not start")
            await asyncio.sleep(0.05)
        scheme = "https" if config.ssl_certfile else "http"
        log.info("http_listening", url=f"{scheme}://{config.host}:{config.port}/v1", model=model_name,
                 speculation=config.speculation.method)

    async def shutdown():
        watching.cancel()
        http.should_exit = True
        await http_task
        if drafter is not None:
            await drafter.close()
        await verifiers.close()

    await grpc_server.serve(
        address=config.grpc_address,
        add_servicers=lambda server: [add_generation_servicer(server, context, Backends(verifiers, drafter))],
        warmup=wait_for_http,
        on_shutdown=shutdown,
        # Server TLS only: clients of the public API authenticate with API keys, not certificates.
        tls=TlsFiles(cert=config.tls_cert, key=config.tls_key),
    )


def main(argv: list[str] | None = None, prog: str = "python -m gateway") -> None:
    hide_torch()  # before transformers is first imported
    grpc_server.run_service(run(parse_config(GatewayConfig, ENV_PREFIX, argv, prog, "the gateway")))
