"""Stop strings over streamed text.

The output ends right before the first stop string, which is itself excluded
(OpenAI semantics). "First" means the occurrence that is complete earliest in
the text (ties: the one starting earliest), which is what a reader scanning the
text character by character would see -- so the result does not depend on how
the text was split into chunks. Text that could still be the start of a stop
string is held back until the next chunk decides it.
"""

from collections.abc import Sequence


def first_stop(text: str, stop_strings: Sequence[str]) -> tuple[int, str] | None:
    """(where it starts, which) of the first stop string in `text`; None if there is none."""
    best = None  # (end, start, stop) of the first complete occurrence
    for stop in stop_strings:
        start = text.find(stop)
        if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    return None if best is None else best[1:]


def partial_stop_len(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stop_strings:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


class StopStringMatcher:
    def __init__(self, stop_strings: Sequence[str]):
        if any(not stop for stop in stop_strings):
            raise ValueError("stop strings must not be empty")
        self.stop_strings = list(stop_strings)
        self.held = ""
        self.matched: str | None = None  # the stop string that ended the output

    def push(self, text: str) -> tuple[str, bool]:
        """Adds streamed text; returns (text safe to emit, whether a stop string was hit).

        After a hit, the caller ends the output: nothing more should be pushed.
        """
        buffer = self.held + text
        found = first_stop(buffer, self.stop_strings)
        if found is not None:
            self.held, self.matched = "", found[1]
            return buffer[:found[0]], True
        keep = partial_stop_len(buffer, self.stop_strings)
        self.held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep], False

    def flush(self) -> str:
        """Held-back text, released when the generation ends without a stop string."""
        held, self.held = self.held, ""
        return held
