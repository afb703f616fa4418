"""Accepted records made durable before they are acknowledged, the journal of what is reported, and recovery after a
restart (docs/design.md §6.3)."""
