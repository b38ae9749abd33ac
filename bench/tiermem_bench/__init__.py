"""The tiermem application benchmark harness (`tiermem bench apps`)."""
