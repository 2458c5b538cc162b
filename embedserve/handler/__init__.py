"""Text-embedding handler: a server-agnostic engine plus one adapter per server (torchserve/)."""
