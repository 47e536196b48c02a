"""The grammar's masks along a draft, with the real SmolLM2 tokenizer."""

import pytest
import torch

from speclane.models import pulled_model_dir
from verifier_service.errors import InvalidRequest
from verifier_service.grammar import GrammarCompiler

SMOLLM2 = pulled_model_dir("smollm2-135m-instruct")
pytestmark = pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").exists(), reason="run `speclane pull` first")
VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(str(SMOLLM2), VOCAB)


@pytest.fixture(scope="module")
def tokens(compiler):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def test_each_draft_node_is_judged_in_the_state_its_path_reaches(compiler, tokens):
    matcher = compiler.matcher('start: "yes" | "no"')
    [yes], [no], [maybe] = tokens("yes"), tokens("no"), tokens("maybe")
    # A tree: root children "yes" (0), "maybe" (1); "no" (2) under "yes".
    masks = matcher.row_masks([yes, maybe, no], [-1, -1, 0])
    assert masks.shape == (4, VOCAB)
    assert masks[0, yes] and masks[0, no] and not masks[0, maybe]
    assert masks[1].nonzero().flatten().tolist() == [EOS]  # after "yes" the grammar is complete
    assert masks[2].all()  # "maybe" is refused at row 0, so its row never decides anything
    assert masks[3].all()  # "no" after "yes" is refused too
    # Judging drafts leaves the matcher where the committed tokens put it.
    assert matcher.row_masks([], [])[0, no]


def test_commit_moves_the_grammar_on(compiler, tokens):
    matcher = compiler.matcher('start: %json {"type": "object", "properties": {"a": {"type": "integer"}}, '
                               '"required": ["a"], "additionalProperties": false}')
    text = tokens('{"a": 12}')
    matcher.commit(text[:-1])
    allowed = matcher.row_masks([], [])[0]
    assert allowed[text[-1]] and not allowed[tokens("x")[0]]
    matcher.commit(text[-1:])
    assert matcher.row_masks([], [])[0].nonzero().flatten().tolist() == [EOS]


def test_a_grammar_that_does_not_compile_is_invalid_argument(compiler):
    with pytest.raises(InvalidRequest, match="does not compile"):
        compiler.matcher('start: %json {"type": "objec"}')


def test_masks_are_as_wide_as_the_logits(tokens):
    wide = GrammarCompiler(str(SMOLLM2), VOCAB + 64).matcher('start: "yes"')
    masks = wide.row_masks(tokens("yes"), [-1])
    assert masks.shape == (2, VOCAB + 64) and not masks[:, VOCAB:].any() and masks.dtype == torch.bool
