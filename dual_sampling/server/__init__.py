"""The OpenAI-compatible server's parts: its request and response models (``protocol``)."""
