"""kvgate's HTTP edge: OpenAI routes, admin API, proxying, upstream pool, scraping, tenancy."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvgate")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
