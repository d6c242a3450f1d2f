"""The playground: a page at `/` of pie serve to write a program, run it, and watch the engine
(routes.py); its assets (index.html, the scripts and the style) are files of this folder."""
from .routes import PAGES, ROUTES

__all__ = ["PAGES", "ROUTES"]
