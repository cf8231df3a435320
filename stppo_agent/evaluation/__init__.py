"""Agents, benchmark evaluation, results files and their comparison."""
