"""Training an EAGLE or EAGLE-3 head on a hidden-state dump (extract.py).

Pair i of a sequence is (target feature at i, token i+1); the head's output
there should be the target's final hidden state at i+1, whose lm_head
distribution predicts token i+2. The loss is a soft cross-entropy against that
distribution (EAGLE-3: restricted to the draft vocabulary and renormalized),
plus for EAGLE-1 a SmoothL1 regression onto the final hidden state itself.
A batch of sequences per optimizer step (one by default); the target's
embedding and lm_head stay frozen. A dump of tokens alone is trained online:
the target computes each batch's hidden states as training goes."""

import copy
import json
import math
import pathlib
import random
import time
from dataclasses import dataclass

import structlog
import torch
import torch.nn.functional as F
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from verifier_service.heads.checkpoint import build_head, read_head, save_head
from verifier_service.heads.eagle import EagleHead
from verifier_service.heads.eagle3 import Eagle3Head, default_aux_layers
from verifier_service.heads.extract import default_layers, hidden_states_of, read_shard, shard_length, shard_paths
from verifier_service.heads.head import Head
from verifier_service.heads.layer import LayerShape

log = structlog.get_logger()
CE_WEIGHT = 0.1  # EAGLE-1's weights: 1.0 * SmoothL1(hidden) + 0.1 * CE(tokens)
TTT_DECAY = 0.8  # EAGLE-3 weighs training-time-test step j's loss by 0.8^(j-1)
GRAD_CLIP = 0.5  # as EAGLE's training
DRAFT_VOCAB = 8192  # EAGLE-3's draft vocabulary of a new head
WARMUP = 0.03  # fraction of the step or time budget with a linear LR ramp; cosine decay after


@dataclass(frozen=True)
class Target:
    config: dict
    shape: LayerShape
    embed: torch.Tensor
    lm_head: torch.Tensor
    final_norm: torch.Tensor
    last_layer: dict[str, torch.Tensor]
    decoder: torch.nn.Module | None = None  # kept for online training only


def layer_shape(config, layer_state: dict) -> LayerShape:
    rope = getattr(config, "rope_parameters", None) or {}  # transformers 5 keeps rope_theta here
    heads = config.num_attention_heads
    return LayerShape(
        hidden_size=config.hidden_size, num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate_size=config.intermediate_size, rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        rope_theta=float(getattr(config, "rope_theta", None) or rope.get("rope_theta", 10000.0)),
        attention_bias="self_attn.q_proj.bias" in layer_state, qk_norm="self_attn.q_norm.weight" in layer_state,
    )


def load_target(model_dir, device: str, keep_decoder: bool = False) -> Target:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    decoder = model.get_decoder()
    last = {k: v.detach().clone() for k, v in decoder.layers[-1].state_dict().items()}
    return Target(model.config.to_dict(), layer_shape(model.config, last),
                  model.get_input_embeddings().weight.detach().to(device),
                  model.get_output_embeddings().weight.detach().to(device), decoder.norm.weight.detach().clone(), last,
                  decoder.to(device).eval() if keep_decoder else None)


def draft_vocabulary(paths, vocab_size: int, size: int) -> torch.Tensor:
    """EAGLE-3's reduced vocabulary: the `size` most frequent target ids among the
    loss-masked tokens, ascending (so d2t, the id offset, never decreases)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for path in paths:
        with safe_open(str(path), "pt") as f:
            counts += torch.bincount(f.get_tensor("token_ids")[f.get_tensor("loss_mask").bool()],
                                     minlength=vocab_size)
    return counts.topk(min(size, vocab_size)).indices.sort().values


def make_head(kind: str, target: Target, draft_ids: torch.Tensor | None) -> Head:
    if kind == "eagle":
        # Random init: EAGLE-1's layer output is the normed feature itself (SmolLM2: rms ~2); the
        # target's last layer makes updates sized for a residual stream of rms ~120, and starting
        # from it trained far worse (SmolLM2, held-out top-1 after 2 epochs: 0.06 against 0.24).
        return EagleHead(target.shape, target.embed, target.lm_head)
    head = Eagle3Head(target.shape, target.embed, default_aux_layers(target.config["num_hidden_layers"]),
                      len(draft_ids), target.embed.shape[0])
    # Start the readout where the target's is: its lm_head rows and its norm.
    _set_vocabulary(head, draft_ids, target.lm_head[draft_ids.to(target.lm_head.device)])
    with torch.no_grad():
        head.norm.weight.copy_(target.final_norm)
    # Optional init trick from EAGLE practice: the target's last decoder layer wherever the shapes
    # match (q/k/v read 2H and stay random). A small gain here: held-out top-1 after 4 epochs
    # 0.287 against 0.275.
    own = head.midlayer.state_dict()
    head.midlayer.load_state_dict({k: v for k, v in target.last_layer.items()
                                   if k in own and own[k].shape == v.shape}, strict=False)
    return head


def _set_vocabulary(head: Eagle3Head, draft_ids: torch.Tensor, rows: torch.Tensor) -> None:
    head.d2t.copy_(draft_ids - torch.arange(len(draft_ids), device=draft_ids.device))
    head.t2d.zero_()
    head.t2d[draft_ids] = True
    with torch.no_grad():
        head.lm_head.weight.copy_(rows)


def redraw_vocabulary(head: Eagle3Head, target: Target, draft_ids: torch.Tensor) -> Eagle3Head:
    """`head` over another draft vocabulary (ascending target ids): a token it had
    keeps its trained lm_head row, a new one starts from the target's row, as every
    row of a new head does. For continuing a head on data whose replies use other
    tokens (the target's own replies rather than a data set's)."""
    old_ids, old_rows = head.draft_token_ids, head.lm_head.weight.detach()
    new = Eagle3Head(head.shape, head.embed_weight, head.feature_layers, len(draft_ids), len(head.t2d),
                     head.norm_before_residual).to(old_rows.device, old_rows.dtype)
    new.load_state_dict({k: v for k, v in head.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")},
                        strict=False)
    rows = target.lm_head[draft_ids.to(target.lm_head.device)].to(old_rows.dtype).clone()
    kept = head.t2d[draft_ids]
    rows[kept] = old_rows[torch.searchsorted(old_ids, draft_ids[kept])]
    _set_vocabulary(new, draft_ids, rows)
    return new


class TrainingTimeTestKV:
    """EAGLE-3's training-time test in one cache, for a batch of `batch` sequences
    whose rows arrive one sequence after another. Step 1 appends an entry per pair
    (target features); step j > 1 one per chain, chain i being the draft that starts
    after pair i, fed the head's own step j-1 output. Chain i's step-j query sees step
    1's entries 0..i of its sequence and its own entries of steps 2..j: what serving's
    cache holds when drafting token j after committed position i. The layer's
    attention calls `attend` as it calls a HeadKV's; the mask is this cache's own."""

    def __init__(self, batch: int = 1):
        self.batch = batch
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []  # [batch, kv_heads, n, d] per step

    def attend(self, q, k, v, mask=None):
        def per_sequence(x):  # [heads, batch * n, d] -> [batch, heads, n, d]; fp32 as serving's cache
            return x.float().unflatten(1, (self.batch, -1)).transpose(0, 1)

        q, k, v = per_sequence(q), per_sequence(k), per_sequence(v)
        self.steps.append((k, v))
        n = k.shape[2]  # chains shrink by one per step: later steps' labels run off the end
        keys = torch.cat([old[:, :, :n] for old, _ in self.steps], 2)
        values = torch.cat([old[:, :, :n] for _, old in self.steps], 2)
        own_chain = [torch.eye(n, dtype=torch.bool, device=q.device)] * (len(self.steps) - 1)
        visible = torch.cat([torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), *own_chain], 1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, enable_gqa=k.shape[1] != q.shape[1])
        return out.transpose(0, 1).flatten(1, 2)


def sequence_loss(head: Head, lm_rows: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor,
                  features: torch.Tensor, final: torch.Tensor, ttt_steps: int):
    """(loss or None if nothing is masked in, top-1 hits per step, positions per step) of
    a batch of sequences: tokens and mask [B, N], features [B, N, F], final [B, N, H].

    Step 1 reads the target's features; step j > 1 the head's step j-1 outputs, one
    position on, attending as TrainingTimeTestKV says. The label of a position is
    the target's distribution there; a position counts when the token it predicts
    is masked in (padding never is). Top-1 hits: the head's first choice is the target's."""
    batch, length = tokens.shape
    total, hits, counted, kv = None, [], [], TrainingTimeTestKV(batch)
    # Every step's labels are a slice of the target's distributions, so they are computed once.
    goal_logits = final @ lm_rows.T
    goal_probs, goal_top1 = F.softmax(goal_logits, -1), goal_logits.argmax(-1)
    for step in range(1, ttt_steps + 1):
        n = length - step - 1  # pairs whose predicted token is in the sequence
        if n <= 0:
            break
        positions = (torch.arange(n, device=tokens.device) + step - 1).repeat(batch)
        hidden = head(tokens[:, step:step + n].reshape(-1), features[:, :n].flatten(0, 1), positions, kv)
        hidden = hidden.unflatten(0, (batch, n))
        keep = mask[:, step + 1:step + 1 + n]
        counted.append(int(keep.sum()))
        hits.append(0)
        if keep.any():
            out = hidden[keep]
            logits = head.logits(out)
            loss = -(goal_probs[:, step:step + n][keep] * F.log_softmax(logits, -1)).sum(-1).mean()
            if head.kind == "eagle":
                loss = F.smooth_l1_loss(out, final[:, step:step + n][keep]) + CE_WEIGHT * loss
            total = loss * TTT_DECAY ** (step - 1) + (0 if total is None else total)
            hits[-1] = int((logits.argmax(-1) == goal_top1[:, step:step + n][keep]).sum())
        features = hidden
    return total, hits, counted


def read_batch(paths) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Shards right-padded to the longest: tokens [B, N], loss mask [B, N] (False on
    padding), hidden states [B, N, layers, H] (None in a dump of tokens alone)."""
    shards = [read_shard(path)[:3] for path in paths]
    length = max(len(tokens) for tokens, _, _ in shards)
    tokens = torch.zeros(len(shards), length, dtype=torch.long)
    mask = torch.zeros(len(shards), length, dtype=torch.bool)
    hidden = None if shards[0][2] is None else torch.zeros(len(shards), length, *shards[0][2].shape[1:])
    for row, (ids, loss_mask, states) in enumerate(shards):
        tokens[row, :len(ids)], mask[row, :len(ids)] = ids, loss_mask
        if hidden is not None:
            hidden[row, :len(ids)] = states.float()
    return tokens, mask, hidden


def length_grouped_batches(paths, lengths: dict, batch_size: int, rng: random.Random) -> list[list]:
    """Shuffled batches whose sequences are of similar length (less padding): sorted by
    length within windows of 64 batches, the batches then shuffled."""
    paths, batches, window = rng.sample(paths, len(paths)), [], 64 * batch_size
    for start in range(0, len(paths), window):
        group = sorted(paths[start:start + window], key=lengths.__getitem__)
        batches += [group[i:i + batch_size] for i in range(0, len(group), batch_size)]
    rng.shuffle(batches)
    return batches


def _lr_factor(progress: float) -> float:
    if progress < WARMUP:
        return progress / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (progress - WARMUP) / (1 - WARMUP)))


def train(kind: str, data, target_dir, output, *, init=None, bf16: bool = False, epochs: int = 1, lr: float = 3e-4,
          draft_vocab: int | None = None, ttt_steps: int = 1, batch_size: int = 1, max_minutes: float | None = None,
          device: str = "cpu", seed: int = 0, log_every: int = 50, holdout: float = 0.05) -> dict:
    """Trains a head and saves it with save_head; returns the recipe and results.
    Shards are shuffled (seeded); a `holdout` fraction (none under 20 shards) is
    left out and measured after every epoch; the epoch best on it is the head
    saved, and its top-1 the one to trust (a small dump is soon memorized).
    `init`: a head directory to continue from instead of a fresh head, e.g. one
    trained on other data. `draft_vocab`: EAGLE-3's draft vocabulary size, its
    tokens the dump's most frequent replied ones (DRAFT_VOCAB for a new head; an
    `init` head keeps its own unless a size is given: redraw_vocabulary).
    `bf16`: mixed precision, the products in bfloat16 (autocast) while weights and
    optimizer state stay fp32 (SmolLM2's head on an AVX512-BF16 CPU: 1.65x the steps/s).
    `batch_size`: sequences per optimizer step (an accelerator wants dozens)."""
    torch.manual_seed(seed)
    data, rng = pathlib.Path(data), random.Random(seed)
    layers = json.loads((data / "meta.json").read_text())["layers"]
    online = not layers
    target = load_target(target_dir, device, keep_decoder=online)
    num_layers = target.config["num_hidden_layers"]
    layers = layers or default_layers(num_layers)
    wanted = (num_layers,) if kind == "eagle" else default_aux_layers(num_layers)
    if missing := sorted({*wanted, num_layers} - set(layers)):
        raise ValueError(f"{data} lacks hidden_states {missing} that a {kind} head needs (it has {layers})")
    feature_index, final_index = [layers.index(i) for i in wanted], layers.index(num_layers)
    paths = shard_paths(data)
    rng.shuffle(paths)
    held = paths[:int(len(paths) * holdout)] if len(paths) >= 20 else []
    paths = paths[len(held):]
    if not paths:
        raise ValueError(f"{data} has no shards")
    if init:
        head = build_head(read_head(init, kind, target.config), target.embed, target.lm_head).to(device).train()
        if kind == "eagle3" and draft_vocab:
            head = redraw_vocabulary(head, target, draft_vocabulary(paths, target.embed.shape[0], draft_vocab)
                                     .to(device)).train()
        draft_ids = head.draft_token_ids
    else:
        draft_ids = (draft_vocabulary(paths, target.embed.shape[0], draft_vocab or DRAFT_VOCAB)
                     if kind == "eagle3" else None)
        head = make_head(kind, target, draft_ids).to(device).train()
    lm_rows = target.lm_head if draft_ids is None else target.lm_head[draft_ids.to(device)]

    def run(batch):
        tokens, mask, hidden = read_batch(batch)
        tokens, mask = tokens.to(device), mask.to(device)
        hidden = hidden_states_of(target.decoder, tokens, layers) if online else hidden.to(device)
        with torch.autocast(torch.device(device).type, torch.bfloat16, enabled=bf16):
            return sequence_loss(head, lm_rows, tokens, mask, hidden[:, :, feature_index].flatten(2),
                                 hidden[:, :, final_index], ttt_steps)

    held_batches = [held[i:i + batch_size] for i in range(0, len(held), batch_size)]
    best = None  # (held-out loss, top-1, epoch, weights): the head saved is the epoch best on held-out data

    def keep_if_best(epoch: float) -> None:
        nonlocal best
        with torch.no_grad():
            loss, top1 = _mean([row for row in map(run, held_batches) if row[0] is not None])
        log.info("held out", epoch=epoch, loss=round(loss.item(), 4), top1=top1)
        # The sum of the steps' top-1 rates: roughly the draft tokens a chain gets accepted.
        if best is None or sum(top1) > sum(best[1]):
            best = (loss.item(), top1, epoch, copy.deepcopy(head.state_dict()))

    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    lengths = {path: shard_length(path) for path in paths}
    per_epoch = math.ceil(len(paths) / batch_size)
    total_steps, budget = epochs * per_epoch, (max_minutes or math.inf) * 60
    history, start = [], time.monotonic()  # (loss, hits, positions) per step
    with tqdm(total=total_steps, desc=f"train-head {kind}", unit="batch") as bar:
        for step in range(total_steps):
            if step % per_epoch == 0:
                if step and held:
                    keep_if_best(step // per_epoch)
                batches = length_grouped_batches(paths, lengths, batch_size, rng)
            elapsed = time.monotonic() - start
            if step and elapsed >= budget:  # at least one step, so there is a head to save
                log.info("time budget reached", minutes=max_minutes, steps=step)
                break
            for group in optimizer.param_groups:
                group["lr"] = lr * _lr_factor(min(1.0, max(step / total_steps, elapsed / budget)))
            loss, hits, counted = run(batches[step % per_epoch])
            bar.update(1)
            if loss is None:
                continue
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), GRAD_CLIP)
            optimizer.step()
            history.append((loss.item(), hits, counted))
            if len(history) % log_every == 0:
                recent = _mean(history[-log_every:])
                bar.set_postfix(loss=f"{recent[0]:.3f}", top1=f"{recent[1][0]:.3f}")
                log.info("train", step=len(history), loss=round(recent[0], 4), top1=recent[1],
                         lr=optimizer.param_groups[0]["lr"], steps_per_s=round(len(history) / elapsed, 2))
    seconds = time.monotonic() - start
    if not history:
        raise ValueError(f"{data}: no step had a loss-masked position")
    window = max(1, min(log_every, len(history) // 5))
    if held:
        keep_if_best(round(len(history) / per_epoch, 2))
        head.load_state_dict(best[3])
    held_loss, held_top1, saved_epoch = best[:3] if best else (None, None, None)
    results = {
        "kind": kind, "data": str(data), "target": str(target_dir), "init": init and str(init), "shards": len(paths),
        "held_out_shards": len(held), "steps": len(history), "epochs": round(len(history) / per_epoch, 2), "lr": lr,
        "bf16": bf16, "ttt_steps": ttt_steps, "batch_size": batch_size, "online": online,
        "draft_vocab": None if draft_ids is None else len(draft_ids), "seconds": round(seconds, 1),
        "steps_per_s": round(len(history) / seconds, 3),
        "initial_loss": _mean(history[:window])[0], "final_loss": _mean(history[-window:])[0],
        "initial_top1": _mean(history[:window])[1], "final_top1": _mean(history[-window:])[1],
        "held_out_loss": held_loss, "held_out_top1": held_top1, "saved_epoch": saved_epoch,
    }
    save_head(head.cpu(), output, target.config, torch.bfloat16, {"speclane_training": results})
    log.info("trained", output=str(output), **results)
    return results


def _mean(rows) -> tuple[float, list[float]]:
    """Mean loss per sequence, and per training-time-test step the top-1 rate over its positions."""
    steps = max(len(r[1]) for r in rows)
    top1 = [sum(r[1][j] for r in rows if j < len(r[1])) / max(1, sum(r[2][j] for r in rows if j < len(r[2])))
            for j in range(steps)]
    return sum(r[0] for r in rows) / len(rows), [round(rate, 4) for rate in top1]
