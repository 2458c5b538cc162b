"""Everything that knows TorchServe: the worker's entry (entry.py), the limits of the frontend above
it (frontend.py), and what TorchServe decides before or around the handler (profile.py)."""
