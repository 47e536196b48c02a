"""Model drafters that read the target's hidden states (EAGLE, EAGLE-3, MTP):
the head modules, their checkpoints, per-sequence drafting, and the tools that
make a head (hidden-state extraction, training)."""
