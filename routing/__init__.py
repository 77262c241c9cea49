"""kvgate's routing core: pure Python, no I/O, no asyncio, no global state, time passed in."""
