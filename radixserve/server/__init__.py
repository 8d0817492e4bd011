"""HTTP server: aiohttp routes and API dialects; they reach the core through radixserve.client."""
