"""A call's fate: the waiting calls and their kept graphs (pending), the checker that turns a job into rows, the worker
pool, collectives matched across ranks, and the test pooled across calls (docs/design.md §6.3)."""
