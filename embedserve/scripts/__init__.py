"""Operator scripts: start, wait for and stop TorchServe."""
