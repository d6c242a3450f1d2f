"""`pie serve`: the OpenAI, Anthropic and Gemini APIs on one port, each request an endpoint inferlet
(endpoints/) launched through the launch API, so its passes batch with every other program's."""
from .server import Server

__all__ = ["Server"]
