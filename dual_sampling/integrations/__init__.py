"""Adapters that put mixture sampling inside other projects' training loops (:mod:`.trl`: TRL's trainers)."""
