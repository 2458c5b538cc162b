"""Text-embedding handler for TorchServe: a server-agnostic engine plus one TorchServe adapter."""
