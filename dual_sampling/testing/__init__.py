"""Test helpers that ship with the package: tiny model pairs and simulated engines that run the real plugins."""
