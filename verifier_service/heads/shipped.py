"""Heads we train and ship for packaged models (shipped/<model>/<kind>/). No
torch here: the verifier's config checks a head is there before any loading."""

import pathlib

SHIPPED = pathlib.Path(__file__).parent / "shipped"
METHOD_KINDS = {"eagle": "eagle", "eagle3": "eagle3", "mtp": "mtp", "deepseek_mtp": "mtp"}


def shipped_head(target: str, method: str) -> pathlib.Path | None:
    """The head shipped for `target` (a packaged model name or its directory) and `method`."""
    directory = SHIPPED / pathlib.Path(target).name / METHOD_KINDS[method]
    return directory if directory.is_dir() else None


def shipped_heads() -> list[str]:
    """'model/kind' of every shipped head."""
    return sorted(f"{d.parent.name}/{d.name}" for d in SHIPPED.glob("*/*") if d.is_dir())
