"""Multi-turn environments with tools (see formats, protocol)."""
