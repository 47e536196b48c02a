import dataclasses
import json

import pytest

from gateway.chat_template import ChatPrompt
from gateway.errors import InvalidRequest, ModelNotFound, Overloaded
from gateway.sampling_defaults import SamplingDefaults, read_sampling_defaults
from gateway.serving import GenerationParams, build_generation_request, generate_text
from gateway.types import LogitControls, SpeculationUsage
from speclane.speculation import DEFAULT_SPECULATIVE_TOKENS, DrafterLimits, SpeculationSettings
from tests.gateway.fakes import COMPLETION, FAKE_CACHED_TOKENS, MODEL_NAME, ScriptedEngine, make_context

USER = [{"role": "user", "content": "Say hello"}]


def build(ctx, params=GenerationParams(), **prompt):
    return build_generation_request(ctx, "req-1", params, **(prompt or {"chat": ChatPrompt(USER)}))


def test_chat_prompt_uses_the_chat_template(ctx, tiny_tokenizer):
    request = build(ctx)
    expected = "<|im_start|>user\nSay hello<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_tokenizer.decode(request.prompt_token_ids) == expected


def test_developer_role_is_rendered_as_system(ctx, tiny_tokenizer):
    request = build(ctx, chat=ChatPrompt([{"role": "developer", "content": "Be brief"}, *USER]))
    assert tiny_tokenizer.decode(request.prompt_token_ids).startswith("<|im_start|>system\nBe brief")


def test_text_and_token_id_prompts(ctx, tiny_tokenizer):
    assert build(ctx, text="Hello world").prompt_token_ids == tiny_tokenizer.encode("Hello world")
    assert build(ctx, token_ids=[5, 6, 7]).prompt_token_ids == [5, 6, 7]


def test_max_tokens_is_clipped_to_the_remaining_context_when_not_given(ctx):
    request = build(ctx, token_ids=[5] * 200)
    assert request.max_tokens == 256 - 200
    assert build(ctx, GenerationParams(max_tokens=10), token_ids=[5] * 200).max_tokens == 10


def test_eos_stops_generation_unless_ignore_eos(ctx, tiny_tokenizer):
    assert build(ctx, GenerationParams(stop_token_ids=[7])).stop_token_ids == [7, tiny_tokenizer.eos_token_id]
    assert build(ctx, GenerationParams(stop_token_ids=[7], ignore_eos=True)).stop_token_ids == [7]


def test_speculation_overrides_the_default(ctx):
    request = build(ctx, GenerationParams(speculation={"method": "ngram", "num_speculative_tokens": 3}))
    assert (request.speculation.method, request.speculation.num_speculative_tokens) == ("ngram", 3)
    assert build(ctx).speculation == ctx.default_speculation.with_draft_length(None)


def test_a_method_without_a_configured_k_drafts_its_own_default_length(ctx):
    ctx.drafter_limits = lambda: DrafterLimits(max_tree_depth=16, max_cached_requests=10)
    assert build(ctx).speculation.num_speculative_tokens == 16  # suffix: as deep as the drafter's trees
    ngram = build(ctx, GenerationParams(speculation={"method": "ngram"}))
    assert ngram.speculation.num_speculative_tokens == DEFAULT_SPECULATIVE_TOKENS
    configured = dataclasses.replace(ctx, default_speculation=SpeculationSettings(num_speculative_tokens=5))
    assert build(configured, GenerationParams(speculation={"method": "ngram"})).speculation.num_speculative_tokens == 5


def test_requests_are_checked_against_the_drafters_limits(ctx):
    ctx.drafter_limits = lambda: DrafterLimits(max_tree_depth=32, max_cached_requests=10, max_speculative_tokens=16)
    repeated = {"suffix_decoding_max_tree_depth": 32, "num_speculative_tokens": 16}
    same = build(ctx, GenerationParams(speculation=repeated))
    assert same.speculation.num_speculative_tokens == 16
    for speculation, message in [({"suffix_decoding_max_tree_depth": 24}, "fixed by the drafter \\(32\\)"),
                                 ({"num_speculative_tokens": 17}, "at most 16")]:
        with pytest.raises(InvalidRequest, match=message) as raised:
            build(ctx, GenerationParams(speculation=speculation))
        assert raised.value.param == "speculation"


@pytest.mark.parametrize("params, prompt, param, message", [
    (GenerationParams(max_tokens=0), None, "max_tokens", "at least 1"),
    (GenerationParams(max_tokens=-5), None, "max_tokens", "at least 1"),
    (GenerationParams(temperature=2.5), None, "temperature", "between 0 and 2"),
    (GenerationParams(temperature=-0.1), None, "temperature", "between 0 and 2"),
    (GenerationParams(top_p=0.0), None, "top_p", "(0, 1]"),
    (GenerationParams(top_p=1.5), None, "top_p", "(0, 1]"),
    (GenerationParams(top_k=-2), None, "top_k", "top_k"),
    (GenerationParams(seed=-1), None, "seed", "seed"),
    (GenerationParams(stop=["a", "b", "c", "d", "e"]), None, "stop", "at most 4"),
    (GenerationParams(stop=[""]), None, "stop", "non-empty"),
    (GenerationParams(stop_token_ids=[10**6]), None, "stop_token_ids", "outside the vocabulary"),
    (GenerationParams(speculation={"bogus": 1}), None, "speculation", "unknown speculation key 'bogus'"),
    (GenerationParams(speculation={"num_speculative_tokens": "8"}), None, "speculation", "must be of type int"),
    (GenerationParams(speculation={"method": "medusa"}), None, "speculation", "method must be one of"),
    (GenerationParams(speculation={"method": "eagle3"}), None, "speculation", "the verifier has no draft head"),
    (GenerationParams(speculation={"method": "hybrid"}), None, "speculation", "needs a draft head"),
    (GenerationParams(max_tokens=100), {"token_ids": [5] * 200}, "max_tokens", "maximum context length is 256"),
    (GenerationParams(), {"token_ids": [5] * 256}, None, "your request has 256 input tokens"),
    (GenerationParams(), {"chat": ChatPrompt([])}, "messages", "must not be empty"),
    (GenerationParams(), {"chat": ChatPrompt([{"role": "robot", "content": "x"}])}, "messages.0.role",
     "must be one of"),
    (GenerationParams(), {"chat": ChatPrompt([{"role": "user", "content": None}])}, "messages.0.content", "string"),
    (GenerationParams(), {"token_ids": []}, "prompt", "must not be empty"),
    (GenerationParams(), {"token_ids": [-1]}, "prompt", "outside the vocabulary"),
])
def test_bad_requests_are_refused_with_a_clear_message(ctx, params, prompt, param, message):
    with pytest.raises(InvalidRequest, match=message.replace("(", r"\(").replace("[", r"\[")) as raised:
        build(ctx, params, **(prompt or {}))
    assert raised.value.param == param


def test_unknown_model_is_not_found(ctx):
    with pytest.raises(ModelNotFound, match="does not exist"):
        build(ctx, GenerationParams(model="gpt-4"))
    assert build(ctx, GenerationParams(model=MODEL_NAME)).request_id == "req-1"


def test_chat_template_errors_are_invalid_requests(tiny_tokenizer, engine):
    tokenizer = tiny_tokenizer.__class__(tokenizer_object=tiny_tokenizer.backend_tokenizer, eos_token="<|im_end|>",
                                         chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        build(make_context(tokenizer, engine))


def test_limiter_refuses_beyond_the_limit_and_frees_slots(ctx):
    with ctx.limiter.acquire(6):
        with pytest.raises(Overloaded):
            with ctx.limiter.acquire(3):
                pass
        with ctx.limiter.acquire(2):
            assert ctx.limiter.in_flight == 8
    assert ctx.limiter.in_flight == 0


async def collect(ctx, request, stops=()):
    return [delta async for delta in generate_text(ctx, request, stops)]


@pytest.mark.anyio
async def test_generate_text_streams_the_completion_and_finishes(ctx, engine):
    deltas = await collect(ctx, build(ctx))
    assert "".join(d.text for d in deltas) == COMPLETION
    assert [d.finish_reason for d in deltas][-1] == "stop" and all(d.finish_reason is None for d in deltas[:-1])
    assert sum(len(d.token_ids) for d in deltas) == len(engine.token_ids)  # EOS counted, not shown
    steps = -(-len(engine.token_ids) // engine.step_size)
    assert deltas[-1].speculation == engine.usage(steps)
    assert engine.aborted == []


@pytest.mark.anyio
async def test_stop_string_ends_output_and_aborts_the_generation(ctx, engine, tiny_tokenizer):
    deltas = await collect(ctx, build(ctx), stops=["héllo"])
    assert "".join(d.text for d in deltas) == "Hello world! "
    assert deltas[-1].finish_reason == "stop"
    assert engine.aborted == ["req-1"]
    token_ids = [t for d in deltas for t in d.token_ids]
    # Token ids end with the token that completed the stop string.
    assert tiny_tokenizer.decode(token_ids).endswith("héllo")
    assert not tiny_tokenizer.decode(token_ids[:-1]).endswith("héllo")
    assert deltas[-1].speculation.verify_steps > 0  # usage reported so far


@pytest.mark.anyio
async def test_a_generation_cut_by_a_stop_string_still_reports_its_cached_prompt_tokens(ctx):
    deltas = await collect(ctx, build(ctx), stops=["héllo"])
    assert deltas[-1].finish_reason == "stop" and deltas[-1].cached_tokens == FAKE_CACHED_TOKENS


@pytest.mark.anyio
async def test_stop_string_without_intermediate_usage_reports_zero(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, usage_every_step=False)
    ctx = make_context(tiny_tokenizer, engine)
    deltas = await collect(ctx, build(ctx), stops=["world"])
    assert deltas[-1].speculation == SpeculationUsage()


@pytest.mark.anyio
async def test_length_finish_and_held_back_text_is_flushed(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, completion="ab", finish_reason="length")
    ctx = make_context(tiny_tokenizer, engine)
    deltas = await collect(ctx, build(ctx), stops=["bc"])  # "b" is held back: it may start "bc"
    assert "".join(d.text for d in deltas) == "ab"
    assert deltas[-1].finish_reason == "length"


@pytest.mark.anyio
async def test_closing_generate_text_early_aborts_downstream(ctx, engine):
    stream = generate_text(ctx, build(ctx))
    await anext(stream)
    await stream.aclose()
    assert engine.aborted == ["req-1"]
    assert b'vllm:request_success_total{finished_reason="abort",model_name="tiny-chatml"} 1.0' in ctx.metrics.render()


@pytest.mark.anyio
async def test_errors_from_the_engine_propagate(tiny_tokenizer):
    ctx = make_context(tiny_tokenizer, ScriptedEngine(tiny_tokenizer, error=Overloaded("verifier full")))
    with pytest.raises(Overloaded, match="verifier full"):
        await collect(ctx, build(ctx))


def test_chat_prompt_with_every_tokenizer(any_tokenizer, engine):
    ctx = make_context(any_tokenizer, engine, max_context_len=2048)
    prompt = any_tokenizer.decode(build(ctx).prompt_token_ids)
    assert "Say hello" in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert build(ctx).stop_token_ids == [any_tokenizer.convert_tokens_to_ids("<|im_end|>")]


def settings(request) -> tuple:
    controls = request.logit_controls
    return (request.temperature, request.top_p, request.top_k, controls.repetition_penalty, controls.min_p,
            request.max_tokens)


def test_left_out_sampling_settings_take_the_models_defaults(ctx):
    """As OpenAI and vLLM: no temperature is not greedy; the model's generation config decides, else 1.0 with no
    penalty; its max_new_tokens bounds a request that sets no max_tokens."""
    room = ctx.max_context_len - len(build(ctx).prompt_token_ids)
    assert settings(build(ctx)) == (1.0, None, None, 1.0, 0.0, room)
    ctx.sampling_defaults = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.05,
                                             min_p=0.02, max_tokens=7)
    assert settings(build(ctx)) == (0.6, 0.9, 20, 1.05, 0.02, 7)
    explicit = build(ctx, GenerationParams(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=9, logit_controls=(
        LogitControls(repetition_penalty=1.0, min_p=0.0, presence_penalty=0.5))))
    assert settings(explicit) == (0.0, 1.0, None, 1.0, 0.0, 9)
    assert explicit.logit_controls.presence_penalty == 0.5


def test_sampling_defaults_come_from_generation_config_json(tmp_path):
    assert read_sampling_defaults(tmp_path) == SamplingDefaults()  # no file
    config = {"temperature": 0.7, "top_p": 0.8, "top_k": 0, "do_sample": True}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert read_sampling_defaults(tmp_path) == SamplingDefaults(temperature=0.7, top_p=0.8, top_k=None)
    assert read_sampling_defaults(tmp_path, "vllm") == SamplingDefaults()
    # Qwen2.5-Instruct's, and a maximum length
    config |= {"top_k": 20, "repetition_penalty": 1.05, "min_p": 0.01, "max_new_tokens": 2048}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert read_sampling_defaults(tmp_path) == SamplingDefaults(0.7, 0.8, 20, 1.05, 0.01, 2048)
    (tmp_path / "generation_config.json").write_text(json.dumps(config | {"repetition_penalty": 0}))
    with pytest.raises(ValueError, match="generation_config.json: a sampling setting is out of range"):
        read_sampling_defaults(tmp_path)
    assert read_sampling_defaults(tmp_path, "vllm") == SamplingDefaults()
