"""OpenAI-compatible HTTP proxy (aiohttp) in front of an engine worker. Never imports torch."""
