"""vLLM's `extract_hidden_states` method, served: each request's prompt runs
through the target, its hidden states at the chosen layers go to one file per
request (the dump's shard format, extract.py), and one token is generated."""

import pathlib
import re

import structlog
import torch

from verifier_service.heads.extract import default_layers, write_shard

log = structlog.get_logger()


class HiddenStateCapture:
    def __init__(self, directory: str, layers: tuple[int, ...], text_config):
        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        num_layers = text_config.num_hidden_layers
        self.layers = tuple(layers) or default_layers(num_layers)
        if not all(0 <= i <= num_layers for i in self.layers):
            raise ValueError(f"eagle_aux_hidden_state_layer_ids must be within 0..{num_layers}, got {self.layers}")
        self.hidden_size = text_config.hidden_size
        # Keyed by the sequence itself: clients may reuse a request id.
        self._pending: dict[object, list[torch.Tensor]] = {}  # sequence -> its prompt chunks' features

    def add(self, seq, features: torch.Tensor) -> None:
        self._pending.setdefault(seq, []).append(features.detach().cpu())

    def write(self, seq) -> pathlib.Path:
        """The prompt's file, named by the request id: token_ids, loss_mask (all 1:
        serving traffic has no reply to single out) and hidden_states [N, layers, H]."""
        sequence_id, token_ids = seq.sequence_id, seq.tokens[: seq.prompt_len]
        features = torch.cat(self._pending.pop(seq))
        hidden = features.view(len(features), len(self.layers), self.hidden_size)
        # The id comes from a client: only a plain file name may reach the file system.
        path = self.directory / f"{re.sub(r'[^A-Za-z0-9_-]', '_', sequence_id)[:200]}.safetensors"
        write_shard(path, torch.tensor(token_ids), torch.ones(len(token_ids), dtype=torch.uint8), hidden,
                    {"layers": ",".join(map(str, self.layers)), "source": "serving"})
        log.info("hidden_states_written", sequence_id=sequence_id, tokens=len(token_ids), path=str(path))
        return path

    def forget(self, seq) -> None:
        self._pending.pop(seq, None)
