"""Training data for a head: conversations and the target's hidden states over them.

Two sources of replies. "regenerate": each prompt's reply is the target's own
(greedy), so the head learns what the target says; decoding makes it slow on a
CPU (SmolLM2-135M, 2 cores: 75 tokens/s). Later user turns are answered in
turn, the target's own replies before them, as a chat server replays a
conversation. "dataset": the conversation's own
turns, all of them, teacher-forced in one forward (about 10x faster); the head
still learns the target, since training's labels are the target's
distributions at each position, not the data's tokens (EAGLE trained this way).
One forward over the sequence captures the requested `output_hidden_states`
indices. Every conversation becomes one safetensors shard, written atomically
and skipped when present, so a killed dump resumes where it stopped."""

import json
import os
import pathlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from verifier_service.device import resolve_device
from verifier_service.heads.eagle3 import default_aux_layers

log = structlog.get_logger()
SHARD_SUFFIX = ".safetensors"


def default_layers(num_hidden_layers: int) -> tuple[int, ...]:
    """EAGLE-3's three aux layers, then the final normed hidden (EAGLE-1's
    feature): one dump trains either kind. Duplicates (tiny models) dropped."""
    return tuple(dict.fromkeys((*default_aux_layers(num_hidden_layers), num_hidden_layers)))


def pick_device(requested: str) -> str:
    """Like the verifier's device choice, except that "auto" never tries to import
    torch_npu (it can break torch where CANN is missing); only "npu" does."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_device(requested)


def write_shard(path, token_ids: torch.Tensor, loss_mask: torch.Tensor, hidden_states: torch.Tensor | None,
                metadata: dict) -> None:
    """One sequence: token_ids [N], loss_mask [N] (1 where the head learns),
    hidden_states [N, layers, H] stored as bf16 (None: a dump of tokens alone). Written
    to a temporary name and renamed, so a reader (or a resumed dump) never sees half a shard."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tensors = {"token_ids": token_ids.to(torch.int64).contiguous(), "loss_mask": loss_mask.to(torch.uint8).contiguous()}
    if hidden_states is not None:
        tensors["hidden_states"] = hidden_states.to(torch.bfloat16).contiguous()
    save_file(tensors, str(tmp), metadata={k: str(v) for k, v in metadata.items()})
    os.replace(tmp, path)


def read_shard(path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict]:
    """token_ids, loss_mask (bool), hidden_states (None in a dump of tokens alone), metadata."""
    with safe_open(str(path), "pt") as f:
        hidden = f.get_tensor("hidden_states") if "hidden_states" in f.keys() else None
        return f.get_tensor("token_ids"), f.get_tensor("loss_mask").bool(), hidden, f.metadata() or {}


def shard_length(path) -> int:
    with safe_open(str(path), "pt") as f:
        return f.get_slice("token_ids").get_shape()[0]


def shard_paths(directory) -> list[pathlib.Path]:
    return sorted(pathlib.Path(directory).glob("*" + SHARD_SUFFIX))


def _check_meta(output: pathlib.Path, meta: dict) -> None:
    """A resumed dump must add shards of the same kind: refuse another model, other layers or another
    source (shard names count conversations of the source)."""
    path = output / "meta.json"
    if path.exists():
        old = json.loads(path.read_text())
        keys = ("model", "layers", "source", "replies", "turns")
        old.setdefault("turns", 1 if old.get("replies") == "regenerate" else None)  # dumps from before turns
        if tuple(old.get(k) for k in keys) != tuple(meta[k] for k in keys):
            raise ValueError(f"{output} holds a dump of {old.get('model')} layers {old.get('layers')} from "
                             f"{old.get('source')} ({old.get('replies')} replies, turns {old.get('turns')}); not "
                             f"adding {meta['model']} layers {meta['layers']} from {meta['source']} "
                             f"({meta['replies']} replies, turns {meta['turns']})")
    path.write_text(json.dumps(meta, indent=2) + "\n")


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    if not tokenizer.chat_template:
        raise ValueError("the model's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def generate_replies(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int,
                     eos_ids: set[int]) -> list[list[int]]:
    """Greedy replies for a batch (left-padded: on a CPU, 8 prompts at once
    decode about 4x the tokens per second of one), each cut after its first EOS."""
    width = max(map(len, prompts))
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention_mask[row, width - len(ids):] = 1
    device = model.device
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                         max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id)
    replies = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos_ids), len(row))
        replies.append(row[:end])
    return replies


@dataclass
class Dialogue:
    """A conversation being answered by the target: its next user turns, and the
    token ids so far with 1 in the loss mask on the target's replies."""

    messages: list[dict]  # what precedes the next user turn, the target's replies in it
    users: list[dict]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, messages: list[dict], turns: int) -> "Dialogue":
        """The first `turns` user turns of `messages`; what comes before the first
        (a system prompt) stays, the data set's replies go."""
        first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if first is None:
            raise ValueError(f"a conversation without a user turn: {messages!r:.200}")
        plain = [{"role": m["role"], "content": m["content"]} for m in messages]
        return cls(plain[:first], [m for m in plain[first:] if m["role"] == "user"][:turns])

    def next_prompt(self, tokenizer, max_prompt_tokens: int) -> list[int] | None:
        """The ids of the next turn's prompt as the chat template renders it, or None
        when there is none, it is too long, or it does not begin with the ids so far
        (a template that rewrites earlier turns, or a reply whose text tokenizes
        otherwise): the head must learn each reply in the context that produced it."""
        if not self.users:
            return None
        ids = prompt_ids(tokenizer, [*self.messages, self.users[0]])
        return ids if len(ids) <= max_prompt_tokens and ids[:len(self.ids)] == self.ids else None

    def answer(self, tokenizer, prompt: list[int], reply: list[int]) -> None:
        text = tokenizer.decode(reply, skip_special_tokens=True)
        self.messages += [self.users.pop(0), {"role": "assistant", "content": text}]
        self.mask += [0] * (len(prompt) - len(self.ids)) + [1] * len(reply)
        self.ids = prompt + reply


def answer_turns(model, tokenizer, dialogues: list[Dialogue], max_new_tokens: int, max_prompt_tokens: int,
                 pad_id: int, eos_ids: set[int]) -> None:
    """Answers the dialogues' user turns in order, each turn's prompts decoded
    together; a dialogue whose next prompt cannot be answered ends there."""
    while True:
        live = []
        for dialogue in dialogues:
            prompt = dialogue.next_prompt(tokenizer, max_prompt_tokens)
            if prompt is None:
                dialogue.users = []
            else:
                live.append((dialogue, prompt))
        if not live:
            return
        replies = generate_replies(model, [prompt for _, prompt in live], max_new_tokens, pad_id, eos_ids)
        for (dialogue, prompt), reply in zip(live, replies, strict=True):
            dialogue.answer(tokenizer, prompt, reply)


def conversation_ids(tokenizer, messages: list[dict], max_tokens: int) -> tuple[list[int], list[int]]:
    """A whole conversation's ids and loss mask (1 on assistant replies and their end
    of turn), the first `max_tokens`. Each turn is the chat template's text added by
    that message; a reply is tokenized on its own, as the target would emit it."""
    ids, mask, text = [], [], ""

    def add(rendered: str, learn: bool) -> str:
        if not rendered.startswith(text):
            raise ValueError("the chat template rewrites earlier turns; use --replies regenerate")
        piece = tokenizer(rendered[len(text):], add_special_tokens=False)["input_ids"]
        ids.extend(piece)
        mask.extend([int(learn)] * len(piece))
        return rendered

    for i, message in enumerate(messages):
        if len(ids) >= max_tokens:
            break
        if message["role"] == "assistant":
            text = add(tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=False),
                       False)
        text = add(tokenizer.apply_chat_template(messages[:i + 1], tokenize=False), message["role"] == "assistant")
    return ids[:max_tokens], mask[:max_tokens]


@torch.no_grad()  # not inference_mode: training feeds these to a head it differentiates
def hidden_states_of(decoder, token_ids: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """hidden_states [B, N, len(layers), H] of one forward over token_ids [B, N]
    (the decoder alone: the logits are not needed). Right padding changes no
    earlier position: attention is causal."""
    out = decoder(token_ids, output_hidden_states=True)
    return torch.stack([out.hidden_states[i] for i in layers], dim=2)


def capture(model, token_ids: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """hidden_states [N, len(layers), H] of one sequence, on the CPU."""
    return hidden_states_of(model.get_decoder(), torch.tensor([token_ids], device=model.device), layers)[0].cpu()


REPLIES = ("regenerate", "dataset")


def extract(model_dir, conversations: Iterable[list[dict]], output, *, source: str, layers: tuple[int, ...] = (),
            replies: str = "regenerate", max_samples: int | None = None, max_new_tokens: int = 256,
            max_prompt_tokens: int = 512, max_tokens: int = 1024, batch_size: int = 8, device: str = "cpu",
            with_hidden_states: bool = True, turns: int = 1) -> dict:
    """Writes up to `max_samples` shards (conversation k -> k.safetensors, counting
    only prompts that fit) plus meta.json into `output`; returns a summary.
    "regenerate" answers each conversation's first `turns` user turns, one after
    another (each prompt at most `max_prompt_tokens`, each reply `max_new_tokens`),
    into one shard; "dataset" keeps the whole conversation, cut at `max_tokens`.
    `with_hidden_states=False`: tokens and loss masks alone (meta.json's layers
    empty); train.py then runs the target itself, which on an accelerator costs
    less than reading a dump 500x the size."""
    if replies not in REPLIES:
        raise ValueError(f"replies must be one of {REPLIES}, got {replies!r}")
    if turns < 1 or (turns > 1 and replies == "dataset"):
        raise ValueError(f"turns must be >= 1, and 1 with dataset replies (every turn is kept), got {turns}")
    output = pathlib.Path(output)
    output.mkdir(parents=True, exist_ok=True)
    for stale in output.glob(".*.tmp"):  # left by a killed run
        stale.unlink()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    num_layers = model.config.num_hidden_layers
    layers = (tuple(layers) or default_layers(num_layers)) if with_hidden_states else ()
    if not all(0 <= i <= num_layers for i in layers):
        raise ValueError(f"layers must be within 0..{num_layers} (hidden_states indices), got {layers}")
    meta = {"model": str(model_dir), "layers": list(layers), "hidden_size": model.config.hidden_size,
            "num_hidden_layers": num_layers, "source": source, "replies": replies,
            "max_new_tokens": max_new_tokens if replies == "regenerate" else None,
            "turns": turns if replies == "regenerate" else None}
    _check_meta(output, meta)
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    pad_id = tokenizer.pad_token_id or 0  # any id: pads are masked out, and replies are cut at EOS
    shard_meta = {"model": str(model_dir), "layers": ",".join(map(str, layers))}
    done = {path.name for path in shard_paths(output)}
    summary = {"written": 0, "existing": 0, "too_long": 0, "tokens": 0, "reply_tokens": 0}
    start = time.monotonic()

    def write(name: str, ids: list[int], mask: list[int]) -> None:
        write_shard(output / name, torch.tensor(ids), torch.tensor(mask, dtype=torch.uint8),
                    capture(model, ids, layers) if layers else None, shard_meta)
        summary["written"] += 1
        summary["tokens"] += len(ids)
        summary["reply_tokens"] += sum(mask)
        bar.update(1)
        bar.set_postfix(tok_s=f"{summary['tokens'] / (time.monotonic() - start):.0f}")

    def flush(batch):
        answer_turns(model, tokenizer, [dialogue for _, dialogue in batch], max_new_tokens, max_prompt_tokens,
                     pad_id, eos_ids)
        for name, dialogue in batch:
            write(name, dialogue.ids, dialogue.mask)

    batch, count = [], 0
    with tqdm(total=max_samples, desc="extract-hidden-states", unit="conv") as bar:
        for index, messages in enumerate(conversations):
            if max_samples is not None and count >= max_samples:
                break
            name = f"{index:07d}{SHARD_SUFFIX}"
            if name in done:
                count += 1
                summary["existing"] += 1
                bar.update(1)
                continue
            if replies == "dataset":
                ids, mask = conversation_ids(tokenizer, messages, max_tokens)
                if sum(mask):
                    count += 1
                    write(name, ids, mask)
                continue
            dialogue = Dialogue.of(messages, turns)
            if dialogue.next_prompt(tokenizer, max_prompt_tokens) is None:
                summary["too_long"] += 1
                continue
            count += 1
            batch.append((name, dialogue))
            if len(batch) == batch_size:
                flush(batch)
                batch = []
        if batch:
            flush(batch)
    summary["seconds"] = round(time.monotonic() - start, 1)
    summary["tokens_per_s"] = round(summary["tokens"] / max(summary["seconds"], 1e-9), 1)
    log.info("extracted", output=str(output), **summary)
    return summary
