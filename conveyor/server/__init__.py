"""The OpenAI-compatible HTTP server (``conveyor serve``)."""
