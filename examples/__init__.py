"""Runnable examples that drive both the agent and the server (not installed; run from the repository root)."""
