"""Benchmark datasets: adapters to one Example schema, loading, and the bundled demo set."""
