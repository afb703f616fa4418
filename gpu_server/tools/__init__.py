"""Sub-commands that work on what a server wrote or on a running server: report, summary, compare, recheck, health
(docs/design.md §6.1)."""
