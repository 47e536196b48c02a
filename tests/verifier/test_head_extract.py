"""Hidden-state extraction for head training: each shard holds the prompt,
the target's own greedy reply and the hidden states a direct forward gives;
reruns skip what is there, and a run killed mid-write leaves only whole shards."""

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

from speclane_cli.main import main
from verifier_service.heads import extract as extract_module
from verifier_service.heads.extract import Dialogue, extract, prompt_ids, read_shard, shard_paths

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATIONS = [[{"role": "user", "content": text}] for text in (
    "Write a function that adds two numbers.", "What is the capital of France?", "Tell me a story about a fox.",
    "How do hash maps work?", "Sort a list in Python, please.")]
LAYERS = (1, 4, 8)
NEW_TOKENS = 10


def save_tiny_target(path) -> str:
    """An 8-layer random Llama (hidden 32) with a small byte-level BPE and a ChatML template."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([m[0]["content"] for m in CONVERSATIONS] * 4, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        chat_template=CHATML)
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.5, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> str:
    return save_tiny_target(tmp_path_factory.mktemp("tiny-target"))


def run_extract(target_dir, output, **kwargs) -> dict:
    options = {"source": "test", "layers": LAYERS, "max_new_tokens": NEW_TOKENS, "batch_size": 2, **kwargs}
    return extract(target_dir, CONVERSATIONS, output, **options)


def mtimes(output) -> dict:
    return {path.name: path.stat().st_mtime_ns for path in output.iterdir()}


def test_shards_hold_the_targets_greedy_reply_and_its_hidden_states(target_dir, tmp_path):
    assert run_extract(target_dir, tmp_path)["written"] == len(CONVERSATIONS)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    paths = shard_paths(tmp_path)
    assert [p.name for p in paths] == [f"{i:07d}.safetensors" for i in range(len(CONVERSATIONS))]
    for path, messages in zip(paths, CONVERSATIONS, strict=True):
        token_ids, loss_mask, hidden, metadata = read_shard(path)
        prompt = prompt_ids(tokenizer, messages)
        with torch.no_grad():  # unbatched greedy decoding gives the same reply as the batched dump
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0]
            reference = model(expected[None], output_hidden_states=True).hidden_states
        assert token_ids.tolist() == expected.tolist()
        assert loss_mask.tolist() == [False] * len(prompt) + [True] * (len(token_ids) - len(prompt))
        assert hidden.dtype == torch.bfloat16 and hidden.shape == (len(token_ids), len(LAYERS), 32)
        for column, layer in enumerate(LAYERS):
            torch.testing.assert_close(hidden[:, column].float(), reference[layer][0], rtol=2e-2, atol=2e-2)
        assert metadata["layers"] == "1,4,8"
    assert json.loads((tmp_path / "meta.json").read_text())["layers"] == list(LAYERS)


def reply_spans(loss_mask: torch.Tensor) -> list[tuple[int, int]]:
    edges = torch.diff(loss_mask.int(), prepend=torch.zeros(1, dtype=torch.int), append=torch.zeros(1, dtype=torch.int))
    return list(zip(torch.nonzero(edges == 1).flatten().tolist(), torch.nonzero(edges == -1).flatten().tolist(),
                    strict=True))


def test_later_user_turns_are_answered_after_the_targets_own_replies(target_dir, tmp_path):
    conversations = [[*c, {"role": "assistant", "content": "The data set's reply."},
                      {"role": "user", "content": "And then?"}, {"role": "assistant", "content": "Not kept."},
                      {"role": "user", "content": "A third turn, not asked."}] for c in CONVERSATIONS]
    extract(target_dir, conversations, tmp_path, source="test", layers=LAYERS, max_new_tokens=3, batch_size=2,
            turns=2)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    turns_seen = []
    for path, messages in zip(shard_paths(tmp_path), conversations, strict=True):
        token_ids, loss_mask, hidden, _ = read_shard(path)
        spans = reply_spans(loss_mask)
        turns_seen.append(len(spans))
        context = []
        for (start, end), user in zip(spans, (messages[0], messages[2]), strict=False):
            # each reply is the target's greedy reply to the prompt rendered whole, its own replies in it
            assert token_ids[:start].tolist() == prompt_ids(tokenizer, [*context, user])
            with torch.no_grad():
                greedy = model.generate(token_ids[None, :start], max_new_tokens=3, do_sample=False)[0, start:]
            assert token_ids[start:end].tolist() == greedy.tolist()
            context += [user, {"role": "assistant", "content": tokenizer.decode(greedy, skip_special_tokens=True)}]
        assert end == len(token_ids) and hidden.shape[0] == len(token_ids)
        assert "data set" not in tokenizer.decode(token_ids) and "third" not in tokenizer.decode(token_ids)
    assert set(turns_seen) <= {1, 2} and 2 in turns_seen
    assert json.loads((tmp_path / "meta.json").read_text())["turns"] == 2
    with pytest.raises(ValueError, match="turns 2"):  # a resumed dump keeps its turns
        extract(target_dir, conversations, tmp_path, source="test", layers=LAYERS, max_new_tokens=3)
    with pytest.raises(ValueError, match="dataset replies"):
        extract(target_dir, conversations, tmp_path / "dataset", source="test", replies="dataset", turns=2)


def test_a_dialogue_ends_where_the_template_rewrites_an_earlier_turn(target_dir):
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "How are you?"}]
    dialogue = Dialogue.of(messages, turns=5)
    assert dialogue.messages == messages[:1] and dialogue.users == [messages[1], messages[3]]
    prompt = dialogue.next_prompt(tokenizer, max_prompt_tokens=512)
    assert prompt == prompt_ids(tokenizer, messages[:2])
    reply = tokenizer("Hello<|im_end|>", add_special_tokens=False)["input_ids"]
    dialogue.answer(tokenizer, prompt, reply)
    assert dialogue.mask == [0] * len(prompt) + [1] * len(reply)
    assert dialogue.next_prompt(tokenizer, max_prompt_tokens=len(dialogue.ids)) is None  # too long
    assert dialogue.next_prompt(tokenizer, max_prompt_tokens=512)[:len(dialogue.ids)] == dialogue.ids
    # a template that hides earlier replies (as Qwen3's drops their thinking): turn 2 would not see turn 1's reply
    tokenizer.chat_template = CHATML.replace("{{ m['content'] }}",
                                             "{{ '' if m['role'] == 'assistant' else m['content'] }}")
    assert dialogue.next_prompt(tokenizer, max_prompt_tokens=512) is None


def test_dataset_replies_keep_whole_conversations_teacher_forced(target_dir, tmp_path):
    conversations = [c + [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "More?"},
                          {"role": "assistant", "content": f"Answer {i}."}] for i, c in enumerate(CONVERSATIONS)]
    conversations.append([{"role": "user", "content": "No reply here"}])  # nothing to learn: no shard
    summary = run_extract(target_dir, tmp_path, replies="dataset", max_tokens=200)
    assert summary["written"] == 0  # CONVERSATIONS have no assistant turn
    summary = extract(target_dir, conversations, tmp_path / "dump", source="test", layers=LAYERS, replies="dataset")
    assert summary["written"] == len(CONVERSATIONS)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for path, messages in zip(shard_paths(tmp_path / "dump"), conversations, strict=False):
        token_ids, loss_mask, hidden, _ = read_shard(path)
        whole = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
        assert token_ids.tolist() == whole["input_ids"]
        # learned: each reply and its end of turn; not the prompts, not the template's role headers
        learned = tokenizer.decode(token_ids[loss_mask])
        assert learned == "Sure.<|im_end|>\n" + messages[-1]["content"] + "<|im_end|>\n"
        with torch.no_grad():
            reference = model(token_ids[None], output_hidden_states=True).hidden_states
        for column, layer in enumerate(LAYERS):
            torch.testing.assert_close(hidden[:, column].float(), reference[layer][0], rtol=2e-2, atol=2e-2)
    first = read_shard(shard_paths(tmp_path / "dump")[0])[0]
    extract(target_dir, conversations[:1], tmp_path / "cut", source="test", layers=LAYERS, replies="dataset",
            max_tokens=len(first) - 3)
    assert read_shard(shard_paths(tmp_path / "cut")[0])[0].tolist() == first[:-3].tolist()


def test_a_rerun_skips_the_shards_already_there(target_dir, tmp_path):
    run_extract(target_dir, tmp_path, max_samples=3)
    before = mtimes(tmp_path)
    summary = run_extract(target_dir, tmp_path)
    assert (summary["existing"], summary["written"]) == (3, 2)
    after = mtimes(tmp_path)
    assert {name: after[name] for name in before if name != "meta.json"} == \
        {name: t for name, t in before.items() if name != "meta.json"}
    assert run_extract(target_dir, tmp_path)["written"] == 0
    assert len(shard_paths(tmp_path)) == len(CONVERSATIONS)


def test_a_run_killed_mid_write_leaves_whole_shards_and_resumes(target_dir, tmp_path, monkeypatch):
    real_save, calls = extract_module.save_file, []

    def dies_on_third_write(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 3:
            with open(filename, "wb") as f:
                f.write(b"half a shard")
            raise KeyboardInterrupt
        real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(extract_module, "save_file", dies_on_third_write)
    with pytest.raises(KeyboardInterrupt):
        run_extract(target_dir, tmp_path)
    assert [p.name for p in shard_paths(tmp_path)] == ["0000000.safetensors", "0000001.safetensors"]
    for path in shard_paths(tmp_path):
        read_shard(path)  # whole, readable
    before = mtimes(tmp_path)
    monkeypatch.setattr(extract_module, "save_file", real_save)
    assert run_extract(target_dir, tmp_path)["written"] == len(CONVERSATIONS) - 2
    assert [read_shard(p)[0].numel() > 0 for p in shard_paths(tmp_path)] == [True] * len(CONVERSATIONS)
    assert not list(tmp_path.glob(".*.tmp"))
    assert all(mtimes(tmp_path)[f"000000{i}.safetensors"] == before[f"000000{i}.safetensors"] for i in (0, 1))


def test_a_dump_of_other_layers_is_not_added_to(target_dir, tmp_path):
    run_extract(target_dir, tmp_path, max_samples=1)
    with pytest.raises(ValueError, match="layers"):
        run_extract(target_dir, tmp_path, layers=(2, 8))


def test_command_line_with_a_jsonl_file_and_default_layers(target_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Hi there"},
                                             {"role": "assistant", "content": "Hello"}]}) + "\n\n"
                    + json.dumps({"prompt": "Count to three."}) + "\n")
    output = tmp_path / "dump"
    assert main(["extract-hidden-states", "--model", target_dir, "--dataset", str(data), "--output", str(output),
                 "--max-new-tokens", "4", "--threads", "1", "--turns", "2"]) == 0
    meta = json.loads((output / "meta.json").read_text())
    assert (meta["layers"], meta["turns"]) == ([2, 4, 5, 8], 2)  # 2, L/2, L-3, L
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = [token_ids[~loss_mask].tolist() for token_ids, loss_mask, _, _ in map(read_shard, shard_paths(output))]
    assert prompts == [  # the first user turn and what precedes it; not the data set's reply
        prompt_ids(tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]),
        prompt_ids(tokenizer, [{"role": "user", "content": "Count to three."}])]


def test_command_line_dataset_replies_from_a_jsonl_file(target_dir, tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "Count to three.", "completion": "One, two, three."}) + "\n"
                    + json.dumps({"prompt": "No completion: nothing to learn"}) + "\n")
    output = tmp_path / "dump"
    assert main(["extract-hidden-states", "--model", target_dir, "--dataset", str(data), "--output", str(output),
                 "--replies", "dataset", "--threads", "1"]) == 0
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    [(token_ids, loss_mask, _, _)] = map(read_shard, shard_paths(output))
    assert tokenizer.decode(token_ids[loss_mask]) == "One, two, three.<|im_end|>\n"
    assert json.loads((output / "meta.json").read_text())["replies"] == "dataset"
