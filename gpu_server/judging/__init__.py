"""Metrics of one output and the verdicts on them: the two-way status and the precision standards (docs/design.md §6.5,
docs/standards.md)."""
