"""Draft heads inside the verifier: every checkpoint layout loads into the same
module, a wrong checkpoint is refused by name, the head's cache follows the
committed sequence, and head drafts keep greedy output and the sampled
distribution exactly the target's."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import verifier_service.sequence as sequence_module
from tests.heads_support import add_mtp_layer, count_tensor_reads, random_head, write_random_head
from tests.verifier.conftest import VOCAB, make_engine, save_tiny_llama
from tests.verifier.test_engine import SAMPLING_PROMPT, SAMPLING_TRIALS, exact_second_token, p_value
from verifier_service.device import HeadPrecision
from verifier_service.errors import InvalidRequest
from verifier_service.heads.checkpoint import CheckpointError, build_head, read_head
from verifier_service.heads.drafting import HeadDrafter
from verifier_service.heads.layer import HeadKV
from verifier_service.heads.loading import load_head
from verifier_service.sampling import SamplingParams
from verifier_service.sequence import Draft, GenerationParams

PROMPT = [5, 9, 11, 20, 7, 30, 41, 12]


def config_of(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def outputs(head, config) -> torch.Tensor:
    torch.manual_seed(3)
    width = head.fc.in_features if head.kind == "eagle3" else config["hidden_size"]
    features = torch.randn(5, width)
    with torch.no_grad():
        return head.logits(head(torch.tensor([4, 8, 15, 16, 23]), features, torch.arange(5), HeadKV()))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("head-target"))


def _relabel(path, renames: dict[str, str]) -> None:
    tensors = load_file(path / "model.safetensors")
    renamed = {next((to + k[len(frm):] for frm, to in renames.items() if k.startswith(frm)), k): v
               for k, v in tensors.items()}
    save_file(renamed, path / "model.safetensors")


@pytest.mark.parametrize("kind,method,renames", [
    ("eagle", "eagle", {}),
    ("eagle3", "eagle3", {}),
    ("eagle3", "eagle3", {"midlayer.": "layers.0."}),  # speculators' and SpecForge's name of the one layer
    # the layer's input norms outside it, as speclane wrote EAGLE-3 heads before
    ("eagle3", "eagle3", {"midlayer.input_layernorm.": "input_layernorm.", "midlayer.hidden_norm.": "hidden_norm."}),
])
def test_eagle_layouts_load_into_the_module_that_wrote_them(tmp_path, target_dir, kind, method, renames):
    import pathlib
    target = pathlib.Path(target_dir)
    written, config = random_head(kind, target, seed=1)
    out = write_random_head(kind, target, tmp_path / kind, seed=1)
    _relabel(out, renames)
    checkpoint = read_head(out, method, config)
    loaded = build_head(checkpoint, written.embed_weight, written.embed_weight)
    assert checkpoint.kind == kind
    assert torch.allclose(outputs(loaded, config), outputs(written, config))


def test_an_eagle3_checkpoint_is_written_with_the_names_and_config_vllm_loads(tmp_path, target_dir):
    import pathlib
    out = write_random_head("eagle3", pathlib.Path(target_dir), tmp_path / "eagle3")
    layer = [f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"] + \
        [f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")] + \
        [f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")]
    assert sorted(load_file(out / "model.safetensors")) == sorted(
        ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", *layer])
    config = json.loads((out / "config.json").read_text())
    target = config_of(pathlib.Path(target_dir))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == VOCAB // 2
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, target["num_hidden_layers"] // 2,
                                                          target["num_hidden_layers"] - 3]
    assert config["norm_before_residual"] is False


def speculators_eagle3(tmp_path, target_dir, **options):
    """A random EAGLE-3 head in speculators' layout: layers.0.*, its layer settings nested."""
    import pathlib
    out = write_random_head("eagle3", pathlib.Path(target_dir), tmp_path / "speculators", seed=5)
    _relabel(out, {"midlayer.": "layers.0."})
    ours = json.loads((out / "config.json").read_text())
    layer_keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "rms_norm_eps", "vocab_size")
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "draft_vocab_size": ours["draft_vocab_size"], "target_hidden_size": None,
              "transformer_layer_config": {**{k: ours[k] for k in layer_keys}, "rope_theta": 12345.0}, **options}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_speculators_eagle3_head_loads_with_its_own_settings(tmp_path, target_dir):
    import pathlib
    config = config_of(pathlib.Path(target_dir))
    written, _ = random_head("eagle3", pathlib.Path(target_dir), seed=5)
    out = speculators_eagle3(tmp_path, target_dir, norm_before_residual=True,
                             eagle_aux_hidden_state_layer_ids=[1, 3, 4])
    checkpoint = read_head(out, "eagle3", config)
    assert checkpoint.aux_layers == (1, 3, 4) and checkpoint.norm_before_residual
    assert checkpoint.shape.rope_theta == 12345.0  # the nested settings, not the target's
    loaded = build_head(checkpoint, written.embed_weight, written.embed_weight)
    # norm_before_residual: the residual stream starts from hidden_norm(fc(features)), as vLLM computes it
    torch.manual_seed(3)
    features, tokens, positions = torch.randn(4, loaded.fc.in_features), torch.tensor([4, 8, 15, 16]), torch.arange(4)
    with torch.no_grad():
        hidden = loaded.hidden_norm(loaded.fc(features))
        expected = loaded.midlayer(hidden, positions, HeadKV(), attention_input=torch.cat(
            [loaded.input_layernorm(loaded.embed(tokens)), hidden], -1))
        assert torch.allclose(loaded(tokens, features, positions, HeadKV()), expected)
        loaded.norm_before_residual = False
        assert not torch.allclose(loaded(tokens, features, positions, HeadKV()), expected)


def test_a_head_option_speclane_lacks_is_refused_by_name(tmp_path, target_dir):
    import pathlib
    out = speculators_eagle3(tmp_path, target_dir, norm_before_fc=True)
    with pytest.raises(CheckpointError, match="norm_before_fc"):
        read_head(out, "eagle3", config_of(pathlib.Path(target_dir)))


MTP_LAYOUTS = {  # layout -> renames from DeepSeek's names inside the MTP layer, and its prefix
    "qwen3_next_mtp": ("mtp.", {"enorm.": "pre_fc_norm_embedding.", "hnorm.": "pre_fc_norm_hidden.",
                                "eh_proj.": "fc.", "shared_head.norm.": "norm.", "": "layers.0."}),
    "mimo_mtp": ("model.mtp_layers.0.", {"enorm.": "token_layernorm.", "hnorm.": "hidden_layernorm.",
                                         "eh_proj.": "input_proj.", "shared_head.norm.": "final_layernorm.", "": ""}),
}


@pytest.mark.parametrize("layout", ["deepseek_mtp", *MTP_LAYOUTS])
def test_mtp_layouts_load_from_the_target_directory(tmp_path, target_dir, layout):
    import shutil
    target = tmp_path / "target"
    shutil.copytree(target_dir, target)
    add_mtp_layer(target, seed=2)
    written, config = random_head("mtp", target, seed=2)
    if layout != "deepseek_mtp":
        prefix, renames = MTP_LAYOUTS[layout]
        deepseek = f"model.layers.{config['num_hidden_layers']}."
        tensors = load_file(target / "model.safetensors")
        for key in [k for k in tensors if k.startswith(deepseek)]:
            inner = key[len(deepseek):]
            frm = next(f for f in renames if inner.startswith(f))
            value = tensors.pop(key)
            if layout == "qwen3_next_mtp" and inner.endswith("norm.weight"):
                value = value - 1  # zero-centred norms store weight - 1 for the same function
            tensors[prefix + renames[frm] + inner[len(frm):]] = value
        save_file(tensors, target / "model.safetensors")
    checkpoint = read_head(target, "deepseek_mtp", config)
    assert (checkpoint.kind, checkpoint.layout) == ("mtp", layout)
    loaded = build_head(checkpoint, written.embed_weight, written.embed_weight)
    if layout == "mimo_mtp":  # MiMo concatenates [hidden, embedding]: same weights, another function
        assert loaded.hidden_first and not torch.allclose(outputs(loaded, config), outputs(written, config))
    else:
        assert torch.allclose(outputs(loaded, config), outputs(written, config))


def test_a_checkpoint_with_missing_or_unexpected_tensors_is_refused_by_name(tmp_path, target_dir):
    import pathlib
    out = write_random_head("eagle3", pathlib.Path(target_dir), tmp_path / "bad")
    tensors = load_file(out / "model.safetensors")
    del tensors["midlayer.mlp.up_proj.weight"]
    tensors["midlayer.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, out / "model.safetensors")
    config = config_of(pathlib.Path(target_dir))
    with pytest.raises(CheckpointError, match=r"missing \['midlayer.mlp.up_proj.weight'\].*"
                                              r"unexpected \['midlayer.mlp.extra_proj.weight'\]"):
        build_head(read_head(out, "eagle3", config), torch.zeros(VOCAB, 32), torch.zeros(VOCAB, 32))
    narrow = write_random_head("eagle3", pathlib.Path(target_dir), tmp_path / "narrow")
    tensors = load_file(narrow / "model.safetensors")
    tensors["fc.weight"] = torch.zeros(32, 2 * 32)  # a head for two aux layers, or for another target's width
    save_file(tensors, narrow / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"does not fit the target: fc.weight \[32, 64\] \(expected \[32, 96\]"):
        build_head(read_head(narrow, "eagle3", config), torch.zeros(VOCAB, 32), torch.zeros(VOCAB, 32))
    with pytest.raises(CheckpointError, match="holds a eagle3 head, not one for method 'eagle'"):
        read_head(out, "eagle", config)
    with pytest.raises(CheckpointError, match="no head layout recognized"):
        save_file({"w": torch.zeros(1)}, out / "model.safetensors")
        read_head(out, "eagle3", config)


@pytest.fixture(scope="module", params=["eagle", "eagle3", "mtp"])
def head_engine(request, runner, tmp_path_factory):
    """An engine over the shared tiny runner with a random head of each kind."""
    import pathlib
    directory = write_random_head(request.param, pathlib.Path(runner.model_dir),
                                  tmp_path_factory.mktemp(request.param), seed=4)
    head = load_head(request.param, str(directory), runner)
    engine = make_engine(runner)
    engine.head = head
    runner.feature_layers = head.head.feature_layers
    yield engine
    runner.feature_layers = ()


def generate(engine, k: int, use_head: bool, max_new_tokens: int = 30):
    seq = engine.open("s", PROMPT, GenerationParams(max_new_tokens=max_new_tokens, ignore_eos=True,
                                                    num_head_draft_tokens=k))
    engine.prefill(seq)
    accepted = 0
    while not seq.finished:
        accepted += engine.verify(seq, seq.own_draft() if use_head else Draft()).num_accepted
    engine.close(seq)
    return seq, accepted


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_with_head_drafts_equals_plain(head_engine, k):
    plain, _ = generate(head_engine, 0, use_head=False)
    drafted, _ = generate(head_engine, k, use_head=True)
    assert drafted.tokens == plain.tokens
    assert drafted.num_draft_tokens > 0


def assert_head_cache_is_the_committed_pairs(head_engine, hf_model, seq):
    """The head's keys equal a head run over the whole sequence's features at once."""
    head = head_engine.head.head
    with torch.no_grad():
        hidden = hf_model(torch.tensor([seq.tokens]), output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i][0] for i in head.feature_layers], -1)
        kv = HeadKV()
        head(torch.tensor(seq.tokens[1:]), features[:-1], torch.arange(len(seq.tokens) - 1), kv)
    cached = len(seq.head.kv)
    assert cached >= len(seq.tokens) - 3  # all but the last step's pairs, fed on the next draft
    assert torch.allclose(kv.keys[:, :cached], seq.head.kv.keys, atol=1e-4)


@pytest.mark.parametrize("precision", [HeadPrecision(torch.bfloat16), HeadPrecision(torch.bfloat16, True)],
                         ids=["bf16", "int8"])
def test_a_head_in_its_own_precision_beside_an_fp32_target_keeps_greedy_output(runner, tmp_path, precision):
    """A head's precision is its own: it only proposes, the target verifies in fp32."""
    import pathlib
    directory = write_random_head("eagle3", pathlib.Path(runner.model_dir), tmp_path / "h", seed=4)
    engine = make_engine(runner)
    engine.head = load_head("eagle3", str(directory), runner, precision)
    assert engine.head.head.fc.weight.dtype is (torch.int8 if precision.int8_weights else torch.bfloat16)
    runner.feature_layers = engine.head.head.feature_layers
    try:
        plain, _ = generate(engine, 0, use_head=False)
        drafted, _ = generate(engine, 3, use_head=True)
    finally:
        runner.feature_layers = ()
    assert drafted.tokens == plain.tokens and drafted.num_draft_tokens > 0


def test_the_head_cache_holds_exactly_the_committed_pairs(head_engine, hf_model):
    seq, _ = generate(head_engine, 3, use_head=True)  # accepted and rejected drafts
    assert_head_cache_is_the_committed_pairs(head_engine, hf_model, seq)


def test_a_head_drafting_on_demand_drafts_for_the_steps_that_verify_its_draft_alone(head_engine, hf_model):
    """Beside a sequence whose head drafts after every step: a client's draft
    step makes no head draft, and each step that asks for the head's draft
    verifies the one the head would have made after the step before (the
    pairs it skipped go through the head first)."""
    plain, _ = generate(head_engine, 0, use_head=False)
    after_every_step, on_demand = (
        head_engine.open("s", PROMPT, GenerationParams(max_new_tokens=30, ignore_eos=True, num_head_draft_tokens=2,
                                                       head_draft_on_demand=demand)) for demand in (False, True))
    for seq in (after_every_step, on_demand):
        head_engine.prefill(seq)
    run = tuple(plain.tokens[len(PROMPT) + 1: len(PROMPT) + 4])
    # Each answer reports the head's drafting it paid for: none on a client's draft step, on demand.
    client_step = head_engine.verify(after_every_step, Draft(run))
    assert client_step.head_draft and client_step.head_draft_seconds > 0
    client_step = head_engine.verify(on_demand, Draft(run))
    assert client_step.head_draft == () and client_step.head_draft_seconds == 0
    head_steps = 0
    while not on_demand.finished:
        expected = head_engine.verify(after_every_step, Draft(from_head=True))
        result = head_engine.verify(on_demand, Draft(from_head=True))
        assert (result.token_ids, result.num_draft_tokens) == (expected.token_ids, expected.num_draft_tokens)
        assert result.head_draft == () and result.head_draft_seconds > 0
        head_steps += result.num_draft_tokens > 0
    for seq in (after_every_step, on_demand):
        head_engine.close(seq)
    assert on_demand.tokens == plain.tokens and head_steps > 5
    assert_head_cache_is_the_committed_pairs(head_engine, hf_model, on_demand)


def test_a_head_method_on_a_verifier_without_a_head_is_invalid(engine):
    with pytest.raises(InvalidRequest, match="no draft head"):
        engine.open("s", PROMPT, GenerationParams(num_head_draft_tokens=2))


def head_second_tokens(engine, on_demand: bool = False) -> tuple[list[int], int]:
    tokens, accepted = [], 0
    for seed in range(SAMPLING_TRIALS):
        params = GenerationParams(SamplingParams(temperature=1.0, seed=seed), max_new_tokens=8, ignore_eos=True,
                                  num_head_draft_tokens=2, head_draft_on_demand=on_demand)
        seq = engine.open("s", SAMPLING_PROMPT, params)
        engine.prefill(seq)
        result = engine.verify(seq, Draft(from_head=True))
        tokens.append(result.token_ids[0])
        accepted += result.num_accepted > 0
        engine.close(seq)
    return tokens, accepted


@pytest.mark.parametrize("on_demand", [False, True], ids=["after-each-step", "on-demand"])
def test_sampling_with_head_proposals_keeps_the_target_distribution(head_engine, hf_model, on_demand):
    plain, _ = exact_second_token(hf_model, SAMPLING_PROMPT)
    tokens, accepted = head_second_tokens(head_engine, on_demand)
    assert 0.02 < accepted / SAMPLING_TRIALS < 0.98  # both the accept and the residual paths ran
    assert p_value(tokens, plain) > 0.001


def test_the_chi_square_sees_head_drafts_judged_with_the_wrong_q(head_engine, hf_model, monkeypatch):
    """Control: min(1, p/q) with a q other than the one the tokens were drawn
    from is lossy, and the test sees it (judging them as deterministic drafts
    would not be: any token chosen independently of the target's draw is)."""
    if head_engine.head.head.kind != "eagle3":
        pytest.skip("one control is enough")

    def wrong_q(seq):
        q = seq.head_draft.proposals ** 3
        return Draft(seq.head_draft.token_ids, proposal_probs=q / q.sum(-1, keepdim=True))

    monkeypatch.setattr(sequence_module.Sequence, "own_draft", wrong_q)
    plain, _ = exact_second_token(hf_model, SAMPLING_PROMPT)
    tokens, _ = head_second_tokens(head_engine)
    assert p_value(tokens, plain) < 1e-6


def test_the_drafter_samples_from_the_draft_vocabulary_it_reports(runner, tmp_path):
    """EAGLE-3 maps draft ids to target ids through d2t, and q lives on those ids only."""
    import pathlib
    directory = write_random_head("eagle3", pathlib.Path(runner.model_dir), tmp_path / "h", seed=5)
    drafter: HeadDrafter = load_head("eagle3", str(directory), runner)
    allowed = set(drafter.head.draft_token_ids.tolist())
    engine = make_engine(runner)
    engine.head = drafter
    runner.feature_layers = drafter.head.feature_layers
    try:
        seq = engine.open("s", PROMPT, GenerationParams(SamplingParams(temperature=1.0, seed=1),
                                                        max_new_tokens=8, num_head_draft_tokens=3))
        engine.prefill(seq)
        draft = seq.own_draft()
        assert set(draft.token_ids) <= allowed
        support = set(torch.nonzero(draft.proposal_probs.sum(0)).flatten().tolist())
        assert support <= allowed
        assert np.allclose(draft.proposal_probs.sum(-1).numpy(), 1.0, atol=1e-5)
    finally:
        runner.feature_layers = ()


def test_extract_hidden_states_writes_each_prompt_and_answers_one_token(runner, hf_model, tmp_path):
    """vLLM's extract_hidden_states, served: the file holds what a direct forward
    gives at the chosen layers, also when the prompt is prefilled in chunks."""
    from verifier_service.heads.capture import HiddenStateCapture
    from verifier_service.heads.extract import read_shard
    from verifier_service.scheduler import BatchLimits

    engine = make_engine(runner, limits=BatchLimits(max_tokens=5))
    layers = (1, 2)
    engine.start_capture(HiddenStateCapture(str(tmp_path), layers, runner.model.config))
    try:
        seq = engine.open("../req-1", PROMPT * 2, GenerationParams(max_new_tokens=8, ignore_eos=True))
        result = engine.prefill(seq)
    finally:
        runner.feature_layers = ()
    assert len(result.token_ids) == 1 and seq.finished
    (path,) = tmp_path.glob("*.safetensors")
    assert path.name == "___req-1.safetensors"  # the client's id cannot leave the directory
    token_ids, loss_mask, hidden, _ = read_shard(path)
    with torch.no_grad():
        expected = hf_model(torch.tensor([PROMPT * 2]), output_hidden_states=True).hidden_states
    assert token_ids.tolist() == PROMPT * 2 and bool(loss_mask.all())
    assert hidden.shape == (len(PROMPT) * 2, 2, 32)
    for i, layer in enumerate(layers):
        assert torch.allclose(hidden[:, i].float(), expected[layer][0], atol=0.05, rtol=0.02)


def test_the_verifier_reads_its_part_of_a_speculative_config():
    from verifier_service.config import DraftSettings, draft_settings

    assert draft_settings('{"method": "eagle3", "model": "/h", "num_speculative_tokens": 4}') == DraftSettings(
        head_method="eagle3", head_model="/h")
    assert draft_settings('{"method": "suffix"}') == DraftSettings()
    assert draft_settings('{"method": "extract_hidden_states", "shared_storage_path": "/tmp/hs", '
                          '"draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}}'
                          ) == DraftSettings(capture_layers=(1, 2), capture_dir="/tmp/hs")
    with pytest.raises(ValueError, match="shared_storage_path"):
        draft_settings('{"method": "extract_hidden_states"}')
    with pytest.raises(ValueError, match="draft_tensor_parallel_size must be 1"):
        draft_settings('{"method": "mtp", "draft_tensor_parallel_size": 2}')


def test_a_draft_token_cost_cuts_drafts_where_the_head_is_unsure(head_engine, monkeypatch):
    full, _ = generate(head_engine, 4, use_head=True)
    monkeypatch.setattr(head_engine, "draft_token_costs", {1: 0.05})
    cut, _ = generate(head_engine, 4, use_head=True)
    assert cut.tokens == full.tokens
    assert 0 < cut.num_draft_tokens < full.num_draft_tokens


class ScriptedHead:
    """A head whose draft step i is sure of token i with probability TOP[i]."""

    TOP = (0.9, 0.5, 0.5)
    embed_weight = torch.zeros(8, 1)
    draft_token_ids = None

    def __call__(self, token_ids, features, positions, kv):  # the hidden state counts the draft steps
        return features[:, :1] + 1 if features.shape[-1] == 1 and len(token_ids) == 1 else torch.zeros(1, 1)

    def logits(self, hidden):
        top = self.TOP[int(hidden[0, 0])]
        return torch.tensor([[top] + [(1 - top) / 7] * 7]).log()


@pytest.mark.parametrize("token_cost,length", [(0.0, 3), (0.2, 2), (1.0, 0)])
def test_a_head_draft_stops_before_the_token_that_does_not_pay_for_its_verification(token_cost, length):
    """Confidences 0.9, 0.45, 0.225: at 0.2 of a plain step per token the third
    would lower the tokens per cost (2.35 / 1.4 -> 2.575 / 1.6); at 1.0 even the
    first would (1 -> 1.9 / 2); at 0 every token is free."""
    from verifier_service.heads.drafting import HeadState

    state = HeadState()
    state.add(0, torch.zeros(1, 2), [3])
    draft = HeadDrafter(ScriptedHead()).draft(state, 3, None, token_cost=token_cost)
    assert draft.token_ids == (0,) * length
    assert draft.score == pytest.approx([0, 0.9, 1.35, 1.575][length])


def test_a_head_method_without_a_head_to_load_is_a_config_error(tiny_model_dir):
    from verifier_service.config import VerifierConfig

    with pytest.raises(ValueError, match="no eagle3 head ships for .*give one with the speculative config's"):
        VerifierConfig(model=tiny_model_dir, speculative_config='{"method": "eagle3"}')
    VerifierConfig(model=tiny_model_dir, speculative_config='{"method": "mtp"}')  # the target's own layers


def test_a_head_drafts_less_when_more_sequences_share_the_verify_pass(head_engine, monkeypatch):
    """The cost by batch size (here free alone, ten plain steps a token among 8): the head's
    drafts stop where they would not pay at the load of the pass they join."""
    monkeypatch.setattr(head_engine, "draft_token_costs", {1: 0.0, 8: 10.0})
    params = GenerationParams(max_new_tokens=8, ignore_eos=True, num_head_draft_tokens=3)
    others = [head_engine.open(f"o{i}", PROMPT, params) for i in range(7)]
    for seq in others:
        head_engine.prefill(seq)
    seq = head_engine.open("s", PROMPT, params)
    assert head_engine.prefill(seq).head_draft == ()  # 8 running
    for other in others:
        head_engine.close(other)
    assert len(head_engine.verify(seq, Draft()).head_draft) == 3  # alone
    head_engine.close(seq)


@pytest.mark.parametrize("layout", ["deepseek_mtp", "qwen3_next_mtp"])
def test_an_mtp_head_reads_only_the_mtp_layer_of_the_targets_checkpoint(tmp_path, target_dir, layout, monkeypatch):
    """A DeepSeek-V3 target is about 700 GB: the MTP layer is read, the target's own layers never are."""
    import shutil


    target = tmp_path / "target"
    shutil.copytree(target_dir, target)
    add_mtp_layer(target, seed=2)
    _, config = random_head("mtp", target, seed=2)
    deepseek = f"model.layers.{config['num_hidden_layers']}."
    if layout == "qwen3_next_mtp":
        prefix, renames = MTP_LAYOUTS[layout]
        tensors = load_file(target / "model.safetensors")
        for key in [k for k in tensors if k.startswith(deepseek)]:
            inner = key[len(deepseek):]
            frm = next(f for f in renames if inner.startswith(f))
            tensors[prefix + renames[frm] + inner[len(frm):]] = tensors.pop(key)
        save_file(tensors, target / "model.safetensors")
    own = "mtp." if layout == "qwen3_next_mtp" else deepseek
    read = count_tensor_reads(monkeypatch)
    assert read_head(target, "deepseek_mtp", config).layout == layout
    assert read and all(name.startswith(own) for name in read)
    assert len(read) < len(load_file(target / "model.safetensors"))


def test_an_mtp_layer_the_target_architecture_does_not_have_is_refused_by_name(tmp_path, target_dir):
    """MoE tensors make the block the target architecture's own layer (test_native_mtp.py): on a Llama target
    they match no module and are named; a linear-attention MTP layer is refused before anything is built."""
    import shutil
    target = tmp_path / "target"
    shutil.copytree(target_dir, target)
    add_mtp_layer(target, seed=2)
    _, config = random_head("mtp", target, seed=2)
    tensors = load_file(target / "model.safetensors")
    layer = f"model.layers.{config['num_hidden_layers']}."
    tensors[layer + "mlp.gate.weight"] = torch.zeros(2, 32)  # an MoE router, which Llama's layers have not
    save_file(tensors, target / "model.safetensors")
    checkpoint = read_head(target, "deepseek_mtp", config)
    with pytest.raises(CheckpointError, match=r"unexpected \['layer.mlp.gate.weight'\]"):
        build_head(checkpoint, torch.zeros(VOCAB, 32), torch.zeros(VOCAB, 32))
    tensors[layer + "linear_attn.in_proj_qkvz.weight"] = torch.zeros(4, 4)
    save_file(tensors, target / "model.safetensors")
    with pytest.raises(CheckpointError, match="linear attention; MTP layers are served with full attention only"):
        read_head(target, "deepseek_mtp", config)
