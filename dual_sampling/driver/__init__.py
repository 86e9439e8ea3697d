"""The driver: the engine pair, its settings checks, and the asyncio scheduler that feeds it requests."""
