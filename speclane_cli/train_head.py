"""`speclane train-head`: train an EAGLE or EAGLE-3 head on a dump from
`speclane extract-hidden-states` and save it in the layout vLLM loads."""

import torch

from speclane.models import resolve_model
from verifier_service.heads.extract import pick_device
from verifier_service.heads.train import DRAFT_VOCAB, train


def add_arguments(parser) -> None:
    parser.add_argument("--kind", required=True, choices=("eagle", "eagle3"))
    parser.add_argument("--data", required=True,
                        help="directory written by speclane extract-hidden-states (with --no-hidden-states: the "
                             "target runs as training goes)")
    parser.add_argument("--target", required=True, help="the target model the data was dumped from")
    parser.add_argument("--output", required=True, help="directory for model.safetensors + config.json")
    parser.add_argument("--init", default=None,
                        help="a head directory to continue training from (an EAGLE-3 head keeps its draft vocabulary "
                             "unless --draft-vocab is given)")
    parser.add_argument("--bf16", action="store_true",
                        help="mixed precision: products in bfloat16, weights and optimizer state in fp32")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (warmup, then cosine decay)")
    parser.add_argument("--draft-vocab", type=int, default=None,
                        help="EAGLE-3's reduced vocabulary: this many of the data's most frequent reply tokens "
                             f"(default {DRAFT_VOCAB} for a new head; with --init, drawn again: rows of tokens kept "
                             "stay)")
    parser.add_argument("--ttt-steps", type=int, default=1,
                        help="EAGLE-3 training-time-test steps (each adds about one step's cost)")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per optimizer step")
    parser.add_argument("--max-minutes", type=float, default=None, help="stop (and save) after this long")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda[:N] or npu[:N]")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50, help="steps between loss/top-1 log lines")


def run(args) -> int:
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # TF32 products for the target's online forward passes
    train(args.kind, args.data, resolve_model(args.target), args.output, init=args.init, bf16=args.bf16,
          epochs=args.epochs, lr=args.lr, draft_vocab=args.draft_vocab, ttt_steps=args.ttt_steps,
          batch_size=args.batch_size, max_minutes=args.max_minutes, device=device, seed=args.seed,
          log_every=args.log_every)
    return 0
