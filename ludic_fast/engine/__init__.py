"""The one training engine (see the modules for each part)."""
