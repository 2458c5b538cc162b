"""Build tooling: turn an embedding model into a TorchServe .mar and register it."""
