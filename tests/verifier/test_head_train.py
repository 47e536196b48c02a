"""Head training on a tiny dump: a few dozen steps lower the loss, and the
checkpoint written loads back through read_head + build_head."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from speclane_cli.main import main
from tests.verifier.test_head_extract import CONVERSATIONS, save_tiny_target
from verifier_service.heads.checkpoint import build_head, read_head
from verifier_service.heads.eagle3 import default_aux_layers
from verifier_service.heads.extract import extract, read_shard, shard_paths
from verifier_service.heads.layer import HeadKV
from verifier_service.heads.train import TrainingTimeTestKV, load_target, make_head, sequence_loss, train

DRAFT_VOCAB = 64


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> str:
    return save_tiny_target(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="module")
def dump(target_dir, tmp_path_factory):
    output = tmp_path_factory.mktemp("dump")
    extract(target_dir, CONVERSATIONS, output, source="test", max_new_tokens=24, batch_size=5)  # default layers
    return output


@pytest.fixture(scope="module")
def target(target_dir):
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    return model.config.to_dict(), model.get_input_embeddings().weight.detach(), model.lm_head.weight.detach()


@pytest.mark.parametrize(("kind", "ttt_steps", "bf16"), [("eagle", 1, False), ("eagle3", 2, False),
                                                        ("eagle3", 2, True)])
def test_training_lowers_the_loss_and_saves_a_loadable_head(kind, ttt_steps, bf16, dump, target_dir, target, tmp_path):
    results = train(kind, dump, target_dir, tmp_path, bf16=bf16, epochs=8, lr=3e-3, draft_vocab=DRAFT_VOCAB,
                    ttt_steps=ttt_steps, log_every=5)
    assert results["steps"] == 8 * len(CONVERSATIONS)
    assert results["final_loss"] < results["initial_loss"]
    config, embed, lm_head = target
    head = build_head(read_head(tmp_path, kind, config), embed, lm_head)
    recipe = json.loads((tmp_path / "config.json").read_text())["speclane_training"]
    assert (recipe["kind"], recipe["ttt_steps"], recipe["steps"], recipe["bf16"]) == (kind, ttt_steps, results["steps"],
                                                                                   bf16)
    token_ids, _, hidden, _ = read_shard(shard_paths(dump)[0])
    n = len(token_ids) - 1
    if kind == "eagle3":
        assert head.feature_layers == default_aux_layers(8) and len(head.d2t) == DRAFT_VOCAB
        assert head.t2d[head.draft_token_ids].all() and int(head.t2d.sum()) == DRAFT_VOCAB
        features = hidden[:n, :3].float().flatten(1)  # dump layers (2, 4, 5, 8): the aux ones are first
    else:
        features = hidden[:n, 3].float()
    with torch.no_grad():
        logits = head.logits(head(token_ids[1:], features, torch.arange(n), HeadKV()))
    assert logits.shape == (n, DRAFT_VOCAB if kind == "eagle3" else len(embed)) and logits.isfinite().all()


def test_training_continues_from_a_saved_head_and_keeps_its_draft_vocabulary(dump, target_dir, target, tmp_path):
    first = train("eagle3", dump, target_dir, tmp_path / "first", epochs=8, lr=3e-3, draft_vocab=DRAFT_VOCAB // 2,
                  log_every=5)
    again = train("eagle3", dump, target_dir, tmp_path / "again", init=tmp_path / "first", epochs=1, lr=1e-5,
                  log_every=5)
    assert again["init"] == str(tmp_path / "first")
    assert again["initial_loss"] < 0.9 * first["initial_loss"]  # it starts where the first run got to
    config, embed, lm_head = target
    first_head, head = (build_head(read_head(tmp_path / name, "eagle3", config), embed, lm_head)
                        for name in ("first", "again"))
    assert torch.equal(head.d2t, first_head.d2t) and len(head.d2t) == DRAFT_VOCAB // 2


def test_a_held_out_part_picks_the_epoch_saved(target_dir, tmp_path):
    conversations = [[{"role": "user", "content": f"{c[0]['content']} ({i})"}] for i in range(4) for c in CONVERSATIONS]
    extract(target_dir, conversations, tmp_path / "dump", source="test", max_new_tokens=8, batch_size=10)
    results = train("eagle3", tmp_path / "dump", target_dir, tmp_path / "head", epochs=3, lr=3e-3, holdout=0.1)
    assert (results["held_out_shards"], results["shards"], results["steps"]) == (2, 18, 3 * 18)
    assert results["saved_epoch"] in (1, 2, 3) and len(results["held_out_top1"]) == 1
    assert 0 <= results["held_out_top1"][0] <= 1


def test_max_minutes_stops_early_after_one_step(dump, target_dir, tmp_path):
    results = train("eagle3", dump, target_dir, tmp_path, epochs=50, max_minutes=1e-6)
    assert results["steps"] == 1
    assert (tmp_path / "model.safetensors").exists()


def test_a_dump_without_the_heads_layers_is_refused(target_dir, tmp_path):
    extract(target_dir, CONVERSATIONS[:1], tmp_path / "dump", source="test", layers=(8,), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"lacks hidden_states \[2, 4, 5\]"):
        train("eagle3", tmp_path / "dump", target_dir, tmp_path / "head")


def test_command_line(dump, target_dir, tmp_path):
    assert main(["train-head", "--kind", "eagle", "--data", str(dump), "--target", target_dir, "--output",
                 str(tmp_path), "--device", "cpu", "--threads", "1", "--seed", "3"]) == 0
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle"]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_training_time_test_sees_what_serving_drafts_see(kind, target_dir):
    """Step j of chain i in one training pass equals drafting j tokens after
    committing pairs 0..i with serving's cache: same inputs, same keys seen."""
    torch.manual_seed(0)
    target = load_target(target_dir, "cpu")
    head = make_head(kind, target, torch.arange(DRAFT_VOCAB)).eval()
    n, width = 12, len(head.feature_layers) * target.shape.hidden_size
    tokens, features = torch.randint(0, DRAFT_VOCAB, (n,)), torch.randn(n, width)
    kv, trained, inputs = TrainingTimeTestKV(), [], features
    with torch.no_grad():
        for step in (1, 2, 3):
            chains = n - step - 1
            inputs = head(tokens[step:step + chains], inputs[:chains], torch.arange(chains) + step - 1, kv)
            trained.append(inputs)
        for chain in (0, 4, n - 5):
            serving = HeadKV()
            hidden = head(tokens[1:chain + 2], features[:chain + 1], torch.arange(chain + 1), serving)[-1:]
            for step in (1, 2, 3):
                if step > 1:
                    position = torch.tensor([chain + step - 1])
                    hidden = head(tokens[chain + step:chain + step + 1], hidden, position, serving)
                torch.testing.assert_close(trained[step - 1][chain], hidden[0], rtol=1e-4, atol=1e-4)


def test_a_batch_counts_what_its_sequences_count_alone(target_dir):
    """Padding changes nothing: each sequence's hits and positions in a batch are its own alone."""
    torch.manual_seed(0)
    target = load_target(target_dir, "cpu")
    head = make_head("eagle3", target, torch.arange(DRAFT_VOCAB)).eval()
    lm_rows, width = target.lm_head[:DRAFT_VOCAB], 3 * target.shape.hidden_size
    lengths = (14, 9)
    sequences = [(torch.randint(0, DRAFT_VOCAB, (n,)), torch.rand(n) < 0.7, torch.randn(n, width),
                  torch.randn(n, target.shape.hidden_size)) for n in lengths]
    batch = [torch.zeros(2, 14, *t.shape[1:], dtype=t.dtype) for t in sequences[0]]
    for row, tensors in enumerate(sequences):
        for padded, t in zip(batch, tensors, strict=True):
            padded[row, :len(t)] = t
    with torch.no_grad():
        alone = [sequence_loss(head, lm_rows, *(t[None] for t in tensors), ttt_steps=3) for tensors in sequences]
        loss, hits, counted = sequence_loss(head, lm_rows, *batch, ttt_steps=3)
        one_step = [sequence_loss(head, lm_rows, *(t[None] for t in tensors), ttt_steps=1) for tensors in sequences]
        batch_one_step = sequence_loss(head, lm_rows, *batch, ttt_steps=1)
    assert counted == [a + b for a, b in zip(alone[0][2], alone[1][2], strict=True)] and sum(counted) > 0
    assert hits == [a + b for a, b in zip(alone[0][1], alone[1][1], strict=True)]
    # One step's loss is the mean over the batch's counted positions.
    (loss_a, _, (n_a,)), (loss_b, _, (n_b,)) = one_step
    torch.testing.assert_close(batch_one_step[0], (loss_a * n_a + loss_b * n_b) / (n_a + n_b))


def test_a_dump_of_tokens_alone_trains_online_as_a_full_dump_does(target_dir, tmp_path):
    """Without hidden states in the shards, the target computes them per batch: the
    same batches give the same losses as training on a dump that stored them."""
    for name, with_hidden_states in (("full", True), ("tokens", False)):
        extract(target_dir, CONVERSATIONS, tmp_path / name, source="test", max_new_tokens=24, batch_size=5,
                with_hidden_states=with_hidden_states)
    assert all(read_shard(path)[2] is None for path in shard_paths(tmp_path / "tokens"))
    assert json.loads((tmp_path / "tokens" / "meta.json").read_text())["layers"] == []
    results = {name: train("eagle3", tmp_path / name, target_dir, tmp_path / f"head-{name}", epochs=4, lr=3e-3,
                           draft_vocab=DRAFT_VOCAB, ttt_steps=2, batch_size=3, log_every=1)
               for name in ("full", "tokens")}
    online, offline = results["tokens"], results["full"]
    assert (online["online"], offline["online"], online["steps"]) == (True, False, 4 * 2)
    assert online["final_loss"] < online["initial_loss"]
    # The full dump stores bf16 states; online ones are fp32: close, not equal.
    assert online["initial_loss"] == pytest.approx(offline["initial_loss"], rel=0.02)


def test_a_draft_vocab_given_with_init_is_drawn_again_keeping_the_rows_of_tokens_kept(dump, target_dir, target,
                                                                                      tmp_path):
    train("eagle3", dump, target_dir, tmp_path / "first", epochs=4, lr=3e-3, draft_vocab=DRAFT_VOCAB // 2)
    train("eagle3", dump, target_dir, tmp_path / "again", init=tmp_path / "first", lr=0.0, draft_vocab=DRAFT_VOCAB)
    config, embed, lm_head = target
    first, again = (build_head(read_head(tmp_path / name, "eagle3", config), embed, lm_head)
                    for name in ("first", "again"))
    replied = torch.cat([token_ids[mask] for token_ids, mask, _, _ in map(read_shard, shard_paths(dump))]).unique()
    assert len(again.d2t) == DRAFT_VOCAB and again.t2d[replied].sum() == min(len(replied), DRAFT_VOCAB)
    kept = first.t2d[again.draft_token_ids]
    assert 0 < kept.sum() < DRAFT_VOCAB
    where = torch.searchsorted(first.draft_token_ids, again.draft_token_ids[kept])
    torch.testing.assert_close(again.lm_head.weight[kept], first.lm_head.weight[where])  # trained rows stay
    new_ids = again.draft_token_ids[~kept]
    torch.testing.assert_close(again.lm_head.weight[~kept], lm_head[new_ids].bfloat16().float())  # as a new head's
