"""HTTP server: aiohttp front end in one process, the engine core in another."""
