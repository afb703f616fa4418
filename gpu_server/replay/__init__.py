"""Running an API again on the bench: the allowlist and its argument checks, the replay itself, the spread runs, fused
operators, extensions and the capped worker processes (docs/design.md §6.4, §6.8)."""
