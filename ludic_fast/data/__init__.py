"""Data preparation: SAW items, token-budget batching, credit, filters, curriculum, JSONL and pair data."""
