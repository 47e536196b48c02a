"""What the gateway serves and the state of the services behind it: the
answer to the public API's GetModelInfo, asked of the verifiers and the
drafter live, since a client uses it to decide whether to send work now."""

import asyncio
import dataclasses
from dataclasses import dataclass

from gateway.drafter_client import DrafterClient
from gateway.serving import ServingContext
from gateway.verifier_pool import VerifierPool
from protos.gateway.v1 import gateway_pb2
from speclane.speculation import DRAFTER_WIDE_KEYS, DrafterLimits


@dataclass(frozen=True)
class Backends:
    verifiers: VerifierPool
    drafter: DrafterClient | None  # None: speculation is off


async def model_info(ctx: ServingContext, backends: Backends | None) -> gateway_pb2.ModelInfo:
    """`backends` None: a front end over no services of ours (the text layer's tests)."""
    info = gateway_pb2.ModelInfo(model_name=ctx.model_name, max_context_len=ctx.max_context_len,
                                 vocab_size=len(ctx.tokenizer))
    if backends is None:
        info.default_speculation.CopyFrom(_speculation_config(ctx.default_speculation.with_draft_length(None)))
        return info
    drafter = backends.drafter
    serving, limits = await asyncio.gather(backends.verifiers.num_serving(),
                                           drafter.refresh_limits() if drafter is not None else _no_limits())
    info.default_speculation.CopyFrom(_speculation_config(ctx.default_speculation.with_draft_length(limits)))
    info.num_verifiers = len(backends.verifiers.addresses)
    info.num_verifiers_serving = serving
    info.drafter_configured = drafter is not None
    info.drafter_reachable = limits is not None
    if limits is not None:  # the drafter-wide keys are the drafter's own settings
        for key, field in DRAFTER_WIDE_KEYS.items():
            setattr(info.default_speculation, key, getattr(limits, field))
    return info


def _speculation_config(settings) -> gateway_pb2.SpeculationConfig:
    return gateway_pb2.SpeculationConfig(**dataclasses.asdict(settings))


async def _no_limits() -> DrafterLimits | None:
    return None
