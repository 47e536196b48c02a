"""`speclane bench verifier`'s in-process judging section on a tiny model."""

from speclane_cli.bench.verifier import JUDGED, JUDGED_DRAFTS, judging


def test_the_judging_section_times_every_setting_with_each_draft():
    rows = judging(num_seqs=3, repeats=2, vocab_size=512)
    assert [(row["sampling"], row["draft"], row["draft_tokens"]) for row in rows] == [
        (name, draft, k) for name, _ in JUDGED for draft, (k, _) in JUDGED_DRAFTS.items()]
    for row in rows:
        assert row["sequences"] == 3 and row["vocab"] == 512
        assert 0 < row["forward_ms"] <= row["pass_ms"]
        assert abs(row["host_ms"] - (row["pass_ms"] - row["forward_ms"])) < 0.02  # the fields rounded apart
    operations = {(row["sampling"], row["draft"]): row["operations"] for row in rows}
    # The same pass with a repetition penalty dispatches more operations, counted in its scope only.
    assert 0 < operations["greedy", "none"] < operations["greedy, repetition penalty 1.05", "none"]
